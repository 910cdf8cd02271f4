"""Chunked prefill (jspec.prefill) is a whole-prompt prefill done C tokens at a time: the same
last logits, KV pages and drafter state (fp32), and the same tokens, with C dividing the
padded prompt, not dividing it, and larger than it."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import kv_cache as kvc
from jspec.checkpoint import load_target
from jspec.drafters import load_drafter, ngram_drafter, random_drafter
from jspec.plan import KVConfig, plan
from jspec.prefill import DEFAULT_CHUNK, chunk_plan

# Ragged prompts of 23..110 tokens: padded to 112, so chunks of 16 divide it, 20 do not (the
# last chunk is part padding) and 128 is one chunk, the unchunked program.
CHUNKS = [pytest.param(16, id="divides"), pytest.param(20, id="does-not-divide"),
          pytest.param(128, id="larger")]
KINDS = ["eagle1", "eagle3", "mtp", "medusa", "dflash", "ngram", "model"]


@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    return target, cases


@pytest.fixture(scope="module")
def long_prompts(stories):
    _, cases = stories
    texts = [c["prompt_token_ids"] + c["continuation_token_ids"] for c in cases]
    return [texts[0][:110], texts[1][:23], texts[2][:64], texts[3][:97]]


def drafter_of(kind, target, stories_dir):
    if kind == "ngram":
        return ngram_drafter(target.config)
    if kind == "model":              # the target drafting for itself: its own KV and sink
        return load_drafter(stories_dir, target.config, kind="model")
    kw = {"num_heads": 4} if kind == "medusa" else {}
    return random_drafter(kind, target.config, jax.random.key(3), **kw)


def test_chunk_plan():
    assert chunk_plan(112, 16) == (7, 16) and chunk_plan(112, 20) == (6, 20)
    assert chunk_plan(112, 128) == (1, 112)
    assert chunk_plan(112, None) == chunk_plan(112, DEFAULT_CHUNK)    # JSPEC_PREFILL_CHUNK
    with pytest.raises(ValueError, match="prefill_chunk"):
        chunk_plan(112, 0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        KVConfig(prefill_chunk=0)


def initial_state(p, chunk):
    dec = dataclasses.replace(p.decoder, prefill_chunk=chunk)
    return jax.jit(dec.initial_state)(*p.call_args(jax.random.key(0)))


def assert_pages_equal(a: kvc.PagedKVCache, b: kvc.PagedKVCache):
    assert np.array_equal(a.lengths, b.lengths)
    np.testing.assert_allclose(a.k_pages, b.k_pages, atol=2e-5)
    np.testing.assert_allclose(a.v_pages, b.v_pages, atol=2e-5)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_plain_prefill_equals_whole(stories, long_prompts, chunk):
    target, _ = stories
    p = plan(target, long_prompts, max_new_tokens=4)
    params = target.serving_params
    prompt, lens, table = p.args[:3]
    c = target.config

    def prefill(C, kernels="reference"):
        cache = kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim, table,
                               p.decoder.num_pages, p.decoder.page_size, c.dtype)
        dec = dataclasses.replace(p.decoder, prefill_chunk=C, kernels=kernels)
        return jax.jit(dec.prefill)(params, prompt, lens, cache)

    whole_logits, whole = prefill(10_000)
    # The chunk's attention by the reference, and by the GPU path's dot_product_attention
    # call (jspec.prefill_attention; XLA's implementation on this CPU).
    for kernels in ("reference", "pallas_interpret_gpu"):
        logits, cache = prefill(chunk, kernels)
        np.testing.assert_allclose(logits, whole_logits, atol=1e-4, rtol=1e-5)
        assert_pages_equal(cache, whole)


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_prefill_equals_whole(stories, stories_dir, long_prompts, kind):
    """The target's KV, the first token and every leaf of the drafter's state (its KV, last
    feature and logits, n-gram history, ...) as after one whole-prompt prefill."""
    target, _ = stories
    p = plan(target, long_prompts, max_new_tokens=4,
             drafter=drafter_of(kind, target, stories_dir))
    whole, chunked = initial_state(p, 10_000), initial_state(p, 20)
    assert np.array_equal(chunked.root, whole.root)
    assert_pages_equal(chunked.cache, whole.cache)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(chunked.draft),
                            jax.tree.leaves(whole.draft)):
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=str(path[0]))
        else:
            assert np.array_equal(a, b), path[0]


def test_golden_greedy_chunked(stories):
    """The independent implementation's tokens with every prompt cut into chunks of 3."""
    target, cases = stories
    res = jspec.generate(target, [c["prompt_token_ids"] for c in cases], max_new_tokens=100,
                         stop_ids=[], prefill_chunk=3)
    for row, case in zip(res.tokens, cases):
        assert row == case["continuation_token_ids"], case["prompt"]


# Every kind's chunked state equals its whole one (above); end to end, two kinds run by
# default (a feature drafter and the draft model with its own KV), the rest with -m slow.
@pytest.mark.parametrize("kind", [k if k in ("eagle3", "model") else
                                  pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_speculative_chunked_equals_plain(stories, stories_dir, long_prompts, kind):
    target, _ = stories
    limits = [24, 9, 17, 30]
    plain = jspec.generate(target, long_prompts, max_new_tokens=limits, stop_ids=[])
    res = jspec.generate(target, long_prompts, max_new_tokens=limits, stop_ids=[],
                         drafter=drafter_of(kind, target, stories_dir), prefill_chunk=20)
    assert res.tokens == plain.tokens
