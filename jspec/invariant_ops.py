"""Reductions whose order of summation does not move with the shape of the batch around
them, on XLA:CPU (what :mod:`jspec.invariant_attention` and W8A8's activation scales build
on; the measurements are in that module's doc).

XLA:CPU hands a plain reduce to its YNN library fusion, which takes some of the
elementwise ops around it along (an ``exp``, an ``rsqrt``) at some shapes and not at
others, and YNN's transcendentals differ from XLA's own in the last bit. A two-operand
reduce is not taken: it stays in XLA's loop emitter, which sums each output in index order
whatever the other dimensions are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _reduce(x, axis: int, init, op):
    """``op``-reduce ``x`` over ``axis`` through a two-operand reduce (both halves are the
    same result; combining them is exact for ``max``, and ``a + a`` is ``2a`` exactly)."""
    z = jnp.asarray(init, x.dtype)
    a, b = jax.lax.reduce((x, x), (z, z), lambda p, q: (op(p[0], q[0]), op(p[1], q[1])),
                          (axis % x.ndim,))
    return a, b


def plain_max(x, axis: int, keepdims: bool = False):
    a, b = _reduce(x, axis, -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else
                   jnp.iinfo(x.dtype).min, jnp.maximum)
    out = jnp.maximum(a, b)
    return jnp.expand_dims(out, axis) if keepdims else out


def plain_sum(x, axis: int, keepdims: bool = False):
    a, b = _reduce(x, axis, 0, jnp.add)
    out = (a + b) * jnp.asarray(0.5, x.dtype)
    return jnp.expand_dims(out, axis) if keepdims else out

