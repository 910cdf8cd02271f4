"""A weight held quantized, and its product: the one place a quantized target's arithmetic
differs from a float one (:func:`jspec.serving_layout.linear` hands it every such weight).

The numbers are qwix's (:class:`qwix.QArray`, :func:`qwix.quantize`,
:func:`qwix.dot_general`): weight-only modes dequantize the weight into the product (XLA on
TPU and GPU fuses that into the matmul; XLA:CPU materializes it, see docs/quantization.md),
``w8a8`` quantizes the activations per token and multiplies int8 by int8 into int32.
A per-output-channel weight-only product multiplies by the values and scales the output
(the same numbers, one rounding apart; nothing dequantized is materialized).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import qwix

from jspec.invariant_ops import plain_max, plain_sum
from jspec.quant.product import cpu_rows, cpu_w8a8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
    """An output-major weight ``[out..., in]`` (the packed layout's) held as a
    :class:`qwix.QArray`.

    ``in_scale [in]``: a norm scale to apply to the input first. Float weights have their
    RMSNorm scale folded in (:func:`jspec.serving_layout.fold_scale`); weights kept in a
    checkpoint's own blocks (GGUF Q8_0) cannot absorb a per-input factor without being
    requantized, so they carry it. ``act``: the activations' quantized type (``w8a8``), or
    None (weight-only)."""
    q: qwix.QArray
    in_scale: jax.Array | None = None
    act: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    shape = property(lambda self: self.q.qvalue.shape)
    ndim = property(lambda self: self.q.qvalue.ndim)

    def astype(self, dtype):
        """The forward casts weights to the compute dtype; a quantized weight stays as it
        is and its product comes out in the input's dtype."""
        return self

    def dequantize(self) -> jax.Array:
        """The float weight this one stands for (``in_scale`` folded in): what
        dequantize-then-matmul references compare against."""
        if self.q.qvalue.dtype.itemsize > 1:     # quantize="bf16": qwix takes no such values
            w = self.q.qvalue.astype(jnp.float32) * self.q.scale.astype(jnp.float32)
        else:
            w = qwix.dequantize(self.q).astype(jnp.float32)
        return w if self.in_scale is None else w * self.in_scale.astype(jnp.float32)


def is_qweight(x) -> bool:
    return isinstance(x, QWeight)


def quantize_rows(x, qtype):
    """``x [M, K]`` as a :class:`qwix.QArray` of integer ``qtype`` with one absmax scale per
    row: ``qwix.quantize(x, qtype, channelwise_axes=(0,), scale_dtype=float32)``, bit for bit
    (tested), with the row's max taken by :func:`jspec.invariant_ops.plain_max`. qwix's
    ``jnp.max`` goes to XLA:CPU's library fusion, which took the activation's producers
    (the SwiGLU before ``down``) along at some batch shapes only, and a token's int8 values
    moved with the block it was in."""
    bound = jnp.iinfo(qtype).max + 0.5           # qwix's symmetric bound for an integer type
    scale = plain_max(jnp.abs(x.astype(jnp.float32)), 1, keepdims=True) / bound
    scale = jnp.where(scale < jnp.sqrt(jnp.finfo(jnp.float32).tiny), 1.0, scale)
    info = jnp.iinfo(qtype)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), info.min, info.max).astype(qtype)
    return qwix.QArray(q, scale, None, qtype)


def quantized_linear(x, w: QWeight, precision=None):
    """``x [..., in]`` times ``w [out..., in]`` -> ``[..., out...]`` in ``x``'s dtype.

    The weight's output dims are contracted as they are (no reshape of the weight: a
    merged, sharded output axis would not be a tiled sharding). Each token's activation
    scale (``w8a8``) is its own absmax, so a row's result does not depend on what else is
    in the batch: a verify pass over N tokens gives each the logits of a 1-token step."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if w.in_scale is not None:
        x2 = (x2.astype(jnp.float32) * w.in_scale.astype(jnp.float32)).astype(x.dtype)
    lhs = x2 if w.act is None else quantize_rows(x2, jnp.dtype(w.act))
    dims = (((1,), (w.ndim - 1,)), ((), ()))
    if w.act is None and w.q.zero_point is None:
        # Weight-only (int8 per channel or per block, bf16): the few-row CPU kernel where
        # it applies (jspec.quant.product), the weight read as stored.
        y = cpu_rows(x2, w.q.qvalue, w.q.scale)
        if y is not None:
            return y.astype(x.dtype).reshape(lead + w.shape[:-1])
    if w.act is None and w.q.scale.shape[-1] == 1 and w.q.zero_point is None:
        # One scale per output channel: scale the product, not the weight. Dequantizing
        # the weight first is what XLA:GPU does not fuse into the matmul (it writes a bf16
        # copy of every layer weight to HBM and reads it back: an 8B plain step at batch 8
        # moved 45.2 GB against bf16's 24.2, `bench plan --topology h200 --quantize int8`).
        vals = w.q.qvalue.astype(jnp.float32 if x2.dtype == jnp.float32 else x2.dtype)
        y = jax.lax.dot_general(x2, vals, dims, precision=precision,
                                preferred_element_type=jnp.float32)
        return (y * w.q.scale[..., 0].astype(jnp.float32)).astype(x.dtype).reshape(
            lead + w.shape[:-1])
    if w.act is not None and w.q.scale.shape[-1] == 1:
        y = cpu_w8a8(lhs, w.q)                   # the VNNI kernel where it applies
        if y is not None:
            return y.astype(x.dtype).reshape(lead + w.shape[:-1])
    if w.act is not None and w.q.scale.shape[-1] > 1:
        y = _tiled_integer_product(lhs, w.q)
    else:
        y = qwix.dot_general(lhs, w.q, dims, precision=precision)
    return y.astype(x.dtype).reshape(lead + w.shape[:-1])


def _tiled_integer_product(lhs: qwix.QArray, w: qwix.QArray):
    """int8 rows ``[M, K]`` (one scale each) times int8 weights ``[out..., K]`` with one scale
    per tile of the inputs (a GGUF's blocks): each tile's product in int32 (exact), scaled,
    and the tiles summed in order by :func:`jspec.invariant_ops.plain_sum`. qwix sums the
    tiles with a float reduce whose order moved with M on XLA:CPU, which is what W8A8's
    exactness under speculation cannot have (:mod:`jspec.invariant_attention`)."""
    M, K = lhs.qvalue.shape
    nt = w.scale.shape[-1]
    out = w.qvalue.shape[:-1]
    xq = lhs.qvalue.reshape(M, nt, K // nt)
    wq = w.qvalue.reshape(out + (nt, K // nt))
    n = len(out)
    part = jax.lax.dot_general(xq, wq, (((2,), (n + 1,)), ((1,), (n,))),
                               preferred_element_type=jnp.int32)           # [nt, M, out...]
    ws = jnp.moveaxis(w.scale.astype(jnp.float32), -1, 0)[:, None]          # [nt, 1, out...]
    xs = lhs.scale.astype(jnp.float32).reshape((1, M) + (1,) * n)
    return plain_sum(part.astype(jnp.float32) * ws, 0) * xs[0]
