"""A drafter's tree-loop attention through the kernels (jspec.kernels.KernelAttention.windowed):
the committed prefix read from the paged pool by the tree-attention kernel (no gather),
merged by log-sum-exp with the dense window, equals the gathering reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import kernels, kv_cache as kvc
from jspec.attention import windowed_attention_ref


def case(D, seed=0, B=3, KVH=2, G=2, T=4, W=12, ps=8, pages=24, L=2):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    table = jnp.asarray(rng.permutation(pages)[:B * 8].reshape(B, 8), jnp.int32)
    prefix = kvc.PagedKVCache(k_pages=f(L, KVH, pages, ps, D), v_pages=f(L, KVH, pages, ps, D),
                              page_table=table, lengths=jnp.asarray([0, 13, 40][:B], jnp.int32),
                              capacity=jnp.full((B,), 8 * ps, jnp.int32))
    cache = kvc.WindowedCache(prefix=prefix, k=f(L, B, W, KVH, D), v=f(L, B, W, KVH, D))
    # Each query sees itself (slot 4 + t) and some earlier window slots, as the loop's masks.
    mask = jnp.asarray(rng.random((B, T, W)) < 0.3) | (jnp.arange(W)[None, None] ==
                                                        4 + jnp.arange(T)[None, :, None])
    return f(B, T, KVH * G, D), cache, mask


@pytest.mark.parametrize("mode,D", [("pallas_interpret", 128), ("pallas_interpret_gpu", 32),
                                    ("pallas_interpret", 16)])    # 16: the padded-head path
def test_windowed_kernel_equals_reference(mode, D):
    q, cache, mask = case(D)
    att = kernels.attention_fn(mode)
    for layer in (0, 1):
        want = windowed_attention_ref(q, cache, layer, mask)
        got = jax.jit(att.windowed, static_argnums=2)(q, cache, layer, mask)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    jaxpr = str(jax.make_jaxpr(lambda: att.windowed(q, cache, 1, mask))())
    assert "_lse" in jaxpr          # the prefix through the kernel, with its log-sum-exp
