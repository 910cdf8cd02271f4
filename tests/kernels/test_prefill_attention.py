"""A prefill chunk's attention through jax's own kernels (jspec.prefill_attention) equals the
reference: TPU's ragged_paged_attention in Pallas interpret mode and the GPU path's
dot_product_attention call (XLA's implementation here), with rows whose chunk runs past
their allocation, ragged committed prefixes and GQA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import kv_cache as kvc
from jspec.attention import paged_attention_ref
from jspec.prefill_attention import PrefillAttention, problem, ragged_paged_operands


def case(D, B=3, KVH=2, G=2, C=24, ps=8, M=10, L=2, seed=0):
    rng = np.random.default_rng(seed)
    pages = B * M + 2
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    table = jnp.asarray(rng.permutation(pages)[:B * M].reshape(B, M), jnp.int32)
    # Committed prefixes: none, ragged, and one whose chunk runs past its M * ps = 80 slots.
    cache = kvc.PagedKVCache(k_pages=f(L, KVH, pages, ps, D), v_pages=f(L, KVH, pages, ps, D),
                             page_table=table, lengths=jnp.asarray([0, 21, 64][:B], jnp.int32),
                             capacity=jnp.full((B,), M * ps, jnp.int32))
    return f(B, C, KVH * G, D), cache


def assert_live_equal(got, want, cache, C):
    # Row 2's queries past its allocation (64 + t >= 80) are padding: not compared.
    live = np.asarray((cache.lengths[:, None] + jnp.arange(C)[None]) < 80)
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=2e-5)


@pytest.mark.parametrize("impl", ["dpa_xla", "blocked"])
def test_xla_paths_equal_reference(impl, monkeypatch):
    from jspec import prefill_attention
    monkeypatch.setattr(prefill_attention, "KEY_BLOCK", 16)     # several key blocks
    q, cache = case(32)
    att = PrefillAttention(impl)
    for layer in (0, 1):
        got = jax.jit(lambda q, c: att(q, c, layer, att.prepare(c, None, q)))(q, cache)
        assert_live_equal(got, paged_attention_ref(q, cache, layer, None), cache, q.shape[1])


def test_ragged_paged_operands_under_jax_reference():
    """The TPU kernel's operands, run through jax's own reference of the kernel."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
    q, cache = case(128)
    B, C, H, D = q.shape
    for layer in (0, 1):
        ops = ragged_paged_operands(q, cache.k_pages, cache.v_pages, kvc.read_table(cache),
                                    cache.lengths, jnp.int32(layer))
        got = ref_ragged_paged_attention(*ops, sm_scale=D ** -0.5).reshape(B, C, H, D)
        assert_live_equal(got, paged_attention_ref(q, cache, layer, None), cache, C)


def test_problems(monkeypatch):
    from jspec import prefill_attention
    assert problem("rpa", head_dim=64, dtype=jnp.bfloat16, page_size=16)
    assert problem("rpa", head_dim=128, dtype=jnp.bfloat16, page_size=16) is None
    assert "fp16 and bf16" in problem("cudnn", head_dim=128, dtype=jnp.float32, page_size=16)
    # This CPU host has no cuDNN: jax refuses while tracing, and the reason is given.
    assert "cuDNN attention unavailable" in problem("cudnn", head_dim=128, dtype=jnp.bfloat16,
                                                    page_size=16)
    monkeypatch.setattr(prefill_attention, "cudnn_missing", lambda: None)
    assert problem("cudnn", head_dim=128, dtype=jnp.bfloat16, page_size=16) is None


@pytest.mark.parametrize("mode", ["reference", "pallas_interpret"])
def test_long_causal_blocks_route_to_the_prefill_attention(mode, monkeypatch):
    """``kernels.attention_fn``: a causal block longer than any tree (a drafter's prompt
    chunk) is served by the prefill attention, equal to the reference; a short one, or one
    with a tree mask, by the mode's own backend (one program: no scores of the whole chunk)."""
    from jspec import kernels, prefill_attention
    from jspec.spec_config import MAX_TREE_NODES

    monkeypatch.setattr(prefill_attention, "KEY_BLOCK", 16)
    att = kernels.attention_fn(mode)
    q, cache = case(32, C=MAX_TREE_NODES + 8, M=20)
    block = att.prepare(cache, None, q)
    assert isinstance(block.chunk, PrefillAttention) and block.visible is None
    got = jax.jit(lambda q, c: att(q, c, 1, att.prepare(c, None, q)))(q, cache)
    np.testing.assert_allclose(got, paged_attention_ref(q, cache, 1, None), atol=2e-5)
    # Called without a prepared block, as a drafter layer calls it: routed the same way.
    np.testing.assert_allclose(att(q, cache, 1, None), got, atol=1e-6)
    short = q[:, :MAX_TREE_NODES]
    assert att.prepare(cache, None, short).chunk is None
    tree = jnp.tril(jnp.ones((3, q.shape[1], q.shape[1]), bool))
    assert att.prepare(cache, tree, q).chunk is None
