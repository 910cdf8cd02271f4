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


# Rows are head-major: row ``g * N + n`` is node ``n`` of query head ``kvh * G + g``. A fused
# q/k/v projection comes out laid out [B, KVH, G + 2, N, D] on TPU (XLA's choice for the
# [KVH, G + 2, D, H] weight), so its query slice already is the kernels' [B, KVH, G * N, D]
# and grouping it costs no transpose (node-major rows cost a relayout copy per layer).
def group_queries(q: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
    """``[B, N, H, D]`` -> ``[B, KVH, rows, D]``: row ``g * N + n`` is node ``n``, head
    ``kvh * G + g``; padded with zero rows up to ``rows``."""
    B, N, H, D = q.shape
    G = H // num_kv_heads
    qg = q.reshape(B, N, num_kv_heads, G, D).transpose(0, 2, 3, 1, 4).reshape(B, num_kv_heads, G * N, D)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows - N * G), (0, 0)))


def ungroup_output(o: jax.Array, n: int, num_heads: int) -> jax.Array:
    """Inverse of :func:`group_queries`: ``[B, KVH, rows, D]`` -> ``[B, N, H, D]``."""
    B, KVH, _, D = o.shape
    G = num_heads // KVH
    return o[:, :, : n * G].reshape(B, KVH, G, n, D).transpose(0, 3, 1, 2, 4).reshape(B, n, num_heads, D)


def ungroup_lse(lse: jax.Array, n: int, num_heads: int) -> jax.Array:
    """Per-row log-sum-exps ``[B, KVH, rows]`` -> ``[B, N, H]`` (as :func:`ungroup_output`)."""
    return ungroup_output(lse[..., None], n, num_heads)[..., 0]


def finish_lse(m: jax.Array, l: jax.Array) -> jax.Array:
    """The online softmax's running max ``m`` and sum ``l`` -> log-sum-exp (-inf where the
    row saw no key)."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def row_words(mask_bits: jax.Array, num_groups: int, rows: int) -> jax.Array:
    """Mask words per query row: ``[B, rows, 2]`` int32 (row ``g * N + n`` -> node ``n``;
    padding rows get no tree bits)."""
    w = jnp.tile(mask_words32(mask_bits), (1, num_groups, 1))
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
    layer's body (it does not hoist pads out of a loop). ``flat_table`` is the table as
    the TPU kernel's scalar prefetch reads it, ``[B * M]``: flattening it is a relayout on
    TPU, which in the layer body would be one more kernel per layer."""
    page_table: jax.Array
    words: jax.Array
    flat_table: jax.Array


def row_inputs(page_table, mask_bits, num_pages: int, num_groups: int, blocks) -> RowInputs:
    pt = prepare_page_table(page_table, num_pages, blocks.pages_per_block)
    return RowInputs(pt, row_words(mask_bits, num_groups, blocks.rows), pt.reshape(-1))


def kernel_operands(q, k_pages, page_table, mask_bits, blocks,
                    prepared: RowInputs | None = None,
                    pad_rows: bool = True, grouped: jax.Array | None = None
                    ) -> tuple[jax.Array, RowInputs]:
    """What both kernels start from: the grouped queries ``[B, KVH, R, D]`` and the row
    inputs (``prepared`` when the forward built them once, else built here).
    ``pad_rows=False``: the queries keep their ``N * G`` rows (the last row block then
    overhangs them, which the TPU pipeline pads on read and drops on write; a padded copy
    and the slice after it were two kernels per layer)."""
    _, _, H, _ = q.shape
    _, KVH, P, _, _ = k_pages.shape
    if prepared is None:
        prepared = row_inputs(page_table, mask_bits, P, H // KVH, blocks)
    if grouped is not None:
        return grouped.astype(q.dtype), prepared
    return group_queries(q, KVH, blocks.rows if pad_rows else H // KVH * q.shape[1]), prepared
