"""Speculative generation is exact: for every drafter (random weights: exactness must not
depend on drafter quality) and for an oracle that knows the target's greedy output, as a
chain, as the default tree and as a wide tree, at batch 1 and for a ragged batch of 4."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import decode
from jspec.checkpoint import load_target
from jspec.drafters import Drafter, Oracle, random_drafter
from jspec.shapes import check_shapes
from jspec.spec_config import SpecConfig
from jspec.spec_decode import SpecDecoder

NEW = 40
MODES = {"chain": SpecConfig.chain(4), "default": None, "wide": SpecConfig(6, 8, 32)}


@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    return target, cases


@pytest.fixture(scope="module")
def drafters(stories):
    target, _ = stories
    return {k: random_drafter(k, target.config, jax.random.key(3), **kw)
            for k, kw in [("eagle1", {}), ("eagle3", {}), ("mtp", {}), ("medusa", {"num_heads": 6})]}


def batch_for(cases, size):
    # Ragged: different prompt lengths and different per-row limits.
    if size == 1:
        return [cases[0]["prompt_token_ids"]], [NEW]
    return [c["prompt_token_ids"] for c in cases[1:5]], [NEW, 17, 33, 25]


# Every combination compiles its own program (~5 s each here); the default run covers the
# ragged batch of 4 for every drafter and mode and batch 1 in the default mode, the rest
# of the batch-1 matrix runs with -m slow.
def combos():
    for kind in ["eagle1", "eagle3", "mtp", "medusa"]:
        for mode in MODES:
            yield pytest.param(kind, mode, 4, id=f"{kind}-{mode}-4")
            marks = () if mode == "default" else (pytest.mark.slow,)
            yield pytest.param(kind, mode, 1, id=f"{kind}-{mode}-1", marks=marks)


@pytest.mark.parametrize("kind,mode,size", list(combos()))
def test_greedy_identical_to_plain(stories, drafters, kind, mode, size):
    target, cases = stories
    prompts, limits = batch_for(cases, size)
    plain = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[])
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[], drafter=drafters[kind],
                         spec=MODES[mode])
    assert res.tokens == plain.tokens
    for st, lim in zip(res.stats, limits):
        assert st["new_tokens"] == lim and st["iterations"] >= 1
        assert sum(st["accept_hist"]) == st["iterations"]


@pytest.mark.parametrize("kind,mode", [("eagle3", "default"),
                                       pytest.param("eagle1", "wide", marks=pytest.mark.slow),
                                       pytest.param("mtp", "wide", marks=pytest.mark.slow)])
def test_greedy_identical_under_calibrated_selection(stories, drafters, rank_model, kind, mode):
    """Acceptance-aware selection drafts other trees (tests/tree/test_calibration.py shows they
    differ); the output must not change."""
    from jspec.drafters.calibration import attach
    target, cases = stories
    prompts, limits = batch_for(cases, 4)
    spec = (MODES[mode] or drafters[kind].default_spec).with_selection("calibrated")
    drafter = attach(drafters[kind], rank_model(target.config.vocab_size))
    plain = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[])
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[], drafter=drafter,
                         spec=spec)
    assert res.tokens == plain.tokens


def test_greedy_identical_to_plain_per_layer_stack(stories, drafters, monkeypatch):
    """The layout CPU users run by default (the suite scans the stack, see conftest)."""
    from jspec import serving_layout
    monkeypatch.setenv(serving_layout.STACKED_ENV, "0")
    test_greedy_identical_to_plain(stories, drafters, "eagle3", "default", 4)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_greedy_identical_across_live_length_buckets(stories, drafters, kind):
    """Small pages make a long page table (>= 16 pages per row), so the reference attention
    reads a live-length bucket of it (jspec.attention.reach_buckets) and the rows grow through
    several buckets; tokens must equal plain decoding with the default pages (one bucket)."""
    from jspec import attention
    target, cases = stories
    prompts, limits = batch_for(cases, 4)
    plain = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[])
    small = dict(max_new_tokens=limits, stop_ids=[], page_size=2)
    assert len(attention.reach_buckets(-(-(len(prompts[0]) + max(limits)) // 2))) > 1
    assert jspec.generate(target, prompts, **small).tokens == plain.tokens
    res = jspec.generate(target, prompts, **small, drafter=drafters[kind])
    assert res.tokens == plain.tokens


def oracle_for(target, prompts, cases_rows, limits, max_len=256):
    """The target's own greedy continuation, as the oracle's known future (longer than the
    limits, so the last iteration's drafts are right too)."""
    plain = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[])
    longer = jspec.generate(target, prompts, max_new_tokens=max(limits) + 8, stop_ids=[])
    fut = np.zeros((len(prompts), max_len), np.int32)
    for r, (p, t) in enumerate(zip(prompts, longer.tokens)):
        fut[r, :len(p) + len(t)] = p + t
    return Drafter(Oracle(target.config.vocab_size), {"future": jnp.asarray(fut)}), plain


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("mode", list(MODES))
def test_oracle_reaches_max_accept_every_iteration(stories, mode, size):
    target, cases = stories
    prompts, limits = batch_for(cases, size)
    oracle, plain = oracle_for(target, prompts, cases, limits)
    spec = MODES[mode] or SpecConfig(5, 4, 8)
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[], drafter=oracle, spec=spec)
    assert res.tokens == plain.tokens
    S = spec.num_steps
    for st in res.stats:
        hist = st["accept_hist"]
        # Every iteration emitted S+1 tokens (the last one may be cut by the row's limit,
        # but the verify still accepted the whole path).
        assert hist[S + 1] == st["iterations"], hist
        assert st["mean_accept_len"] == S + 1


