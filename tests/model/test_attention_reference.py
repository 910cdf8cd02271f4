"""The reference attention reads only the bucket of a row's pages that holds the live length
(``jspec.attention.reach_buckets``); what it leaves unread must never have been visible."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import attention as attn
from jspec import kv_cache as kvc

B, KVH, G, D, PS, M = 2, 2, 2, 8, 4, 32          # 32 pages per row: buckets 8, 16, 32


def _cache(lengths, seed=0):
    table = np.arange(B * M, dtype=np.int32).reshape(B, M)
    cache = kvc.init_cache(1, KVH, D, table, B * M, PS)
    rng = np.random.default_rng(seed)
    # Every slot holds data, the unwritten ones too: a read past the live length that leaked
    # into the softmax would change the result.
    k = rng.normal(size=cache.k_pages.shape).astype(np.float32) * 3
    v = rng.normal(size=cache.v_pages.shape).astype(np.float32) * 3
    return cache.replace(k_pages=jnp.asarray(k), v_pages=jnp.asarray(v),
                         lengths=jnp.asarray(lengths, jnp.int32))


def _dense(q, cache, mask):
    """Numpy attention over each row's positions: prefix < length, then the masked window."""
    q = np.asarray(q, np.float64)
    k_all = np.asarray(cache.k_pages[0], np.float64)      # [KVH, P, PS, D]
    v_all = np.asarray(cache.v_pages[0], np.float64)
    T, W = mask.shape[1], mask.shape[2]
    out = np.zeros(q.shape)
    for b in range(B):
        n = int(cache.lengths[b])
        pages = np.asarray(cache.page_table[b])
        k = k_all[:, pages].reshape(KVH, -1, D)[:, :n + W]
        v = v_all[:, pages].reshape(KVH, -1, D)[:, :n + W]
        for t in range(T):
            vis = np.r_[np.ones(n, bool), np.asarray(mask[b, t])]
            for h in range(KVH * G):
                s = k[h // G] @ q[b, t, h] / np.sqrt(D)
                s = np.where(vis, s, -np.inf)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[h // G]
    return out


@pytest.mark.parametrize("lengths, bucket", [([3, 10], 0), ([3, 40], 1), ([100, 3], 2)])
def test_reads_the_live_bucket_and_matches_a_dense_read(lengths, bucket):
    T = 3
    cache = _cache(lengths)
    assert attn.reach_buckets(M) == (8, 16, 32)
    assert int(attn.reach(cache.lengths, T, PS, M)) == bucket
    q = jax.random.normal(jax.random.key(1), (B, T, KVH * G, D))
    mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
    got = jax.jit(lambda q, c: attn.paged_attention_ref(q, c, 0))(q, cache)
    np.testing.assert_allclose(np.asarray(got), _dense(q, cache, mask), rtol=2e-5, atol=2e-5)


def test_windowed_prefix_reads_the_live_bucket():
    """A drafter's tree loop: the paged prefix (read up to its bucket) and a dense window."""
    lengths, T, W = [6, 21], 2, 4
    prefix = _cache(lengths, seed=3)
    win = kvc.WindowedCache.empty(prefix, W)
    rng = np.random.default_rng(4)
    kw = jnp.asarray(rng.normal(size=(B, W, KVH, D)), jnp.float32)
    vw = jnp.asarray(rng.normal(size=(B, W, KVH, D)), jnp.float32)
    win = win.write(0, kw, vw, 0)
    mask = jnp.asarray(rng.random((B, T, W)) < 0.6)
    q = jax.random.normal(jax.random.key(2), (B, T, KVH * G, D))
    got = jax.jit(lambda q, c, m: attn.windowed_attention_ref(q, c, 0, m))(q, win, mask)
    # The same through a paged cache that holds the window right after each prefix.
    paged = prefix
    for b in range(B):
        for w in range(W):
            pos = lengths[b] + w
            page, slot = int(prefix.page_table[b, pos // PS]), pos % PS
            paged = paged.replace(k_pages=paged.k_pages.at[0, :, page, slot].set(kw[b, w]),
                                  v_pages=paged.v_pages.at[0, :, page, slot].set(vw[b, w]))
    np.testing.assert_allclose(np.asarray(got), _dense(q, paged, np.asarray(mask)),
                               rtol=2e-5, atol=2e-5)


def test_short_tables_and_accelerators_have_one_bucket():
    from jspec.platform import building_for
    assert attn.reach_buckets(attn.LIVE_MIN_PAGES - 1) == (attn.LIVE_MIN_PAGES - 1,)
    assert attn.reach_buckets(17) == (5, 9, 17)
    with building_for("tpu"):        # the kernels read live pages; the fallback keeps one read
        assert attn.reach_buckets(17) == (17,)
