"""The serving engine is exact whatever its neighbours: every request's greedy tokens equal
plain decoding of it (for plain decoding and every drafter kind, chain and tree), sampled
tokens depend only on the request's own key (its slot, the arrival order, the other
requests and the spec chosen per occupancy do not matter), and a stream of new requests
compiles nothing new."""

import json

import jax
import numpy as np
import pytest

import jspec
from jspec import decode
from jspec.checkpoint import load_target
from jspec.drafters import ngram_drafter, random_drafter
from jspec.engine import Engine, Policy, Request
from jspec.engine.programs import PLAIN
from jspec.kv_cache import KVCacheExhaustedError
from jspec.sampling import SamplingConfig
from jspec.spec_config import SpecConfig

LIMITS = [23, 5, 31, 12, 17, 28]


@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    prompts = prompts + [prompts[1][:3] + prompts[0][1:4]]          # 6 prompts, ragged
    return target, prompts


@pytest.fixture(scope="module")
def plain(stories):
    """Plain decoding of every prompt in one static batch (rows of a static batch equal
    the row alone: tests/decode/test_generate.py)."""
    target, prompts = stories
    return jspec.generate(target, prompts, max_new_tokens=LIMITS, stop_ids=[]).tokens


def requests(prompts, order=None):
    order = range(len(prompts)) if order is None else order
    return [Request(prompts[i], LIMITS[i], stop_ids=[], id=i, seed=100 + i) for i in order]


def test_plain_engine_equals_generate_and_frees_pages(stories, plain):
    target, prompts = stories
    eng = Engine(target, slots=2, max_new_tokens=32, chunk=4)
    out = eng.generate(requests(prompts))
    assert [c.tokens for c in out] == plain
    assert [c.id for c in out] == list(range(len(prompts)))
    assert all(c.stats["stop_reason"] == "max_new_tokens" for c in out)
    assert eng.pages.free == eng.pages.num_pages          # every finished row gave its pages back
    # Refilled as rows finished: more requests than slots, never more live than slots.
    assert max(live for live, _, _ in eng.chunk_log) == 2
    assert {b for _, b, _ in eng.chunk_log} == {1, 2}


KINDS = [("eagle3", None), ("eagle3", SpecConfig.chain(3)), ("eagle1", None), ("mtp", None),
         ("medusa", None), ("dflash", SpecConfig(4, 2, 6)), ("model", None), ("ngram", None)]


def _drafter(kind, cfg):
    """A random drafter of ``kind`` for ``cfg`` (the n-gram drafter has no weights)."""
    if kind == "ngram":
        return ngram_drafter(cfg)
    kw = {"num_heads": 4} if kind == "medusa" else {}
    return random_drafter(kind, cfg, jax.random.key(7), **kw)


@pytest.mark.parametrize("kind,spec", KINDS, ids=[f"{k}-{'default' if s is None else 'chain' if s.is_chain else 'tree'}"
                                                   for k, s in KINDS])
def test_speculative_engine_greedy_equals_plain(stories, plain, kind, spec):
    target, prompts = stories
    drafter = _drafter(kind, target.config)
    eng = Engine(target, drafter, slots=2, spec=spec, max_new_tokens=32, chunk=3)
    out = eng.generate(requests(prompts, order=[3, 0, 5, 1, 4, 2]))
    assert [c.index for c in out] == list(range(6))
    assert {c.id: c.tokens for c in out} == dict(enumerate(plain))
    assert all(c.stats["iterations"] <= c.stats["new_tokens"] for c in out)
    assert eng.pages.free == eng.pages.num_pages


LAZY_KINDS = ["eagle3", "mtp", "medusa", "dflash", "ngram", "model"]


@pytest.mark.parametrize("kind", LAZY_KINDS)
def test_rows_joining_a_plain_occupancy_skip_the_drafter_prefill_and_stay_exact(stories, plain,
                                                                              kind):
    """Two slots decode plain, one speculates: a short prompt joining two live rows is
    inserted without its drafter's prefill, and when its neighbour finishes, the catch-up
    feeds its drafter from position 0. Greedy output stays plain decoding's. A draft model
    (whose prefill is not an extend from nothing) is always prefilled."""
    target, prompts = stories
    drafter = _drafter(kind, target.config)
    spec = SpecConfig(4, 2, 6) if kind == "dflash" else None
    eng = Engine(target, drafter, slots=2, policy=Policy({1: spec, 2: PLAIN}),
                 max_new_tokens=32, chunk=3)
    out = eng.generate(requests(prompts, order=[3, 0, 5, 1, 4, 2]), order="arrival")
    assert {c.id: c.tokens for c in out} == dict(enumerate(plain))
    modes = {mode for _, _, mode in eng.chunk_log}
    assert PLAIN in modes and len(modes) == 2 and eng.syncs > 0
    if kind == "model":
        assert eng.lazy_inserts == 0
    else:
        assert eng.lazy_inserts >= len(prompts) - 2


