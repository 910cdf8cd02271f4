"""Pallas kernels for the verify walk (greedy and tree rejection sampling).

One grid step per request. The walk follows the first-child / next-sibling lists
from the root: at the current node it tries the children in list order (which is
increasing node order, see :func:`jspec.tree.build.build_tree`); accepting a child
descends into it; the walk stops when every child of the current node was tried or
when the accepted path reaches depth ``S = max_depth``. Every node except the root
is examined at most once, so the walk is a fixed ``N - 1`` step loop whose state is
``(current node, candidate child, depth, done)``: no data-dependent trip counts.

All kernels return one packed int32 row per request, ``[B, 1, W]`` with
``W >= S + 3``: lanes ``0..S`` the accepted path (-1 padded), lane ``S + 1`` the
accepted length, lane ``S + 2`` the bonus token; :func:`unpack` splits it.

TPU (Mosaic)
  Per-request int rows (tokens, first_child, next_sibling, argmax, uniforms) are
  blocked into SMEM (``BlockSpec(memory_space=SMEM)``, block ``(1, N)`` of a
  ``[B, 1, N]`` view), where the walk indexes them with dynamic scalars. The output
  row is a lane-dense ``(1, W)`` VMEM block, ``W`` a multiple of 128, built with
  iota selects. For sampling, ``probs`` stays in HBM (``pl.ANY``) viewed as
  ``[B, N, V/128, 128]`` (a free reshape when ``V % 128 == 0``); the residual ``r``
  lives in one ``(Rp, 128)`` f32 VMEM scratch (``Rp`` = ``V/128`` rounded up to 8,
  zero padded), and only the rows of the nodes the walk visits are DMAed in (at most
  ``S + 1`` rows of V floats, instead of the whole ``N x V`` block). The bonus
  inverse CDF uses a Hillis-Steele scan with ``pltpu.roll`` (lanes, then rows).

GPU (Triton)
  Same walk, one program per request, scalar loads from the int arrays in global
  memory. The residual lives in a ``[B, Vc]`` f32 global workspace (an extra output,
  discarded) processed in chunks of ``C`` lanes (power of two), with a CTA barrier
  after every write so that all threads see the updated row.

Float semantics: the acceptance test is ``u * sum(r) < r[x]`` with ``sum(r)``
recomputed after each change of ``r`` (as the jnp reference does; no running
subtraction, which would cancel catastrophically when most mass is rejected). The
bonus is ``#{c_i <= min(u * T, nextafter(T, 0))}`` over the inclusive prefix sums
``c`` with ``T`` their total, clipped to ``V - 1``; written without ``nextafter`` as
``(c <= u*T) & ((c < T) | (T <= 0))``, which is the same set. Summation order differs
from XLA's, so results equal the reference bit for bit whenever the sums are exact
(e.g. dyadic probabilities) and otherwise differ only when a uniform lands within
float rounding of a decision boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

LANES = 128
SUBLANES = 8


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def out_width(max_depth: int) -> int:
    """Lane width of the packed output row (path, length, bonus): a power of two
    (Triton) that is a multiple of 128 (TPU lanes)."""
    return max(LANES, _next_pow2(max_depth + 3))


def unpack(packed: jax.Array, max_depth: int):
    """``[B, 1, W]`` packed rows -> ``(accept_index [B, S+1], accept_len [B], bonus [B])``."""
    row = packed[:, 0, :]
    return row[:, : max_depth + 1], row[:, max_depth + 1], row[:, max_depth + 2]


def _walk(n: int, max_depth: int, first_child0, try_child, lane):
    """The shared child-by-child walk.

    ``try_child(cur, child) -> (take, next_if_take, next_if_reject)`` decides one child;
    it may have side effects (the sampling kernels update the residual there).
    Returns ``(cur, depth, path_vec)`` with ``path_vec`` the accepted path placed in
    lanes ``0..depth`` of ``lane``'s shape and -1 elsewhere.
    """
    acc0 = jnp.where(lane == 0, 0, -1).astype(jnp.int32)
    if n == 1 or max_depth == 0:
        return jnp.int32(0), jnp.int32(0), acc0

    def body(_, carry):
        cur, child, depth, done, acc = carry
        live = jnp.logical_and(child >= 0, jnp.logical_not(done))
        safe = jnp.maximum(child, 0)
        ok, nxt_take, nxt_rej = try_child(cur, safe, live)
        take = jnp.logical_and(live, ok)
        depth = jnp.where(take, depth + 1, depth)
        acc = jnp.where(jnp.logical_and(lane == depth, take), safe, acc)
        cur = jnp.where(take, safe, cur)
        done = jnp.logical_or(jnp.logical_or(done, jnp.logical_not(live)),
                              jnp.logical_and(take, depth >= max_depth))
        child = jnp.where(done, -1, jnp.where(take, nxt_take, nxt_rej))
        return cur, child, depth, done, acc

    init = (jnp.int32(0), first_child0, jnp.int32(0), jnp.bool_(False), acc0)
    cur, _, depth, _, acc = lax.fori_loop(0, n - 1, body, init)
    return cur, depth, acc


def _finish(acc, lane, max_depth, depth, bonus):
    acc = jnp.where(lane == max_depth + 1, depth + 1, acc)
    return jnp.where(lane == max_depth + 2, bonus, acc)


# ----------------------------------------------------------------------------- TPU


def _tpu_greedy_kernel(tok_ref, fc_ref, ns_ref, am_ref, out_ref, *, n, max_depth):
    lane = lax.broadcasted_iota(jnp.int32, out_ref.shape, len(out_ref.shape) - 1)

    def try_child(cur, child, live):
        del live
        ok = tok_ref[0, child] == am_ref[0, cur]
        return ok, fc_ref[0, child], ns_ref[0, child]

    cur, depth, acc = _walk(n, max_depth, fc_ref[0, 0], try_child, lane)
    out_ref[...] = _finish(acc, lane, max_depth, depth, am_ref[0, cur])


def _smem_row_spec(n: int):
    return pl.BlockSpec((None, 1, n), lambda b: (b, 0, 0), memory_space=pltpu.SMEM)


def _out_spec(width: int):
    return pl.BlockSpec((None, 1, width), lambda b: (b, 0, 0))


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def greedy_walk_tpu(tokens, first_child, next_sibling, target_argmax, *, max_depth: int,
                    interpret=False):
    """Mosaic TPU greedy walk. int32 ``[B, N]`` inputs -> packed ``[B, 1, W]`` int32."""
    B, N = tokens.shape
    W = out_width(max_depth)
    rows = [a.reshape(B, 1, N) for a in (tokens, first_child, next_sibling, target_argmax)]
    return pl.pallas_call(
        functools.partial(_tpu_greedy_kernel, n=N, max_depth=max_depth),
        out_shape=jax.ShapeDtypeStruct((B, 1, W), jnp.int32),
        grid=(B,),
        in_specs=[_smem_row_spec(N)] * 4,
        out_specs=_out_spec(W),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="verify_walk_greedy",
    )(*rows)


def _tpu_sample_kernel(tok_ref, fc_ref, ns_ref, u_ref, probs_hbm, out_ref, r_ref, sem, *,
                       n, max_depth, vocab, rows):
    b = pl.program_id(0)
    lane = lax.broadcasted_iota(jnp.int32, out_ref.shape, len(out_ref.shape) - 1)
    rp = r_ref.shape[0]
    vlane = lax.broadcasted_iota(jnp.int32, (1, LANES), 1)

    def load_row(node):
        dst = r_ref if rows == rp else r_ref.at[pl.ds(0, rows)]
        copy = pltpu.make_async_copy(probs_hbm.at[b, node], dst, sem)
        copy.start()
        copy.wait()

    if rows != rp:
        r_ref[...] = jnp.zeros(r_ref.shape, jnp.float32)
    load_row(0)

    def try_child(cur, child, live):
        del cur
        x = jnp.clip(tok_ref[0, child], 0, vocab - 1)
        # x >= 0: shifts instead of // and % (whose sign handling Mosaic lowers via
        # a chip-specific rule that needs a TPU to query).
        xr, xc = lax.shift_right_logical(x, 7), lax.bitwise_and(x, LANES - 1)
        row = r_ref[pl.ds(xr, 1), :]
        hit = vlane == xc
        rx = jnp.sum(jnp.where(hit, row, 0.0))
        total = jnp.sum(r_ref[...])
        ok = u_ref[0, child] * total < rx
        reject = jnp.logical_and(live, jnp.logical_not(ok))
        r_ref[pl.ds(xr, 1), :] = jnp.where(jnp.logical_and(hit, reject), 0.0, row)

        @pl.when(jnp.logical_and(live, ok))
        def _():
            load_row(child)

        return ok, fc_ref[0, child], ns_ref[0, child]

    cur, depth, acc = _walk(n, max_depth, fc_ref[0, 0], try_child, lane)
    del cur

    # Inverse CDF over the residual: inclusive prefix sums c (lanes, then rows).
    r = r_ref[...]
    li = lax.broadcasted_iota(jnp.int32, r.shape, 1)
    ri = lax.broadcasted_iota(jnp.int32, r.shape, 0)
    w = r
    k = 1
    while k < LANES:
        w = w + jnp.where(li >= k, pltpu.roll(w, k, 1), 0.0)
        k *= 2
    t = jnp.broadcast_to(w[:, LANES - 1:], r.shape)          # row totals
    e = jnp.where(ri >= 1, pltpu.roll(t, 1, 0), 0.0) if rp > 1 else jnp.zeros_like(t)
    k = 1
    while k < rp:
        e = e + jnp.where(ri >= k, pltpu.roll(e, k, 0), 0.0)
        k *= 2
    c = e + w
    total = jnp.max(c)
    a = u_ref[0, n] * total
    below = jnp.logical_and(c <= a, jnp.logical_or(c < total, total <= 0.0))
    bonus = jnp.minimum(jnp.sum(below.astype(jnp.int32)), vocab - 1)
    out_ref[...] = _finish(acc, lane, max_depth, depth, bonus)


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def sample_walk_tpu(tokens, first_child, next_sibling, probs, u_accept, u_bonus, *,
                    max_depth: int, interpret=False):
    """Mosaic TPU tree-rejection-sampling walk -> packed ``[B, 1, W]`` int32.

    ``probs [B, N, V]`` f32 stays in HBM; if ``V % 128 != 0`` it is zero padded here
    (one copy of ``probs``; vocabularies like 32000 / 128256 / 151936 need none).
    """
    B, N = tokens.shape
    V = probs.shape[-1]
    W = out_width(max_depth)
    vp = _round_up(V, LANES)
    if vp != V:
        probs = jnp.pad(probs, ((0, 0), (0, 0), (0, vp - V)))
    R = vp // LANES
    Rp = _round_up(R, SUBLANES)
    probs4 = probs.reshape(B, N, R, LANES)
    rows = [a.reshape(B, 1, N) for a in (tokens, first_child, next_sibling)]
    u = jnp.concatenate([u_accept.astype(jnp.float32),
                         u_bonus.astype(jnp.float32)[:, None]], axis=1).reshape(B, 1, N + 1)
    return pl.pallas_call(
        functools.partial(_tpu_sample_kernel, n=N, max_depth=max_depth, vocab=V, rows=R),
        out_shape=jax.ShapeDtypeStruct((B, 1, W), jnp.int32),
        grid=(B,),
        in_specs=[_smem_row_spec(N)] * 3 + [_smem_row_spec(N + 1),
                                            pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=_out_spec(W),
        scratch_shapes=[pltpu.VMEM((Rp, LANES), jnp.float32), pltpu.SemaphoreType.DMA(())],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="verify_walk_sample",
    )(*rows, u, probs4)


# ----------------------------------------------------------------------------- GPU


def _gpu_out_spec(width: int):
    return pl.BlockSpec((None, 1, width), lambda b: (b, 0, 0))


def _gpu_params(num_warps: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _gpu_greedy_kernel(tok_ref, fc_ref, ns_ref, am_ref, out_ref, *, n, max_depth):
    b = pl.program_id(0)
    lane = lax.broadcasted_iota(jnp.int32, out_ref.shape, len(out_ref.shape) - 1)

    def try_child(cur, child, live):
        del live
        return tok_ref[b, child] == am_ref[b, cur], fc_ref[b, child], ns_ref[b, child]

    cur, depth, acc = _walk(n, max_depth, fc_ref[b, 0], try_child, lane)
    out_ref[...] = _finish(acc, lane, max_depth, depth, am_ref[b, cur])


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def greedy_walk_gpu(tokens, first_child, next_sibling, target_argmax, *, max_depth: int,
                    interpret=False):
    """Triton greedy walk (one program per request) -> packed ``[B, 1, W]`` int32."""
    B, N = tokens.shape
    W = out_width(max_depth)
    return pl.pallas_call(
        functools.partial(_gpu_greedy_kernel, n=N, max_depth=max_depth),
        out_shape=jax.ShapeDtypeStruct((B, 1, W), jnp.int32),
        grid=(B,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 4,
        out_specs=_gpu_out_spec(W),
        compiler_params=_gpu_params(1),
        interpret=interpret,
        name="verify_walk_greedy",
    )(tokens, first_child, next_sibling, target_argmax)


def gpu_chunk(vocab: int) -> int:
    """Lanes per chunk of the GPU residual loops (a power of two)."""
    return min(_next_pow2(vocab), 2048)


def _gpu_sample_kernel(tok_ref, fc_ref, ns_ref, u_ref, probs_ref, out_ref, ws_ref, *,
                       n, max_depth, vocab, chunk, barrier):
    b = pl.program_id(0)
    lane = lax.broadcasted_iota(jnp.int32, out_ref.shape, len(out_ref.shape) - 1)
    nchunks = -(-vocab // chunk)
    ar = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    def sync():
        # Every thread of the CTA must see the workspace row written by the others.
        if barrier:
            plgpu.debug_barrier()

    def load_row(node):
        def body(i, carry):
            start = pl.multiple_of(i * chunk, chunk)
            v = plgpu.load(probs_ref.at[b, node, pl.ds(start, chunk)],
                           mask=start + ar < vocab, other=0.0)
            ws_ref[b, pl.ds(start, chunk)] = v        # pad lanes get 0
            return carry

        lax.fori_loop(0, nchunks, body, 0)
        sync()

    def chunk_of(i):
        return ws_ref[b, pl.ds(pl.multiple_of(i * chunk, chunk), chunk)]

    def residual_sum():
        return lax.fori_loop(0, nchunks, lambda i, s: s + jnp.sum(chunk_of(i)), jnp.float32(0))

    load_row(jnp.int32(0))

    def try_child(cur, child, live):
        del cur
        x = jnp.clip(tok_ref[b, child], 0, vocab - 1)
        rx = ws_ref[b, x]
        total = residual_sum()
        ok = u_ref[b, child] * total < rx
        reject = jnp.logical_and(live, jnp.logical_not(ok))
        sync()                                         # everyone has read the row
        ws_ref[b, x] = jnp.where(reject, jnp.float32(0), rx)
        sync()

        @pl.when(jnp.logical_and(live, ok))
        def _():
            load_row(child)

        return ok, fc_ref[b, child], ns_ref[b, child]

    cur, depth, acc = _walk(n, max_depth, fc_ref[b, 0], try_child, lane)
    del cur

    # Inverse CDF: two passes of identical arithmetic over the chunks.
    def prefix(i, carry):
        return carry + jnp.cumsum(chunk_of(i))

    total = lax.fori_loop(0, nchunks, lambda i, t: jnp.max(prefix(i, t)), jnp.float32(0))
    a = u_ref[b, n] * total

    def count(i, state):
        carry, cnt = state
        c = prefix(i, carry)
        below = jnp.logical_and(c <= a, jnp.logical_or(c < total, total <= 0.0))
        return jnp.max(c), cnt + jnp.sum(below.astype(jnp.int32))

    _, cnt = lax.fori_loop(0, nchunks, count, (jnp.float32(0), jnp.int32(0)))
    bonus = jnp.minimum(cnt, vocab - 1)
    out_ref[...] = _finish(acc, lane, max_depth, depth, bonus)


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def sample_walk_gpu(tokens, first_child, next_sibling, probs, u_accept, u_bonus, *,
                    max_depth: int, interpret=False):
    """Triton tree-rejection-sampling walk -> packed ``[B, 1, W]`` int32.

    The residual lives in a ``[B, Vc]`` f32 global workspace (``Vc`` = V rounded up to
    the chunk), returned by the pallas_call and dropped here.
    """
    B, N = tokens.shape
    V = probs.shape[-1]
    W = out_width(max_depth)
    C = gpu_chunk(V)
    vc = _round_up(V, C)
    u = jnp.concatenate([u_accept.astype(jnp.float32),
                         u_bonus.astype(jnp.float32)[:, None]], axis=1)
    packed, _ = pl.pallas_call(
        functools.partial(_gpu_sample_kernel, n=N, max_depth=max_depth, vocab=V, chunk=C,
                          barrier=interpret is False),
        out_shape=(jax.ShapeDtypeStruct((B, 1, W), jnp.int32),
                   jax.ShapeDtypeStruct((B, vc), jnp.float32)),
        grid=(B,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 5,
        out_specs=(_gpu_out_spec(W), pl.BlockSpec(memory_space=pl.ANY)),
        compiler_params=_gpu_params(4),
        interpret=interpret,
        name="verify_walk_sample",
    )(tokens, first_child, next_sibling, u, probs)
    return packed