def test_miss_rate_oracle_is_exact_with_varied_accepts(stories):
    target, cases = stories
    prompts, limits = batch_for(cases, 4)
    oracle, plain = oracle_for(target, prompts, cases, limits)
    oracle = Drafter(Oracle(target.config.vocab_size, miss_rate=0.3), oracle.params)
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[], drafter=oracle)
    assert res.tokens == plain.tokens
    hist = np.sum([st["accept_hist"] for st in res.stats], 0)
    assert np.count_nonzero(hist) >= 4, hist      # rows accept their own, varied, lengths


@pytest.mark.parametrize("spec", [SpecConfig.chain(4), SpecConfig(5, 4, 8)], ids=["chain", "tree"])
def test_padded_verify_block_is_exact(stories, monkeypatch, spec):
    """TPU/GPU pad a batched verify block with dummy tokens (spec_decode.verify_padding); here
    the padding is forced on CPU: the oracle (varied accepts) still gives plain decoding's
    tokens, so the dummies reach no real node and nothing of them is kept."""
    from jspec import executables, spec_decode
    target, cases = stories
    prompts, limits = batch_for(cases, 4)
    oracle, plain = oracle_for(target, prompts, cases, limits)
    oracle = Drafter(Oracle(target.config.vocab_size, miss_rate=0.3), oracle.params)
    calls = []
    monkeypatch.setattr(spec_decode, "verify_padding", lambda b, n: calls.append(n) or 3)
    def forget():               # trace anew, padded (and leave no padded program behind)
        jax.clear_caches()
        executables.clear()

    forget()
    try:
        res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[], drafter=oracle,
                             spec=spec)
    finally:
        forget()
    assert calls, "the verify block was not traced with padding"
    assert res.tokens == plain.tokens
    hist = np.sum([st["accept_hist"] for st in res.stats], 0)
    assert np.count_nonzero(hist) >= 3, hist


def test_stop_ids_inside_an_accepted_block(stories):
    target, cases = stories
    prompt = cases[0]["prompt_token_ids"]
    cont = cases[0]["continuation_token_ids"]
    oracle, _ = oracle_for(target, [prompt, prompt], cases, [30, 30])
    stop = cont[7]
    res = jspec.generate(target, [prompt, prompt], max_new_tokens=30, drafter=oracle,
                         stop_ids=[[stop], []])
    assert res.tokens[0] == cont[:cont.index(stop) + 1]
    assert res.stats[0]["stop_reason"] == "stop_token"
    assert res.tokens[1] == cont[:30]


