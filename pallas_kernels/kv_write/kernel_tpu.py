"""A block's keys and values into the paged KV pools: TPU (Mosaic) Pallas kernel.

One kernel in place of what XLA:TPU makes of the two scatters (slices of the projection's
k/v rows, their relayout copies, the index bit-packing and the scatters themselves: seven
kernels of a scanned 8B layer body, deviceless v5p compile). The pools stay in HBM
(``pl.ANY``), aliased input to output, and are written by DMA.

Mosaic DMAs only whole sublane tiles of a tiled HBM array (an offset along ``page_size``
must be a multiple of the tile: 8 rows in fp32, 16 in bf16), so a write is a
read-modify-write of aligned row groups. Per batch row the block's ``T`` tokens sit at
consecutive positions (``lengths + offset + t``, some dropped), so they touch at most
``(T + A - 2) // A + 1`` groups of ``A`` slots (a group never straddles a page: ``A`` divides
``page_size``). Grid: chunks of batch rows (as many as fit VMEM, :func:`rows_per_step`;
all 8 of an 8B batch of 8). Every group of every head of the chunk's rows is fetched at once,
the new rows merged in VMEM, and all written back at once: two round trips to HBM per step,
not two per token or per row.

A group is identified by its first flat slot (``page * page_size + offset``); the slots come
from :func:`jspec.kv_cache.write_slots` (``P * page_size`` = dropped), so a dropped token,
whether masked or past the row's allocation, is neither read nor written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def row_group(dtype) -> int:
    """Rows of one sublane tile of ``dtype`` in HBM: the DMA granularity along the slot axis."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def num_groups(T: int, align: int) -> int:
    return (T + align - 2) // align + 1


MAX_TOKENS = 64         # the unrolled per-token merge; longer blocks (prefill) keep the scatter


def validate(rows, k_pages, v_pages, T: int, k_row0: int, v_row0: int) -> None:
    """Static checks (``ValueError``): ``rows [B, KVH, R, D]`` holding rows ``k_row0 .. + T`` and
    ``v_row0 .. + T``; pools ``[L, KVH, P, page_size, D]`` of one dtype; ``D % 128 == 0``;
    ``page_size`` a multiple of the dtype's sublane tile; ``1 <= T <= MAX_TOKENS``."""
    if rows.ndim != 4 or k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError(f"rows [B, KVH, R, D] and pools [L, KVH, P, page_size, D] expected, got "
                         f"{rows.shape}, {k_pages.shape}, {v_pages.shape}")
    B, KVH, R, D = rows.shape
    _, kvh, _, ps, d = k_pages.shape
    if (KVH, D) != (kvh, d):
        raise ValueError(f"rows {rows.shape} do not match the pools {k_pages.shape} (KV heads, head dim)")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k and v pools differ in dtype: {k_pages.dtype}, {v_pages.dtype}")
    if D % 128:
        raise ValueError(f"head dim {D} is not a multiple of 128 (the TPU lane width)")
    A = row_group(k_pages.dtype)
    if ps % A:
        raise ValueError(f"page_size {ps} is not a multiple of {A} rows (one {k_pages.dtype} "
                         f"sublane tile), which the TPU KV write DMAs")
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"T = {T} tokens: the kernel writes 1 to {MAX_TOKENS}")
    if min(k_row0, v_row0) < 0 or max(k_row0, v_row0) + T > R:
        raise ValueError(f"rows {k_row0}.. and {v_row0}.. (+{T}) do not fit the block's {R} rows")


