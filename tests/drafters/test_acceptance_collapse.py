"""The acceptance-collapse detector (issue 14's bug class): a drafter loaded from a checkpoint
that accepts almost no first drafts gets a warning naming the likely cause; a healthy head and
an in-memory random head (which claims nothing) do not."""

import dataclasses
import logging
from pathlib import Path

import jax.numpy as jnp
import pytest

import jspec
from jspec.checkpoint import load_target
from jspec.drafters import load_drafter, random_drafter
from jspec.drafters.health import first_step_acceptance, likely_causes
from jspec.generate import check_acceptance

ROOT = Path(__file__).parents[2] / "checkpoints/default"


@pytest.fixture(scope="module")
def shipped():
    target = load_target(ROOT / "target")
    prompts = [p for p in (ROOT / "drafters/heldout_prompts.txt").read_text().split("\n")
               if p.strip()][:4]
    return target, load_drafter(ROOT / "drafters/eagle3", target), prompts


def test_first_step_acceptance_counts_passes_that_kept_a_draft():
    stats = [{"accept_hist": [0, 3, 1, 0]}, {"accept_hist": [2, 1, 0, 5]}]
    assert first_step_acceptance(stats) == (6 / 10, 10)     # n = 0 (done rows) is no pass


def test_zeroed_d2t_warns_and_names_d2t(shipped, caplog):
    target, d, prompts = shipped
    broken = dataclasses.replace(d, params={**d.params, "d2t": jnp.zeros_like(d.params["d2t"])})
    with caplog.at_level(logging.WARNING, logger="jspec"):
        rate = check_acceptance(target, broken, prompts, new_tokens=32)
    assert rate < 0.05
    assert "accepted" in caplog.text and "d2t map is all zeros" in caplog.text
    assert "aux-layer convention" in caplog.text        # the next suspect for an EAGLE-3 head
    assert str(d.source) in caplog.text


def test_healthy_and_random_heads_do_not_warn(shipped, caplog):
    target, d, prompts = shipped
    with caplog.at_level(logging.WARNING, logger="jspec"):
        assert check_acceptance(target, d, prompts, new_tokens=32) > 0.3
        rnd = random_drafter("eagle3", target.config)     # accepts ~nothing, claims nothing
        jspec.generate(target, prompts, max_new_tokens=32, drafter=rnd)
    assert "first drafts" not in caplog.text
    assert "d2t map is all zeros" not in " ".join(likely_causes(d))