def test_no_recompilation_and_no_host_transfer_in_loop(stories, drafters):
    target, cases = stories
    d = drafters["eagle1"]
    jspec.generate(target, [cases[0]["prompt_token_ids"]], max_new_tokens=20, drafter=d, stop_ids=[])
    before = decode.TRACE_COUNTS["spec"]
    jspec.generate(target, [cases[1]["prompt_token_ids"]], max_new_tokens=20, drafter=d, stop_ids=[7])
    jspec.generate(target, [cases[2]["prompt_token_ids"]], max_new_tokens=20, drafter=d, seed=4)
    assert decode.TRACE_COUNTS["spec"] == before

    # Run the compiled loop directly on device inputs with every transfer disallowed: any
    # device-to-host copy inside the loop (a callback, a Python branch on a value) raises.
    dec = SpecDecoder(target.config, d.module, d.default_spec, jspec.SamplingConfig(), 20, 16, 8)
    pt = jnp.asarray(jspec.kv_cache.allocate_page_table([64], 16, 8, 8))
    args = (target.params, d.params, jnp.asarray([cases[0]["prompt_token_ids"] + [0] * 11]),
            jnp.asarray([5]), pt, pt, jnp.asarray([[-1]]), jnp.asarray([20]), jax.random.key(0))
    jax.block_until_ready(dec.run(*args))
    with jax.transfer_guard("disallow"):
        state = jax.block_until_ready(dec.run(*args))
    check_shapes(state)
    got = np.asarray(state.tokens)[0, :20].tolist()
    assert got == cases[0]["continuation_token_ids"][:20]


def test_profile_mode_reports_shares_and_is_exact(stories, drafters):
    target, cases = stories
    prompts, limits = batch_for(cases, 4)
    plain = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[])
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[],
                         drafter=drafters["eagle3"], profile=True)
    assert res.tokens == plain.tokens
    shares = [res.profile[f"{k}_share"] for k in ("draft", "verify", "other")]
    assert abs(sum(shares) - 1) < 1e-9 and min(shares) > 0


def test_forced_accept_mode_hits_requested_mean(stories, drafters):
    target, cases = stories
    prompts, _ = batch_for(cases, 4)
    for E in (2.0, 3.5):
        res = jspec.generate(target, prompts, max_new_tokens=60, stop_ids=[], drafter=drafters["eagle1"],
                             forced_accept=E)
        hist = np.sum([st["accept_hist"] for st in res.stats], 0)
        mean = (hist * np.arange(len(hist))).sum() / hist.sum()
        assert abs(mean - E) < 0.35, (E, mean)


class TestBadKnobs:
    def test_rejected_before_compiling(self, stories, drafters):
        target, cases = stories
        before = decode.TRACE_COUNTS["spec"]
        with pytest.raises(ValueError, match="topk=1 is a chain"):
            jspec.generate(target, [[1, 2]], drafter=drafters["eagle1"], spec=SpecConfig(4, 1, 3))
        with pytest.raises(ValueError, match="medusa has 6 heads"):
            jspec.generate(target, [[1, 2]], drafter=drafters["medusa"], spec=SpecConfig(7, 2, 8))
        with pytest.raises(ValueError, match="forced_accept"):
            jspec.generate(target, [[1, 2]], drafter=drafters["eagle1"], forced_accept=9)
        with pytest.raises(ValueError, match="speculative overshoot"):
            jspec.generate(target, [[1, 2]], drafter=drafters["eagle1"], max_new_tokens=10, max_len=16)
        with pytest.raises(ValueError, match="unknown selection"):
            SpecConfig(5, 4, 8, "best")
        with pytest.raises(ValueError, match="jspec.train calibrate"):
            jspec.generate(target, [[1, 2]], drafter=drafters["eagle3"],
                           spec=SpecConfig(5, 4, 8, "calibrated"))
        with pytest.raises(ValueError, match="fixed tree"):
            jspec.generate(target, [[1, 2]], drafter=drafters["medusa"],
                           spec=SpecConfig(3, 2, 4, "calibrated"))
        other = random_drafter("eagle1", target.config.replace(hidden_size=32, head_dim=4))
        with pytest.raises(ValueError, match="hidden size 32"):
            jspec.generate(target, [[1, 2]], drafter=other)
        assert decode.TRACE_COUNTS["spec"] == before
