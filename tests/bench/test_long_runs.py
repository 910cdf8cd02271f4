"""Long runs: a KV budget that runs out mid-run (``kv_admission="partial"``), and (slow) a
~16k-token generation and 200 consecutive calls on the shipped model, whose memory and
compile counts must stay flat (:mod:`benchmarks.long_run` measures; these assert)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import jspec
from jspec import decode, kv_cache as kvc
from benchmarks import long_run
from jspec.checkpoint import load_target
from jspec.drafters import ngram_drafter
from jspec.spec_decode import tree_shape

PS = 16


# --------------------------------------------------------------------------- the allocator
def test_partial_table_gives_minimums_then_row_order():
    # Minimums 1, 1, 2 pages; needs 3, 4, 2; a pool of 6 leaves 2 pages: both go to row 0.
    table = kvc.partial_page_table([4, 4, 5], [12, 16, 8], 4, 6)
    held = (table < 6).sum(1).tolist()
    assert held == [3, 1, 2]
    assert sorted(table[table < 6].tolist()) == list(range(6))     # every page once
    # A pool that holds every need gives exactly what reserve admission gives.
    np.testing.assert_array_equal(kvc.partial_page_table([4, 4, 5], [12, 16, 8], 4, 9),
                                  kvc.allocate_page_table([12, 16, 8], 4, 9))


def test_partial_table_refuses_when_minimums_do_not_fit():
    with pytest.raises(kvc.KVCacheExhaustedError,
                       match="even for partial admission: row 2 needs at least 2 pages"):
        kvc.partial_page_table([4, 4, 5], [12, 16, 8], 4, 3)


def test_capacity_is_each_rows_own_pages():
    table = kvc.partial_page_table([4, 4, 5], [12, 16, 8], 4, 6)
    cache = kvc.init_cache(1, 1, 2, table, 6, 4)
    assert cache.capacity.tolist() == [12, 4, 8]


# --------------------------------------------------------------------------- generate
@pytest.fixture(scope="module")
def stories(stories_dir):
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    return load_target(stories_dir, tokenizer=stories_dir / "tok512.bin"), cases


def starved_batch(cases, extra: int):
    """A budget too small for row 1 (100 new tokens): ``(prompts, limits, stop_ids,
    num_pages, room)``. Every row gets its minimum (prompt plus one iteration, for this
    overshoot); the one page left over goes to row 0 (row order), which needs it, so row 1
    keeps its minimum (``room`` slots), fewer pages than row 0 holds; row 2 needs no more."""
    prompts = [cases[i]["prompt_token_ids"] for i in (1, 0, 3)]
    limits = [20, 100, 4]
    cont2 = cases[3]["continuation_token_ids"]
    stop_ids = [[], [], [cont2[2]]]           # row 2 ends on its third token (or earlier)
    floor = [kvc.pages_needed(len(p) + max(extra, 1), PS) for p in prompts]
    need = [kvc.pages_needed(len(p) + n + extra, PS) for p, n in zip(prompts, limits)]
    assert need[0] == floor[0] + 1 and need[2] == floor[2] and need[1] > floor[1] + 1
    return prompts, limits, stop_ids, sum(floor) + 1, floor[1] * PS


def expected_rows(cases, limits, stop_ids):
    """What rows 0 and 2 produce with room: the golden greedy continuation (plain decoding,
    checked against an independent implementation in test_generate), cut at the limit and
    after the first stop id."""
    out = []
    for case, n, stops in zip([cases[1], cases[3]], limits[::2], stop_ids[::2]):
        toks = case["continuation_token_ids"][:n]
        hit = next((i for i, t in enumerate(toks) if t in stops), None)
        out.append((toks if hit is None else toks[:hit + 1],
                    "max_new_tokens" if hit is None else "stop_token"))
    return out


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "ngram"])
def test_row_that_runs_out_of_pages_stops_and_others_are_untouched(stories, drafted):
    target, cases = stories
    drafter = ngram_drafter(target.config) if drafted else None
    # The overshoot generate reserves past a row's last new token (none for plain).
    prompts, limits, stop_ids, pages, room = starved_batch(cases, long_run.overshoot(drafter, None))
    with pytest.raises(kvc.KVCacheExhaustedError, match="KV cache exhausted: row 1"):
        jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=stop_ids,
                       num_pages=pages, drafter=drafter)
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=stop_ids,
                         num_pages=pages, kv_admission="partial", drafter=drafter)
    for row, (toks, reason) in zip((0, 2), expected_rows(cases, limits, stop_ids)):
        assert res.tokens[row] == toks
        assert res.stats[row]["stop_reason"] == reason
    starved = res.tokens[1]
    assert res.stats[1]["stop_reason"] == "cache_full"
    assert 0 < len(starved) < limits[1]
    assert starved == cases[0]["continuation_token_ids"][:len(starved)]
    # It stopped because its pages were full: the next step's writes (plain: 1 slot;
    # speculative: a verify of N nodes) would not fit after its committed KV (every token
    # but the last, which the next step feeds).
    committed = len(prompts[1]) + len(starved) - 1
    step = 1 if drafter is None else tree_shape(drafter.module, drafter.default_spec)[1]
    assert committed + step > room >= committed


def test_partial_admission_refuses_before_compiling(stories):
    target, cases = stories
    before = sum(decode.TRACE_COUNTS.values())
    with pytest.raises(kvc.KVCacheExhaustedError, match="even for partial admission: row 1"):
        jspec.generate(target, [cases[0]["prompt_token_ids"]] * 2, max_new_tokens=50,
                       num_pages=1, kv_admission="partial")
    with pytest.raises(ValueError, match="kv_admission='lazy'"):
        jspec.generate(target, [cases[0]["prompt_token_ids"]], kv_admission="lazy")
    assert sum(decode.TRACE_COUNTS.values()) == before


# --------------------------------------------------------------------------- the bench
def test_call_schedule_warms_every_shape_first():
    sched = long_run.call_schedule(list(range(3, 300)), 512, 2, calls=40, max_new=8)
    shapes = [c.shape() for c in sched]
    assert len(sched) == 40 and len(set(shapes[:8])) == 8 and set(shapes[8:]) <= set(shapes[:8])
    for c in sched:
        assert max(c.limits) == 8 and len(c.stop_ids) <= 2
        assert all(p[0] == 0 and 16 * (c.shape()[1] - 1) < len(p) <= 16 * c.shape()[1]
                   for p in c.prompts)


def test_row_budget_stays_within_the_models_positions():
    assert long_run.row_budget(2048, 16, 22, None) == (2010, 2048)
    assert long_run.row_budget(2048, 16, 22, 512) == (512, 2048)
    with pytest.warns(UserWarning, match="max_position_embeddings=2048"):
        assert long_run.row_budget(2048, 16, 22, 16384) == (16384, 16422)


def test_many_calls_counts_traces_and_checks_plain(stories):
    target, cases = stories
    calls = [long_run.Call((tuple(cases[i]["prompt_token_ids"]),), (6,), stop, 0.0, i)
             for i, stop in ((0, ()), (1, (2,)), (2, ()))]
    r = long_run.many_calls(target, ngram_drafter(target.config), calls, check_every=1)
    assert (r["distinct_shapes"], r["compiles"], r["retraced"]) == (1, 1, [])
    assert (r["checked_against_plain"], r["mismatches"], r["invalid"]) == (3, [], [])
    assert r["tokens"] <= 18 and r["rss_end_mb"] > 0


# --------------------------------------------------------------------------- long runs (slow)
@pytest.fixture(scope="module")
def shipped():
    if not Path(long_run.DEFAULT_DRAFTER).exists():
        pytest.skip("checkpoints/default/drafters not shipped")
    return long_run.load_default()


@pytest.mark.slow
def test_16k_token_generation_memory_stays_flat(shipped):
    """8 rows up to the model's 2048 positions (16,080 new tokens, about the KV pool of one
    16k row), after a warm-up that compiled it and a 4k-token call of the same rows. Flat:
    nothing traces after the warm-up; RSS sampled during the long call does not grow from a
    quarter of the way in to the end (the loop allocates nothing per token); what it adds
    at its start, and its peak over the 4k call's, are at most its KV pool (the pools'
    difference) x2 (the program returns its pools and holds a loop copy besides), plus
    slack; the process ends where the warm-up left it."""
    target, drafter = shipped
    r = long_run.long_generation(target, drafter, long_run.text_prompts(target, 8))
    long_run.print_figures("long generation", r, long_run.LONG_COLUMNS)
    assert r["tokens"] == 8 * r["new_tokens_per_row"] >= 16_000
    assert r["short_tokens"] == 8 * 512 and r["short_is_prefix"]
    assert r["max_len"] == target.config.max_position_embeddings
    assert r["compiles"] == 2 and r["compiles_after_warmup"] == 0
    assert r["rss_growth_in_call_mb"] < 32
    assert r["rss_rise_in_call_mb"] < 2 * r["kv_pool_mb"] + 64
    assert r["rss_peak_long_minus_short_mb"] < 2 * r["kv_long_minus_short_mb"] + 64
    assert r["rss_end_mb"] - r["rss_after_warmup_mb"] < 64


@pytest.mark.slow
def test_200_calls_no_recompilation_and_flat_rss(shipped):
    """200 varied calls (2 prompt buckets, batch 1 and 2, stop ids, seeds, greedy and
    sampled) with the shipped EAGLE-3: one trace per distinct shape, none after; RSS after
    warm-up grows by less than 64 MB; every 10th greedy call equals plain decoding."""
    target, drafter = shipped
    cfg = target.config
    schedule = long_run.call_schedule(long_run.corpus_ids(target), cfg.vocab_size,
                                      cfg.eos_token_ids[0])
    r = long_run.many_calls(target, drafter, schedule)
    long_run.print_figures("200 calls", r, long_run.CALLS_COLUMNS)
    assert r["calls"] == 200 and r["distinct_shapes"] == 8
    assert r["retraced"] == [] and r["compiles"] == r["distinct_shapes"]
    assert r["invalid"] == []
    assert r["mismatches"] == [] and r["checked_against_plain"] >= 5
    assert r["rss_growth_after_warmup_mb"] < 64
