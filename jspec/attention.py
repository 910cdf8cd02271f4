"""Reference (pure jnp) attention of a block of new queries over a row's paged KV.

The block's own keys have already been written to the cache after ``lengths``.
Query ``t`` of row ``b`` sees every committed prefix position ``p < lengths[b]``
and the window positions ``lengths[b] + w`` for which ``block_mask[b, t, w]`` holds.
The window is usually the block itself (``[B, T, T]``: causal when ``block_mask`` is
None, a tree mask for verification); a drafter's tree loop uses a wider window
``[B, T, W]`` covering the transient slots its earlier steps wrote. Only the window
mask is ever built, never prefix x T.

This is the jnp reference the Pallas kernels are checked against; it gathers the
row's pages into a contiguous view, which is simple and right but reads the whole
addressable length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import kv_cache as kvc


def causal_block_mask(T: int) -> jax.Array:
    return jnp.tril(jnp.ones((T, T), bool))


def visibility(lengths: jax.Array, num_keys: int, block_mask: jax.Array) -> jax.Array:
    """``[B, T, S]`` bool: which of the row's ``S`` key slots query ``t`` may read."""
    B, T, W = block_mask.shape
    p = jnp.arange(num_keys, dtype=jnp.int32)[None, None, :]
    rel = p - lengths[:, None, None]                      # offset into the window
    in_window = (rel >= 0) & (rel < W)
    blk = jnp.take_along_axis(block_mask, jnp.clip(rel, 0, W - 1).repeat(T, axis=1), axis=2)
    return (rel < 0) | (in_window & blk)


def paged_attention_ref(q: jax.Array, cache: kvc.PagedKVCache, layer: int,
                        block_mask: jax.Array | None = None) -> jax.Array:
    """``q: [B, T, H, D]`` -> ``[B, T, H, D]``. Scores, softmax and accumulation in fp32."""
    B, T, H, D = q.shape
    k, v = kvc.read_layer(cache, layer)                   # [B, KVH, S, D]
    KVH, S = k.shape[1], k.shape[2]
    G = H // KVH
    if block_mask is None:
        block_mask = jnp.broadcast_to(causal_block_mask(T), (B, T, T))
    vis = visibility(cache.lengths, S, block_mask)        # [B, T, S]
    qg = q.reshape(B, T, KVH, G, D).astype(jnp.float32)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * (D ** -0.5)
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bksd->btkgd", p, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return o.reshape(B, T, H, D).astype(q.dtype)
