"""Exact top-k over a wide last axis (a vocabulary) in two small stages.

``jax.lax.top_k`` over a vocabulary-wide axis costs XLA:TPU about 6 s of compile time per
program (deviceless v5p compile, ``[8, 4, 32768]``, k = 4; over a 16-wide axis it is 0.1 s):
the drafter's top-k was most of the 8B EAGLE-3 draft program's compile. Here the axis is cut
into chunks of :data:`CHUNK` lanes, the k chunks with the best maxima are found by a top-k
over the chunk maxima, and the answer is the top-k of those k chunks' elements.

It is the same answer as ``lax.top_k``, ties included (equal values in index order): order
elements by (value descending, index ascending); a chunk's first maximum precedes its other
elements, and chunks order like their first maxima. Every top-k element's chunk has its first
maximum at or before that element, hence among the top k, so the chunk is among the k
chunks picked. ``-0.0`` is read as ``+0.0`` (``lax.top_k`` orders it below ``+0.0``; chunk maxima
do not keep the sign), so callers' values must not depend on the sign of a zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.platform import target_platform

CHUNK = 128                # one lane tile
MIN_WIDTH = 4 * CHUNK      # narrower axes: lax.top_k compiles fast there


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``(values, indices)`` of the ``k`` largest entries along the last axis, as
    ``jax.lax.top_k`` (values descending, ties in index order), for float ``x``: two-stage on
    TPU, ``lax.top_k`` elsewhere. The two stages cost kernels (the 8B EAGLE-3 draft program
    285 -> 329, deviceless v5p) for the compile time; XLA:CPU and XLA:GPU have no such
    compile cost to win back."""
    if target_platform() != "tpu":
        return jax.lax.top_k(x, k)
    return two_stage_top_k(x, k)


def two_stage_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """:func:`top_k` in two stages (module doc), on any platform."""
    x = x + jnp.zeros((), x.dtype)                         # -0.0 -> +0.0 (module doc)
    V = x.shape[-1]
    if V < MIN_WIDTH or 4 * k * CHUNK > V:
        # The last stage is a top-k over k * CHUNK candidates: cutting pays only while that is
        # a small part of the axis (the sampling filter's 256 candidates over 128256 would
        # still be a 32768-wide lax.top_k, plus the stages around it).
        return jax.lax.top_k(x, k)
    pad = -V % CHUNK
    if pad:
        x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (pad,), -jnp.inf, x.dtype)], -1)
    chunks = x.reshape(x.shape[:-1] + (-1, CHUNK))         # [..., V / CHUNK, CHUNK]
    _, best = two_stage_top_k(jnp.max(chunks, -1), k)      # [..., k] chunk ids
    best = jnp.sort(best, -1)                              # index order within the candidates
    cand = jnp.take_along_axis(chunks, best[..., None], axis=-2)          # [..., k, CHUNK]
    vals, pos = two_stage_top_k(cand.reshape(cand.shape[:-2] + (k * CHUNK,)), k)   # (both
    # inner axes are narrower, and are cut again while they are wide)
    chunk = jnp.take_along_axis(best, pos // CHUNK, axis=-1)
    return vals, (chunk * CHUNK + pos % CHUNK).astype(jnp.int32)
