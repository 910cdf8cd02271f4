"""Which product a weight is multiplied by on XLA:CPU: the one place that chooses.

:func:`jspec.serving_layout.linear` (float weights) and
:func:`jspec.quant.qweight.quantized_linear` (int8 weight-only) ask :func:`cpu_rows` first.
For a block of at most :data:`KERNEL_MAX_ROWS` token rows it returns the product of the
few-row CPU kernel (``cpu_kernels/few_row_product``, an XLA FFI custom call inside the
compiled program), else None and the caller builds XLA's product as before.

Why a kernel (``python -m jspec.bench products`` measures every form side by side): for one
row XLA:CPU emits its own matrix-vector loop, near memory speed; for 2-64 rows it calls
Eigen's GEMM, which streams the weight at about half that; and a bf16 or int8 weight is
converted to a float32 copy before either. The kernel reads each weight row once, in its
stored dtype, converts it in registers and multiplies it by every token row while it sits in
L1: a weight stored in fewer bytes is read in fewer bytes (14-20x XLA's rate for a bf16 or
int8 LM head), and 2-4 rows cost 1.0-1.6 one-row products on SmolLM2's shapes. From 8 rows
on, weight-only products are bound by the fp32 multiplies, W8A8's (VNNI) much less so.

Exactness by construction: the kernel computes every output by the same instructions
whatever the number of rows (16-lane partial sums over the inputs in order, a fixed
horizontal sum), so a verify row's product is bit-identical to its 1-token step's. Steps
(one row) take the kernel too, for that reason, not only verifies.

The kernel is used when all of these hold, and XLA's product otherwise:
- the program is built for the CPU (:func:`jspec.platform.target_platform`): TPU and GPU
  programs never see it, deviceless plans included;
- jax runs on one CPU device (a mesh of host devices, a test configuration, would have the
  partitioner gather a sharded weight whole for the custom call);
- the kernel was built at install and this CPU has AVX-512 (F, BW, VL);
  ``JSPEC_CPU_KERNELS=0`` turns it off;
- the weight is bfloat16, or int8 weight-only with one scale per output channel or per
  block of a multiple of 16 inputs (a GGUF's Q8_0/Q4_0 blocks, ``tile=32``). fp32 weights
  keep XLA's product (faster for one row, and a verify of 8 rows cost the same either way;
  the numbers are in :func:`cpu_rows`); fp8 keeps XLA's product too;
- W8A8 with one weight scale per output channel takes the kernel's VNNI product at any
  number of rows (:func:`cpu_w8a8`, bit for bit qwix's); W8A8 with tiled weight scales (a
  GGUF's blocks) keeps XLA's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp

from jspec import executables
from jspec.platform import target_platform

# Past this many rows (a prefill, a training batch) the product is bound by arithmetic, where
# Eigen's blocked GEMM beats a kernel that keeps a weight row in L1 for every token row.
KERNEL_MAX_ROWS = 64


@functools.cache
def _kernels():
    """The kernel module, or None where it cannot run (not built, no AVX-512, turned off)."""
    try:
        from cpu_kernels import few_row_product as k
    except ImportError:
        return None
    return k if k.available() else None


def kernel_status() -> str:
    """One line for reports: whether the few-row CPU kernel is in use, and if not why."""
    try:
        from cpu_kernels import few_row_product as k
    except ImportError as e:
        return f"XLA products (cpu_kernels not importable: {e})"
    why = k.unavailable_reason()
    return "few-row kernel (XLA FFI)" if why is None else f"XLA products ({why})"


_xla_only: contextvars.ContextVar[bool] = contextvars.ContextVar("jspec_xla_products",
                                                                 default=False)


@contextlib.contextmanager
def xla_products():
    """Trace with XLA's products only (the kernel off), as ``JSPEC_CPU_KERNELS=0`` does for a
    whole process: for timing both side by side in one run. Trace caches are cleared on entry
    and exit, as :func:`jspec.platform.building_for` does, so no program crosses over."""
    with executables.trace_setting(_xla_only, True):
        yield


def _on_cpu() -> bool:
    """Whether this trace may use the kernels at all (see the module doc)."""
    return (not _xla_only.get() and target_platform() == "cpu" and jax.device_count() == 1
            and _kernels() is not None)


def _applies(m: int) -> bool:
    return 0 < m <= KERNEL_MAX_ROWS and _on_cpu()


@jax.custom_vjp
def _float_rows(x2, w2):
    return _kernels().rows_product(x2, w2)


def _float_rows_fwd(x2, w2):
    return _float_rows(x2, w2), (x2, w2)


def _float_rows_bwd(res, g):
    # Gradients through XLA's products (a drafter trained through a few-token forward).
    x2, w2 = res
    hi = jax.lax.Precision.HIGHEST
    dx = jnp.einsum("mn,nk->mk", g, w2.astype(jnp.float32), precision=hi)
    dw = jnp.einsum("mn,mk->nk", g, x2.astype(jnp.float32), precision=hi)
    return dx.astype(x2.dtype), dw.astype(w2.dtype)


_float_rows.defvjp(_float_rows_fwd, _float_rows_bwd)


def cpu_rows(x, w, scale=None):
    """``x [..., in]`` times the output-major ``w [out..., in]`` -> ``[..., out...]`` in
    ``x``'s dtype through the kernel, or None where the kernel does not apply (see the
    module doc). ``scale``: an int8 weight's scales ``[out..., 1]`` (per output channel) or
    ``[out..., in / B]`` (per B inputs)."""
    lead, k = x.shape[:-1], x.shape[-1]
    out = w.shape[:-1]
    m = math.prod(lead)
    if not _applies(m):
        return None
    if jnp.dtype(w.dtype) == jnp.float32:
        # fp32 weights keep XLA's products: its one-row loop streamed SmolLM2's fp32 step at
        # 27.1 ms against the kernel's 35.5, and an 8-token verify cost 44 ms either way
        # (`bench verify-cost`, docs/performance.md). The kernel's gain is in reading a
        # weight as stored, which fp32 weights do not need.
        return None
    kern = _kernels()
    n = math.prod(out)
    s2 = None if scale is None else scale.reshape(n, scale.shape[-1])
    # A float weight with one scale per output (quantize="bf16": scales of one) is multiplied
    # as it is and the output scaled here.
    after = None
    if s2 is not None and s2.shape[-1] == 1 and jnp.issubdtype(w.dtype, jnp.floating):
        after, s2 = s2[:, 0].astype(jnp.float32), None
    if not kern.supports(w.dtype, k, None if s2 is None else s2.shape):
        return None
    x2, w2 = x.reshape(m, k), w.reshape(n, k)
    y = _float_rows(x2, w2) if s2 is None else kern.rows_product(x2, w2, s2)
    if after is not None:
        y = y * after
    return y.astype(x.dtype).reshape(lead + out)


def cpu_w8a8(lhs, w):
    """W8A8 per output channel through the kernel (AVX-512 VNNI): ``lhs`` the activations as
    a :class:`qwix.QArray` ``[M, K]`` (int8, one scale a row), ``w`` the weight's QArray
    ``[out..., K]`` (int8, one scale an output) -> ``[M, out...]`` float32, bit for bit what
    ``qwix.dot_general`` gives (the int32 sum is exact in any order, and the scales are
    applied in qwix's order), or None where it does not apply. Any number of rows: XLA's
    W8A8 product converts the int8 weight to int32 (four times its bytes) at every M."""
    if (not _on_cpu() or not _kernels().available_w8a8() or w.scale.shape[-1] != 1
            or w.zero_point is not None or lhs.zero_point is not None
            or jnp.dtype(w.qvalue.dtype) != jnp.int8 or jnp.dtype(lhs.qvalue.dtype) != jnp.int8):
        return None
    out = w.qvalue.shape[:-1]
    k = w.qvalue.shape[-1]
    n = math.prod(out)
    y = _kernels().w8a8_product(lhs.qvalue, lhs.scale, w.qvalue.reshape(n, k),
                                w.scale.reshape(n, 1))
    return y.reshape((lhs.qvalue.shape[0],) + out)
