"""The per-occupancy policy: labels, the stored picks' round trip, and what a missing pick
does (nothing here compiles)."""

import logging

import pytest

from jspec import tune_store
from jspec.engine.policy import PLAIN, Policy, buckets_for, mode_label, parse_mode, pick
from jspec.spec_config import SpecConfig


class _Drafter:
    def __init__(self, source):
        self.source = source


def test_buckets_and_labels():
    assert buckets_for(1) == [1] and buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(6) == [1, 2, 4, 6]
    for mode in (PLAIN, None, SpecConfig.chain(3), SpecConfig(5, 4, 8, "calibrated")):
        assert parse_mode(mode_label(mode)) == mode
    assert mode_label(SpecConfig(5, 4, 8, "calibrated")) == "5,4,8/cal"


def test_a_near_tie_goes_to_plain():
    chain = SpecConfig.chain(3)
    rates = {1: {"plain": 400.0, "3,1,4": 415.0}, 2: {"plain": 400.0, "3,1,4": 425.0},
             4: {"3,1,4": 415.0, "default": 400.0}}
    got = pick(rates, [PLAIN, chain, None]).picks
    assert got == {1: PLAIN, 2: chain, 4: chain}          # 3.75% is a tie, 6.25% is not;
    assert pick(rates, [PLAIN, chain, None], margin=1.0).picks[1] == chain   # no plain: fastest


def test_stored_picks_round_trip(tmp_path, caplog):
    rates = {1: {"plain": 400.0, "3,1,4": 650.0}, 2: {"plain": 640.0, "3,1,4": 620.0}}
    policy = pick(rates, [PLAIN, SpecConfig.chain(3)])
    assert policy.picks == {1: SpecConfig.chain(3), 2: PLAIN}
    tune_store.store_occupancy(rates, {b: mode_label(m) for b, m in policy.picks.items()},
                               tmp_path, device="cpu:test", measured_at={"max_new_cap": 512})
    got = Policy.stored(_Drafter(tmp_path), [1, 2], device="cpu:test")
    assert got.picks == policy.picks
    with caplog.at_level(logging.WARNING, logger="jspec"):
        partial = Policy.stored(_Drafter(tmp_path), [1, 2, 4], device="cpu:test")
    assert partial.picks[4] is None and "bucket(s) [4]" in caplog.text    # the default spec
    assert Policy.stored(_Drafter(None), [1]).picks == {1: None}
    with pytest.raises(ValueError, match=r"no pick for bucket\(s\) \[8\]"):
        got.check_buckets([1, 2, 8])