def _plan(slots_ref, b, *, T: int, NG: int, A: int, oob: int):
    """Row ``b``'s groups as traced scalars: ``(count, start_of[NG], group_of[T])``. A new
    group starts at a token whose group differs from the last kept token's (positions are
    consecutive, so groups come in order and never again); ``group_of[t]`` is -1 when token
    ``t`` is dropped."""
    count, cur = jnp.int32(0), jnp.int32(-1)
    group_of, start_of = [], [jnp.int32(0)] * NG
    for t in range(T):
        s = slots_ref[b * T + t]
        keep = s < oob
        g = s - lax.rem(s, A)                                  # first slot of its group
        new = keep & (g != cur)
        count = count + new.astype(jnp.int32)
        cur = jnp.where(keep, g, cur)
        group_of.append(jnp.where(keep, count - 1, -1))
        for j in range(min(NG, t // A + 2)):       # token t's group index is at most t // A + 1
            start_of[j] = jnp.where(new & (count - 1 == j), g, start_of[j])
    return count, start_of, group_of


def _kernel(slots_ref, layer_ref,                    # scalar prefetch (SMEM)
            rows_ref, k_in, v_in,                    # [C, KVH, R, D] VMEM; pools (HBM)
            k_out, v_out,                            # the same pools (aliased)
            kbuf, vbuf, sems,                        # [C, KVH, NG, A, D] VMEM x2; 2 DMA semaphores
            *, T: int, k_row0: int, v_row0: int, page_size: int, oob: int, align: int):
    del k_in, v_in                                   # aliased: read and written through *_out
    C, KVH, NG, A = kbuf.shape[0], kbuf.shape[1], kbuf.shape[2], align
    first, layer = pl.program_id(0) * C, layer_ref[0]
    plan = functools.partial(_plan, slots_ref, T=T, NG=NG, A=A, oob=oob)

    def dmas(to_pool: bool, op: str):
        """Start (or wait for) every group's copies of the chunk's rows: all in flight at once."""
        def row(i, carry):
            count, start_of, _ = plan(first + i)
            for j in range(NG):
                @pl.when(j < count)
                def _():
                    page = lax.div(start_of[j], page_size)
                    off = pl.multiple_of(lax.rem(start_of[j], page_size), A)
                    for h in range(KVH):
                        for p, (pool, buf) in enumerate(((k_out, kbuf), (v_out, vbuf))):
                            hbm, vmem = pool.at[layer, h, page, pl.ds(off, A)], buf.at[i, h, j]
                            src, dst = (vmem, hbm) if to_pool else (hbm, vmem)
                            getattr(pltpu.make_async_copy(src, dst, sems.at[p]), op)()
            return carry
        lax.fori_loop(0, C, row, 0)

    def merge(i, carry):
        count, _, group_of = plan(first + i)
        slot_in_group = lax.broadcasted_iota(jnp.int32, (KVH, A, 1), 1)
        for j in range(NG):
            @pl.when(j < count)
            def _():
                kg, vg = kbuf[i, :, j], vbuf[i, :, j]                          # [KVH, A, D]
                for t in range(T):
                    if t // A + 2 <= j:
                        continue
                    s = slots_ref[(first + i) * T + t]
                    hit = (group_of[t] == j) & (slot_in_group == lax.rem(s, A))
                    kg = jnp.where(hit, rows_ref[i, :, pl.ds(k_row0 + t, 1), :], kg)
                    vg = jnp.where(hit, rows_ref[i, :, pl.ds(v_row0 + t, 1), :], vg)
                kbuf[i, :, j] = kg
                vbuf[i, :, j] = vg
        return carry

    dmas(False, "start")
    dmas(False, "wait")
    lax.fori_loop(0, C, merge, 0)
    dmas(True, "start")
    dmas(True, "wait")


VMEM_BUDGET = 8 << 20       # a chunk's rows block (double-buffered) and group buffers


def rows_per_step(B: int, KVH: int, R: int, D: int, NG: int, A: int, itemsize: int) -> int:
    """The most batch rows (a divisor of ``B``) one grid step takes within :data:`VMEM_BUDGET`:
    their DMAs all wait together, so fewer steps mean fewer round trips to HBM."""
    per_row = KVH * D * itemsize * (2 * R + 2 * NG * A)
    fits = [c for c in range(1, B + 1) if B % c == 0 and c * per_row <= VMEM_BUDGET]
    return max(fits, default=1)


def kv_write_tpu(rows, k_pages, v_pages, slots, layer, *, T: int, k_row0: int, v_row0: int,
                 interpret: bool = False):
    """Write tokens ``t < T`` of ``rows [B, KVH, R, D]`` (key ``t`` at row ``k_row0 + t``, value
    at ``v_row0 + t``) into layer ``layer`` of the stacked pools ``[L, KVH, P, page_size, D]``
    at flat slots ``slots [B * T]`` (``P * page_size``: dropped). Returns the new pools (the
    inputs' buffers, donated in place under jit).

    Contract (dynamic, not checked): a row's kept slots are those of consecutive positions,
    as :func:`jspec.kv_cache.write_slots` gives them, so its groups come in order and none
    twice; slots of different rows never share a page."""
    validate(rows, k_pages, v_pages, T, k_row0, v_row0)
    B, KVH, R, D = rows.shape
    L, _, P, ps, _ = k_pages.shape
    A = row_group(k_pages.dtype)
    NG = num_groups(T, A)
    C = rows_per_step(B, KVH, R, D, NG, A, jnp.dtype(k_pages.dtype).itemsize)
    kernel = functools.partial(_kernel, T=T, k_row0=k_row0, v_row0=v_row0, page_size=ps,
                               oob=P * ps, align=A)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B // C,),
            in_specs=[pl.BlockSpec((C, KVH, R, D), lambda c, *_: (c, 0, 0, 0)), any_spec, any_spec],
            out_specs=[any_spec, any_spec],
            scratch_shapes=[pltpu.VMEM((C, KVH, NG, A, D), k_pages.dtype),
                            pltpu.VMEM((C, KVH, NG, A, D), v_pages.dtype),
                            pltpu.SemaphoreType.DMA((2,))]),
        # Rows own disjoint pages, so their groups never overlap.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        name=f"kv_write_tpu_T{T}",
    )(slots.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
      rows.astype(k_pages.dtype), k_pages, v_pages)
