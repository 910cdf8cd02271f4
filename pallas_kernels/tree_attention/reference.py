"""Pure-jnp reference for tree attention over a paged KV cache (same signature as the kernels).

Row ``b`` attends with its ``N`` tree queries over

* its committed prefix, positions ``p < lengths[b]`` (always visible), and
* the ``N`` tree nodes already written at positions ``lengths[b] .. lengths[b]+N-1``,
  node ``i`` seeing node ``j`` iff bit ``j`` of ``mask_bits[b, i]`` is set.

The reference gathers the row's pages into a contiguous view and builds a dense
``[B, N, S]`` visibility (fine for a reference, which the kernels never do).
Scores, softmax and accumulation are fp32; the output has ``q``'s dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention.layout import unpack_words32


def tree_attention_ref(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                       page_table: jax.Array, lengths: jax.Array,
                       mask_bits: jax.Array) -> jax.Array:
    """``q [B, N, H, D]``, ``k_pages/v_pages [KVH, P, page_size, D]`` (one layer),
    ``page_table [B, max_pages]`` (unallocated entries = P), ``lengths [B]``,
    ``mask_bits [B, N, W]`` packed rows -> ``[B, N, H, D]`` in ``q.dtype``."""
    B, N, H, D = q.shape
    KVH, P, ps, _ = k_pages.shape
    G = H // KVH
    pt = jnp.clip(page_table, 0, P - 1)

    def gather(pages):                                    # -> [B, KVH, S, D]
        g = jnp.take(pages, pt, axis=1)                   # [KVH, B, M, ps, D]
        return g.reshape(KVH, B, -1, D).swapaxes(0, 1).astype(jnp.float32)

    k, v = gather(k_pages), gather(v_pages)
    S = k.shape[2]
    tree = unpack_words32(mask_bits, N)                   # [B, N, N] bool
    rel = jnp.arange(S, dtype=jnp.int32)[None, :] - lengths[:, None].astype(jnp.int32)  # [B, S]
    in_tree = (rel >= 0) & (rel < N)
    col = jnp.take_along_axis(tree, jnp.broadcast_to(jnp.clip(rel, 0, N - 1)[:, None, :], (B, N, S)),
                              axis=2)                     # [B, N, S]
    vis = (rel < 0)[:, None, :] | (in_tree[:, None, :] & col)
    qg = q.reshape(B, N, KVH, G, D).astype(jnp.float32)
    s = jnp.einsum("bnkgd,bksd->bkgns", qg, k, precision=jax.lax.Precision.HIGHEST) * (D ** -0.5)
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgns,bksd->bnkgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return o.reshape(B, N, H, D).astype(q.dtype)


def tree_attention_via_cache(q, k_pages, v_pages, page_table, lengths, mask_bits):
    """The same computation through :func:`jspec.attention.paged_attention_ref` (a
    one-layer cache wrapper); used to check the two references agree."""
    from jspec import kv_cache as kvc
    from jspec.attention import paged_attention_ref

    N = q.shape[1]
    P, ps = k_pages.shape[1], k_pages.shape[2]
    pt = jnp.asarray(page_table, jnp.int32)
    cache = kvc.PagedKVCache(
        k_pages=k_pages[None], v_pages=v_pages[None], page_table=pt,
        lengths=jnp.asarray(lengths, jnp.int32),
        capacity=jnp.sum(pt < P, axis=1, dtype=jnp.int32) * ps)
    return paged_attention_ref(q, cache, 0, block_mask=unpack_words32(mask_bits, N))
