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
                       mask_bits: jax.Array, layer: jax.Array | int | None = None,
                       return_lse: bool = False):
    """``q [B, N, H, D]``; ``k_pages/v_pages [L, KVH, P, page_size, D]`` (the stacked pools)
    with ``layer`` an int32 scalar (traced allowed), or one layer's ``[KVH, P, page_size, D]``
    with ``layer=None``; ``page_table [B, max_pages]`` (unallocated entries = P),
    ``lengths [B]``, ``mask_bits [B, N, W]`` packed rows -> ``[B, N, H, D]`` in ``q.dtype``.
    ``return_lse``: also the log-sum-exp of each query's visible scores, ``[B, N, H]`` fp32
    (-inf where it sees nothing), to merge with attention over other keys."""
    B, N, H, D = q.shape
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    KVH, P, ps, _ = k_pages.shape[1:]
    G = H // KVH
    pt = jnp.clip(page_table, 0, P - 1)
    layer = jnp.asarray(layer, jnp.int32)

    def gather(pages):                                    # -> [B, KVH, S, D]
        g = pages[layer, :, pt]                           # one gather: [B, M, KVH, ps, D]
        return g.transpose(0, 2, 1, 3, 4).reshape(B, KVH, -1, D).astype(jnp.float32)

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
    lse = jax.nn.logsumexp(s, axis=-1)                    # [B, KVH, G, N]
    p = jnp.where(vis[:, None, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]),
                  0.0)
    o = jnp.einsum("bkgns,bksd->bnkgd", p, v, precision=jax.lax.Precision.HIGHEST)
    o = o.reshape(B, N, H, D).astype(q.dtype)
    if not return_lse:
        return o
    return o, lse.transpose(0, 3, 1, 2).reshape(B, N, H)