def test_sampling_depends_only_on_the_request(stories):
    """Sampled output, plain and speculative with the spec switched per occupancy, is the
    same whatever the slot count, the order and the neighbours: position-keyed draws make a
    speculative request's tokens those of plain decoding with its key."""
    target, prompts = stories
    samp = SamplingConfig(temperature=1.0, top_k=40)
    plain = Engine(target, slots=3, sampling=samp, max_new_tokens=32, chunk=4)
    ref = {c.id: c.tokens for c in plain.generate(requests(prompts))}
    # The same request alone, in a static batch of one (its row key: split(key(seed), 1)[0]).
    alone = jspec.generate(target, [prompts[2]], max_new_tokens=LIMITS[2], stop_ids=[],
                           temperature=1.0, top_k=40, seed=102)
    assert alone.tokens[0] == ref[2]
    drafter = random_drafter("eagle3", target.config, jax.random.key(7))
    switching = Policy({1: SpecConfig(4, 3, 6), 2: PLAIN, 4: SpecConfig.chain(3)})
    eng = Engine(target, drafter, slots=4, policy=switching, sampling=samp, max_new_tokens=32,
                 chunk=2)
    mixed = eng.generate(requests(prompts, order=[5, 2, 0, 4, 1, 3]), order="arrival")
    assert {c.id: c.tokens for c in mixed} == ref
    assert {mode for _, _, mode in eng.chunk_log} >= {PLAIN, "4,3,6"}
    # Different neighbours: half the requests, another order.
    few = eng.generate(requests(prompts, order=[4, 1, 2]))           # longest first
    assert {c.id: c.tokens for c in few} == {i: ref[i] for i in (1, 2, 4)}


def test_no_recompilation_as_requests_come_and_go(stories):
    target, prompts = stories
    drafter = random_drafter("eagle3", target.config, jax.random.key(7))
    eng = Engine(target, drafter, slots=2, max_new_tokens=32, chunk=4)
    eng.generate(requests(prompts))
    before = dict(decode.TRACE_COUNTS)
    # New prompts of other lengths (the same prompt bucket), other limits, other order.
    rng = np.random.default_rng(0)
    fresh = [Request(list(rng.integers(3, 500, size=n)), int(m), seed=int(n))
             for n, m in [(7, 9), (2, 30), (12, 1), (5, 19), (9, 0)]]
    out = eng.generate(fresh)
    assert [len(c.tokens) <= r.max_new_tokens for c, r in zip(out, fresh)] == [True] * 5
    assert dict(decode.TRACE_COUNTS) == before


def test_streaming_delivers_tokens_before_the_request_ends(stories):
    target, prompts = stories
    eng = Engine(target, slots=1, max_new_tokens=64, chunk=2)
    req = Request(prompts[0], 64, stop_ids=[])
    list(eng.stream([req]))                                   # compile
    deltas = []
    import time
    t0 = time.perf_counter()
    for d in eng.stream([req]):
        deltas.append((time.perf_counter() - t0, d))
    first_s, first = deltas[0]
    total_s, last = deltas[-1]
    assert last.done and not first.done
    assert sum(len(d.tokens) for _, d in deltas) == 64 == len(last.completion.tokens)
    # The first delta is one chunk's tokens (the prefill's plus two steps), of 64.
    assert len(first.tokens) == 3
    assert first_s < total_s / 4
    # Text deltas add up to the completion's text.
    assert "".join(d.text for _, d in deltas) == last.completion.text


def test_bad_requests_are_refused_by_name(stories):
    target, prompts = stories
    eng = Engine(target, slots=2, max_new_tokens=16, max_len=64)
    with pytest.raises(ValueError, match="request r1: its prompt has 80 tokens"):
        eng.check(Request([1] * 80, id="r1"))
    with pytest.raises(ValueError, match="prompt 7 has token id 99999"):
        eng.check(Request([1, 99999], id=7))
    with pytest.raises(ValueError, match="max_new_tokens=17 outside"):
        eng.check(Request([1, 2], 17))
    with pytest.raises(ValueError, match="prompt x is empty"):
        eng.check(Request([], id="x"))
    small = Engine(target, slots=2, max_new_tokens=16, max_len=64, num_pages=2)
    with pytest.raises(KVCacheExhaustedError, match="needs 3 pages"):
        small.generate([Request([1] * 30, 16)])
    oracle = jspec.drafters.make_drafter("oracle", target.config, None, future=np.zeros((1, 8)))
    with pytest.raises(ValueError, match="one row per batch row"):
        Engine(target, oracle)


def _one_slot(target, drafter, prompt, new, chunk=4, lazy=False):
    """A one-slot engine with ``prompt`` inserted (its programs called directly); ``lazy``:
    without the drafter's prefill."""
    from jspec.engine.engine import _Live

    eng = Engine(target, drafter, slots=1, spec=SpecConfig.chain(3), max_new_tokens=new,
                 chunk=chunk, longest_prompt=48)
    eng._ensure_state()
    eng._insert(0, _Live(Request(prompt, new, stop_ids=[]), 0, prompt,
                         eng.pages.take(len(prompt) + new + eng.overshoot)), lazy=lazy)
    return eng


