"""Tree attention over a paged KV cache: GPU Pallas kernel (Triton lowering).

Grid ``(B, KVH, R / row_block)``; each program holds ``row_block`` of its KV head's
``N * G`` query rows (padded to a power of two R >= 16; all of them unless the rows are
split to fit shared memory, see ``block_sizes``) and loops with ``lax.fori_loop`` over
key blocks up to ``lengths[b] + N``: ``pages_per_block`` pages, gathered through the row's
page table (``k_ref[layer, h, pages]``), or, when a page is larger than a block
(``page_chunks`` > 1), a slice of one page. Pages are read straight from the whole stacked
pool ``[L, KVH, P, page_size, D]``, the layer read from a scalar operand, so a traced layer
never slices a pool; Triton's pointer arithmetic goes 64-bit when a pool exceeds 4 GiB.
Online softmax in fp32 registers; the prefix needs only the length bound, the N tree
columns decode the packed mask words in-kernel.
Triton needs power-of-two block dims: rows, head_dim and page_size (validated).
Dots are plain ``lax.dot_general`` with fp32 accumulation (what ``plgpu.dot`` wraps;
newer JAX documents no ``dot`` in ``pallas.triton``); fp32 inputs use HIGHEST
precision (no TF32), so fp32 results match the reference to ~1e-6.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tree_attention import layout
from pallas_kernels.tree_attention.block_sizes import BlockSizes

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(q_ref, k_ref, v_ref, pt_ref, len_ref, layer_ref, lo_ref, hi_ref, o_ref, *lse_ref,
            ppb: int, chunks: int, page_size: int, num_nodes: int, num_blocks: int, scale: float):
    q = q_ref[...]                                                       # [R, D]
    rows, D = q.shape
    bk = ppb * page_size // chunks
    length = len_ref[0]
    layer, h = layer_ref[0], pl.program_id(1)
    lo, hi = lo_ref[...][:, None], hi_ref[...][:, None]                  # [R, 1] int32
    fp32 = q.dtype == jnp.float32
    prec = lax.Precision.HIGHEST if fp32 else None

    def body(j, carry):
        acc, m, l = carry
        if chunks == 1:                                                   # ppb whole pages
            pages = pt_ref[pl.ds(j * ppb, ppb)]                           # [ppb]
            k = k_ref[layer, h, pages].reshape(bk, D)
            v = v_ref[layer, h, pages].reshape(bk, D)
        else:                                                             # a slice of one page
            # lax.div/rem (j >= 0): Python's // and % lower through sign fix-ups Triton refuses.
            page = pt_ref[pl.ds(lax.div(j, chunks), 1)]                   # [1]
            at = pl.ds(pl.multiple_of(lax.rem(j, chunks) * bk, bk), bk)
            k = k_ref[layer, h, page, at].reshape(bk, D)
            v = v_ref[layer, h, page, at].reshape(bk, D)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * scale           # [R, bk]
        rel = (j * bk - length) + jnp.arange(bk, dtype=jnp.int32)[None, :]   # [1, bk]
        word = jnp.where(rel >= layout.WORD_BITS, hi, lo)                 # [R, bk]
        bit = jnp.right_shift(word, rel & (layout.WORD_BITS - 1)) & 1
        vis = (rel < 0) | ((rel < num_nodes) & (bit != 0))
        s = jnp.where(vis, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l_new = alpha * l + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)           # [R, D]
        return alpha[:, None] * acc + pv, m_new, l_new

    n = jnp.minimum(pl.cdiv(length + num_nodes, bk), num_blocks)
    init = (jnp.zeros((rows, D), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n, body, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    if lse_ref:
        lse_ref[0][...] = layout.finish_lse(m, l)


def tree_attention_gpu(q, k_pages, v_pages, page_table, lengths, mask_bits, layer, *,
                       blocks: BlockSizes, interpret: bool = False,
                       prepared: layout.RowInputs | None = None, return_lse: bool = False):
    """The Triton form of :func:`pallas_kernels.tree_attention.kernel_tpu.tree_attention_tpu`
    (same arguments): one program per (row, KV head, block of query rows) walks the row's
    live pages."""
    B, N, H, D = q.shape
    L, KVH, P, ps, _ = k_pages.shape
    G = H // KVH
    ppb, R, Rb = blocks.pages_per_block, blocks.rows, blocks.row_block or blocks.rows
    qg, (pt, words, _) = layout.kernel_operands(q, k_pages, page_table, mask_bits, blocks, prepared)
    M = pt.shape[1]
    lo, hi = words[..., 0], words[..., 1]
    chunks = blocks.page_chunks
    kernel = functools.partial(_kernel, ppb=ppb, chunks=chunks, page_size=ps, num_nodes=N,
                               num_blocks=M // ppb * chunks, scale=D ** -0.5)
    q_spec = pl.BlockSpec((None, None, Rb, D), lambda b, h, r: (b, h, r, 0))
    kv_spec = pl.BlockSpec((L, KVH, P, ps, D), lambda b, h, r: (0, 0, 0, 0, 0))   # whole pool
    row_spec = pl.BlockSpec((None, Rb), lambda b, h, r: (b, r))
    out_specs, out_shape = q_spec, jax.ShapeDtypeStruct((B, KVH, R, D), q.dtype)
    if return_lse:
        out_specs = [q_spec, pl.BlockSpec((None, None, Rb), lambda b, h, r: (b, h, r))]
        out_shape = [out_shape, jax.ShapeDtypeStruct((B, KVH, R), jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=(B, KVH, R // Rb),
        in_specs=[q_spec, kv_spec, kv_spec,
                  pl.BlockSpec((None, M), lambda b, h, r: (b, 0)),
                  pl.BlockSpec((1,), lambda b, h, r: (b,)),
                  pl.BlockSpec((1,), lambda b, h, r: (0,)),
                  row_spec, row_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"tree_attention_gpu_N{N}_G{G}_ppb{ppb}" + ("_lse" if return_lse else ""),
    )(qg, k_pages, v_pages, pt, lengths.astype(jnp.int32),
      jnp.reshape(layer, (1,)).astype(jnp.int32), lo, hi)
    if return_lse:
        return layout.ungroup_output(out[0], N, H), layout.ungroup_lse(out[1], N, H)
    return layout.ungroup_output(out, N, H)
