"""Layout helpers shared by the kernels: packed-mask words, query regrouping, page table.

All of these are O(B * N * H * D) or O(B * max_pages) rearrangements done outside
the kernels; none of them builds anything prefix x N.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

WORD_BITS = 32


def mask_words32(mask_bits: jax.Array) -> jax.Array:
    """``[B, N, W]`` uint8/16/32 packed rows -> ``[B, N, 2]`` int32 (low word, high word).

    Bit ``j`` of row ``i`` (``j < 64``) is bit ``j % 32`` of word ``j // 32``. Narrow
    words are zero-extended; uint32 is bit-cast; a missing high word is zero.
    """
    bits = jnp.iinfo(mask_bits.dtype).bits
    if bits == 32:
        w = jax.lax.bitcast_convert_type(mask_bits, jnp.int32)
    else:
        w = mask_bits.astype(jnp.int32)                  # unsigned -> zero-extended
    if w.shape[-1] == 1:
        w = jnp.concatenate([w, jnp.zeros_like(w)], axis=-1)
    return w


def unpack_words32(mask_bits: jax.Array, n: int) -> jax.Array:
    """``[B, N, W]`` packed -> ``[B, N, n]`` bool (for references and tests only)."""
    w = mask_words32(mask_bits)                          # [B, N, 2]
    j = jnp.arange(n, dtype=jnp.int32)
    word = jnp.where(j >= WORD_BITS, w[..., 1:2], w[..., 0:1])
    return (jnp.right_shift(word, j & (WORD_BITS - 1)) & 1).astype(bool)


def group_queries(q: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
    """``[B, N, H, D]`` -> ``[B, KVH, rows, D]``: row ``n * G + g`` is node ``n``, head
    ``kvh * G + g``; padded with zero rows up to ``rows``."""
    B, N, H, D = q.shape
    G = H // num_kv_heads
    qg = q.reshape(B, N, num_kv_heads, G, D).transpose(0, 2, 1, 3, 4).reshape(B, num_kv_heads, N * G, D)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows - N * G), (0, 0)))


def ungroup_output(o: jax.Array, n: int, num_heads: int) -> jax.Array:
    """Inverse of :func:`group_queries`: ``[B, KVH, rows, D]`` -> ``[B, N, H, D]``."""
    B, KVH, _, D = o.shape
    G = num_heads // KVH
    return o[:, :, : n * G].reshape(B, KVH, n, G, D).transpose(0, 2, 1, 3, 4).reshape(B, n, num_heads, D)


def row_words(mask_bits: jax.Array, num_groups: int, rows: int) -> jax.Array:
    """Mask words per query row: ``[B, rows, 2]`` int32 (row ``n * G + g`` -> node ``n``;
    padding rows get no tree bits)."""
    w = jnp.repeat(mask_words32(mask_bits), num_groups, axis=1)
    return jnp.pad(w, ((0, 0), (0, rows - w.shape[1]), (0, 0)))


def prepare_page_table(page_table: jax.Array, num_pages: int, pages_per_block: int) -> jax.Array:
    """Pad the table's columns to a multiple of ``pages_per_block`` and clamp entries into
    ``[0, P)`` (unallocated entries, = P, become a real page whose slots the kernels
    never let through: they lie at or past ``lengths + N``)."""
    M = page_table.shape[1]
    pad = -M % pages_per_block
    pt = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=num_pages)
    return jnp.clip(pt, 0, num_pages - 1)


class RowInputs(NamedTuple):
    """The kernels' layer-independent inputs: the prepared page table ``[B, M]`` and the
    per-row mask words ``[B, R, 2]``. A model's forward builds them once
    (:func:`pallas_kernels.tree_attention.dispatch.row_inputs`) and passes them to every
    layer's call; inside a scanned layer stack XLA would otherwise rebuild them in each
    layer's body (it does not hoist pads out of a loop)."""
    page_table: jax.Array
    words: jax.Array


def row_inputs(page_table, mask_bits, num_pages: int, num_groups: int, blocks) -> RowInputs:
    return RowInputs(prepare_page_table(page_table, num_pages, blocks.pages_per_block),
                     row_words(mask_bits, num_groups, blocks.rows))


def kernel_operands(q, k_pages, page_table, mask_bits, blocks,
                    prepared: RowInputs | None = None) -> tuple[jax.Array, RowInputs]:
    """What both kernels start from: the grouped queries ``[B, KVH, R, D]`` and the row
    inputs (``prepared`` when the forward built them once, else built here)."""
    _, _, H, _ = q.shape
    _, KVH, P, _, _ = k_pages.shape
    if prepared is None:
        prepared = row_inputs(page_table, mask_bits, P, H // KVH, blocks)
    return group_queries(q, KVH, blocks.rows), prepared