def _run(eng, mode, times=1):
    import jax.numpy as jnp

    rows = jnp.zeros((1,), jnp.int32)
    call = eng.programs.sync if mode == "sync" else \
        lambda *a: eng.programs.decode(*a, spec=mode)
    for _ in range(times):
        eng.state = call(eng.target.serving_params, eng._dparams, eng.state, rows)


@pytest.fixture(scope="module")
def eagle3(stories):
    from pathlib import Path

    from jspec.drafters import load_drafter

    head = Path(__file__).resolve().parents[2] / "checkpoints" / "stories260K-eagle3"
    return load_drafter(head, stories[0].config)


def test_plain_chunks_leave_the_drafter_and_sync_catches_it_up(stories, eagle3):
    """Plain chunks do not run the drafter; :meth:`Programs.sync` then gives it what per-step
    extends would have: the first speculative iterations after the switch accept as much as
    without the plain steps, where the drafter left behind (drafting from a stale root)
    accepts far less until its extends catch it up."""
    target, prompts = stories
    accept = {}
    for case in ("spec only", "plain, synced", "plain, not synced"):
        hists = []
        for p in prompts[:4] + [q[:5] for q in prompts[:4]]:
            eng = _one_slot(target, eagle3, p, 40, chunk=1)
            if case != "spec only":
                _run(eng, PLAIN, 8)
                assert int(eng.state.drafted[0]) == len(p)          # the drafter was left
            if case == "plain, synced":
                _run(eng, "sync")
                assert int(eng.state.drafted[0]) == int(eng.state.core.cache.lengths[0])
            before = np.asarray(eng.state.core.accept_hist[0])
            _run(eng, eng.policy[1], 2)
            hists.append(np.asarray(eng.state.core.accept_hist[0]) - before)
        h = np.sum(hists, 0)
        accept[case] = (h * np.arange(len(h))).sum() / h.sum()
    assert accept["spec only"] > 2.0, accept
    assert accept["plain, synced"] > 0.9 * accept["spec only"], accept
    assert accept["plain, not synced"] < 0.8 * accept["plain, synced"], accept


@pytest.mark.parametrize("lazy", [False, True], ids=["prefilled", "lazy insert"])
def test_sync_gives_the_drafter_state_a_prefill_gives(stories, eagle3, lazy):
    """After plain chunks and a sync, the drafter's KV over every committed position equals
    the one a prefill of the prompt plus the tokens decoded so far writes (fp32), and so do
    its feature and logits: the catch-up recomputes the target's features exactly. A lazy
    insert (no drafter prefill) is caught up from position 0, its prompt included."""
    from jspec import kv_cache as kvc

    target, prompts = stories
    p = prompts[1]
    eng = _one_slot(target, eagle3, p, 40, lazy=lazy)
    assert int(eng.state.drafted[0]) == (0 if lazy else len(p))
    _run(eng, PLAIN, 3)                                  # 12 plain steps, no drafter
    _run(eng, "sync")
    core = eng.state.core
    L, n = int(core.cache.lengths[0]), int(core.num_generated[0])
    assert L == len(p) + n - 1 and n == 13
    ref = _one_slot(target, eagle3, p + np.asarray(core.tokens[0, :n - 1]).tolist(), 40)
    rcore = ref.state.core
    assert int(rcore.root[0]) == int(core.root[0])       # greedy: the same next token
    for a, b in ((core.draft.cache, rcore.draft.cache),):
        assert int(a.lengths[0]) == int(b.lengths[0]) == L
        ka, va = kvc.read_layer(a, 0, a.page_table)
        kb, vb = kvc.read_layer(b, 0, b.page_table)
        np.testing.assert_allclose(ka[..., :L, :], kb[..., :L, :], atol=2e-5)
        np.testing.assert_allclose(va[..., :L, :], vb[..., :L, :], atol=2e-5)
    np.testing.assert_allclose(core.draft.feature[0], rcore.draft.feature[0], atol=2e-5)
    np.testing.assert_allclose(core.draft.logits[0], rcore.draft.logits[0], atol=1e-4)


def test_generate_with_more_prompts_than_slots_goes_through_the_engine(stories, plain):
    target, prompts = stories
    before = decode.TRACE_COUNTS["engine_decode"]
    res = jspec.generate(target, prompts, max_new_tokens=LIMITS, stop_ids=[], slots=4)
    assert decode.TRACE_COUNTS["engine_decode"] > before       # it did run the engine
    assert res.tokens == plain                                 # in input order
    assert [s["new_tokens"] for s in res.stats] == LIMITS
    # Sampled plain decoding: row r keeps its key of the static batch, so the same tokens.
    kw = dict(max_new_tokens=12, stop_ids=[], temperature=1.0, seed=4)
    assert jspec.generate(target, prompts, slots=4, **kw).tokens == \
        jspec.generate(target, prompts, **kw).tokens
