"""Tree attention over a paged KV cache: TPU (Mosaic) Pallas kernel.

Grid ``(B, KVH, R / row_block, num_blocks)``; ``page_table`` (flattened), ``lengths`` and the layer
index are scalar-prefetched into SMEM, and the K/V BlockSpecs' index maps read them
(as in JAX's ``paged_attention``): the pools are the whole stacked cache
``[L, KVH, P, page_size, D]`` in HBM, blocked ``(1, 1, 1, page_size, D)`` with the L,
KVH and page dims squeezed, so the pipeline DMAs exactly the row's pages of the one
layer (a traced layer, as in a ``lax.scan`` over layers, never slices a pool). A
block is ``pages_per_block`` pages: the K (and V) operand is passed
``pages_per_block`` times, operand ``j`` of step ``i`` being page ``i * ppb + j``;
the pages are concatenated along the (sublane-aligned) key axis in VMEM.

Per ``(b, kvh)`` the ``N * G`` query rows (head-major, padded to the sublane tile)
stay resident (in blocks of ``row_block`` rows when all of them would not fit VMEM, see
``block_sizes``); the online-softmax state ``m, l`` (lane-replicated ``[rows, 128]``)
and the fp32 accumulator live in VMEM scratch. Key positions ``p < lengths[b]`` are
visible with no mask (length bound only); positions ``lengths[b] + j`` for
``j < N`` (the tree nodes, which may straddle pages) are visible to row ``g*N+n``
iff bit ``j`` of node ``n``'s packed mask words, decoded in-kernel with a shift;
everything at or past ``lengths[b] + N`` is masked. Steps wholly past
``lengths[b] + N`` skip compute, and their index map repeats the last needed page,
so the pipeline issues no new DMA for them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tree_attention import layout
from pallas_kernels.tree_attention.block_sizes import BlockSizes

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LANES = 128


def _kernel(lengths_ref, pt_ref, layer_ref,           # scalar prefetch (SMEM)
            q_ref, words_ref, *refs,                  # VMEM blocks
            ppb: int, page_size: int, num_nodes: int, num_blocks: int, scale: float,
            return_lse: bool):
    k_refs, v_refs = refs[:ppb], refs[ppb:2 * ppb]
    o_ref, *lse_ref, m_sc, l_sc, acc_sc = refs[2 * ppb:]
    b, i = pl.program_id(0), pl.program_id(3)
    length = lengths_ref[b]
    bk = ppb * page_size
    start = i * bk

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(start < length + num_nodes)
    def _block():
        q = q_ref[...]                                                   # [R, D]
        if ppb == 1:
            k, v = k_refs[0][...], v_refs[0][...]
        else:
            k = jnp.concatenate([r[...] for r in k_refs], axis=0)       # [bk, D]
            v = jnp.concatenate([r[...] for r in v_refs], axis=0)
        prec = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * scale  # [R, bk]
        rows = q.shape[0]
        rel = start + lax.broadcasted_iota(jnp.int32, (rows, bk), 1) - length
        words = words_ref[...]                                           # [R, 2] int32
        word = jnp.where(rel >= layout.WORD_BITS, words[:, 1:2], words[:, 0:1])
        bit = jnp.right_shift(word, rel & (layout.WORD_BITS - 1)) & 1
        vis = (rel < 0) | ((rel < num_nodes) & (bit != 0))
        s = jnp.where(vis, s, MASK_VALUE)
        m_prev, l_prev = m_sc[:, 0:1], l_sc[:, 0:1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)        # [R, D]
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    @pl.when(i == num_blocks - 1)
    def _finish():
        l = l_sc[:, 0:1]
        o_ref[...] = (acc_sc[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)
        if return_lse:                                     # lane-replicated, as m and l
            lse_ref[0][...] = layout.finish_lse(m_sc[...], l_sc[...])


def tree_attention_tpu(q, k_pages, v_pages, page_table, lengths, mask_bits, layer, *,
                       blocks: BlockSizes, interpret: bool = False,
                       prepared: layout.RowInputs | None = None,
                       grouped: jax.Array | None = None, return_lse: bool = False):
    """Shapes as :func:`pallas_kernels.tree_attention.reference.tree_attention_ref` with
    stacked pools ``[L, KVH, P, page_size, D]`` and an int32 scalar ``layer``; ``blocks``
    from :func:`pallas_kernels.tree_attention.validate.validate`; ``prepared``: the
    page table and mask words when the caller built them once (:func:`layout.row_inputs`).
    ``grouped``: the queries already grouped, ``[B, KVH, R', D]`` whose first ``N * G`` rows
    are :func:`layout.group_queries` of ``q`` (rows after them are read as padding and never
    written): a fused projection's rotated ``[G + 2]`` block, which then also feeds the KV
    write (one array for both kernels; sliced apart, XLA relaid q out in every layer)."""
    B, N, H, D = q.shape
    L, KVH, P, ps, _ = k_pages.shape
    G = H // KVH
    ppb, R, Rb = blocks.pages_per_block, blocks.rows, blocks.row_block or blocks.rows
    qg, (pt, words, flat_table) = layout.kernel_operands(q, k_pages, page_table, mask_bits,
                                                         blocks, prepared, pad_rows=False,
                                                         grouped=grouped)
    M = pt.shape[1]                                                      # M % ppb == 0
    num_blocks = M // ppb

    def kv_spec(j):
        def index_map(b, h, r, i, lengths_ref, pt_ref, layer_ref):
            # Last page any visible key of this row lives on; later steps repeat it (no DMA).
            # lax.div, not //: floor division lowers through sign, which needs TPU info at lowering.
            last = jnp.minimum(lax.div(jnp.maximum(lengths_ref[b] + N - 1, 0), ps), M - 1)
            pos = jnp.minimum(i * ppb + j, last)
            return (layer_ref[0], h, pt_ref[b * M + pos], 0, 0)
        return pl.BlockSpec((None, None, None, ps, D), index_map)

    q_spec = pl.BlockSpec((None, None, Rb, D), lambda b, h, r, i, *_: (b, h, r, 0))
    w_spec = pl.BlockSpec((None, Rb, 2), lambda b, h, r, i, *_: (b, r, 0))
    kernel = functools.partial(_kernel, ppb=ppb, page_size=ps, num_nodes=N,
                               num_blocks=num_blocks, scale=D ** -0.5, return_lse=return_lse)
    out_specs, out_shape = q_spec, jax.ShapeDtypeStruct((B, KVH, N * G, D), q.dtype)
    if return_lse:
        out_specs = [q_spec, pl.BlockSpec((None, None, Rb, LANES),
                                          lambda b, h, r, i, *_: (b, h, r, 0))]
        out_shape = [out_shape, jax.ShapeDtypeStruct((B, KVH, R, LANES), jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, KVH, R // Rb, num_blocks),
            in_specs=[q_spec, w_spec] + [kv_spec(j) for j in range(ppb)] * 2,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((Rb, LANES), jnp.float32),
                            pltpu.VMEM((Rb, LANES), jnp.float32),
                            pltpu.VMEM((Rb, D), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        out_shape=out_shape,
        interpret=interpret,
        name=f"tree_attention_tpu_N{N}_G{G}_ppb{ppb}" + ("_lse" if return_lse else ""),
    )(lengths.astype(jnp.int32), flat_table, jnp.reshape(layer, (1,)).astype(jnp.int32),
      qg, words,
      *([k_pages] * ppb), *([v_pages] * ppb))
    if return_lse:
        return layout.ungroup_output(out[0], N, H), layout.ungroup_lse(out[1][..., 0], N, H)
    return layout.ungroup_output(out, N, H)
