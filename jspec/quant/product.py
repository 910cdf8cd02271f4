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
L1, so a verify block of a few tokens costs about what a one-token step costs, and a weight
stored in fewer bytes is read in fewer bytes.

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
- the weight is float32, bfloat16, or int8 weight-only with one scale per output channel
  or per block of a multiple of 16 inputs (a GGUF's Q8_0/Q4_0 blocks, ``tile=32``); fp8 and
  W8A8 keep XLA's product.
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

# Past this many rows (a prefill, a training batch) the product is compute-bound, and
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
    executables.clear_all()
    token = _xla_only.set(True)
    try:
        yield
    finally:
        _xla_only.reset(token)
        executables.clear_all()


def _applies(m: int) -> bool:
    return (0 < m <= KERNEL_MAX_ROWS and not _xla_only.get() and target_platform() == "cpu"
            and jax.device_count() == 1 and _kernels() is not None)


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
    kern = _kernels()
    n = math.prod(out)
    s2 = None if scale is None else scale.reshape(n, scale.shape[-1])
    if not kern.supports(w.dtype, k, None if s2 is None else s2.shape):
        return None
    x2, w2 = x.reshape(m, k), w.reshape(n, k)
    y = _float_rows(x2, w2) if s2 is None else kern.rows_product(x2, w2, s2)
    return y.astype(x.dtype).reshape(lead + out)
