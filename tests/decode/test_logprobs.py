"""Logprobs are the target's, exactly, under plain decoding and under speculation: every
returned logprob and top-k set equals a teacher-forced forward of the target over prompt +
output (:func:`jspec.scoring.teacher_forced`) within 1e-4 in fp32, for plain decoding and
every drafter kind, chain and tree; the first token (from the prefill), accepted drafts and
the bonus token included, in ragged batches. The token's logprob equals the best top-k value
bitwise when it is the argmax. ``logprobs=None`` traces nothing for them."""

import json

import jax
import numpy as np
import pytest

import jspec
from jspec.checkpoint import load_target
from jspec.drafters import Drafter, Oracle, ngram_drafter, random_drafter
from jspec.plan import plan
from jspec.scoring import teacher_forced
from jspec.spec_config import SpecConfig

from helpers.logprob_checks import K, assert_target_logprobs

LIMITS = [21, 7, 14]


@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    prompts = [c["prompt_token_ids"] for c in cases[:3]]        # ragged lengths
    return target, prompts


def test_plain_decoding(stories):
    target, prompts = stories
    res = jspec.generate(target, prompts, max_new_tokens=LIMITS, stop_ids=[], logprobs=K)
    assert [len(t) for t in res.tokens] == LIMITS
    assert_target_logprobs(target, prompts, res.tokens, res.logprobs)


def test_generate_through_the_engine(stories):
    """More prompts than ``slots``: generate serves them through the engine, same logprobs."""
    target, prompts = stories
    res = jspec.generate(target, prompts, max_new_tokens=LIMITS, stop_ids=[], logprobs=K,
                         slots=2)
    assert_target_logprobs(target, prompts, res.tokens, res.logprobs)


KINDS = [("eagle3", None), ("eagle3", SpecConfig.chain(3)), ("eagle1", None),
         ("eagle1", SpecConfig.chain(3)), ("mtp", None), ("medusa", None),
         ("dflash", SpecConfig(4, 2, 6)), ("model", None), ("ngram", None)]


def _drafter(kind, cfg):
    if kind == "ngram":
        return ngram_drafter(cfg)
    kw = {"num_heads": 4} if kind == "medusa" else {}
    return random_drafter(kind, cfg, jax.random.key(7), **kw)


def _id(kind, spec):
    return f"{kind}-{'default' if spec is None else 'chain' if spec.is_chain else 'tree'}"


@pytest.mark.parametrize("kind,spec", KINDS, ids=[_id(*k) for k in KINDS])
def test_every_drafter_kind(stories, kind, spec):
    target, prompts = stories
    res = jspec.generate(target, prompts, max_new_tokens=LIMITS, stop_ids=[], logprobs=K,
                         drafter=_drafter(kind, target.config), spec=spec)
    assert [len(t) for t in res.tokens] == LIMITS
    assert_target_logprobs(target, prompts, res.tokens, res.logprobs)


def _oracle(target, prompts, miss_rate, max_len=256):
    """A drafter that knows the target's greedy continuation, missing ``miss_rate`` of its
    drafts: accept lengths vary, so accepted drafts and bonus tokens land at every offset of
    an iteration's block."""
    longer = jspec.generate(target, prompts, max_new_tokens=max(LIMITS) + 8, stop_ids=[])
    fut = np.zeros((len(prompts), max_len), np.int32)
    for r, (p, t) in enumerate(zip(prompts, longer.tokens)):
        fut[r, :len(p) + len(t)] = p + t
    return Drafter(Oracle(target.config.vocab_size, miss_rate=miss_rate),
                   {"future": jax.numpy.asarray(fut)})


@pytest.mark.parametrize("spec", [SpecConfig.chain(4), SpecConfig(5, 4, 8)], ids=["chain", "tree"])
def test_accepted_nodes_and_bonus(stories, spec):
    target, prompts = stories
    res = jspec.generate(target, prompts, max_new_tokens=LIMITS, stop_ids=[], logprobs=K,
                         drafter=_oracle(target, prompts, 0.3), spec=spec)
    hist = np.sum([st["accept_hist"] for st in res.stats], 0)
    assert np.count_nonzero(hist[2:]) >= 2, hist        # several accept lengths above 1
    assert_target_logprobs(target, prompts, res.tokens, res.logprobs)


def test_sampled_rows_report_the_raw_target(stories):
    """Sampling (temperature, top-k) changes which tokens come out, not what their logprobs
    are: the target's raw distribution, also for a bonus drawn from a residual."""
    target, prompts = stories
    res = jspec.generate(target, prompts, max_new_tokens=LIMITS, stop_ids=[], logprobs=3,
                         temperature=1.3, top_k=20, seed=5,
                         drafter=_oracle(target, prompts, 0.3), spec=SpecConfig(5, 4, 8))
    assert_target_logprobs(target, prompts, res.tokens, res.logprobs, k=3, greedy=False)


def test_k_zero_gives_the_token_alone(stories):
    target, prompts = stories
    res = jspec.generate(target, prompts[:1], max_new_tokens=6, stop_ids=[], logprobs=0)
    assert all(e.top == [] for e in res.logprobs[0])
    assert_target_logprobs(target, prompts[:1], res.tokens, res.logprobs, k=0)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_bad_k_is_refused_before_compiling(stories, bad):
    target, prompts = stories
    with pytest.raises(ValueError, match="logprobs"):
        jspec.generate(target, prompts, max_new_tokens=4, logprobs=bad)


def _program_text(p):
    key = jax.random.key(0)
    return str(jax.make_jaxpr(lambda *a: p.decoder.run(*a))(*p.call_args(key)))


def test_off_traces_nothing(stories):
    """Without logprobs the decode state holds no logprob buffers and the plain program has
    no top-k (greedy decoding is an argmax); with them, both appear."""
    target, prompts = stories
    off = plan(target, prompts, max_new_tokens=4, stop_ids=[])
    on = plan(target, prompts, max_new_tokens=4, stop_ids=[], logprobs_k=2)
    key = jax.random.key(0)
    assert jax.eval_shape(off.decoder.run, *off.call_args(key)).logprobs is None
    shape = jax.eval_shape(on.decoder.run, *on.call_args(key)).logprobs
    assert shape.top.shape == (on.shape[0], on.decoder.max_new_tokens, 2)   # rows bucketed
    assert "top_k" not in _program_text(off)
    assert "top_k" in _program_text(on)
    res = jspec.generate(target, prompts, max_new_tokens=4, stop_ids=[])
    assert res.logprobs is None


def test_teacher_forced_edges(stories):
    target, prompts = stories
    assert teacher_forced(target, prompts[0][:1], 3) == [None]
    out = teacher_forced(target, prompts[0], 3)
    assert out[0] is None and len(out) == len(prompts[0])
    assert [e.token for e in out[1:]] == prompts[0][1:]
    with pytest.raises(ValueError):
        teacher_forced(target, [], 3)
