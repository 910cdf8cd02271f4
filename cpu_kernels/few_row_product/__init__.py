"""The few-row weight product on XLA:CPU: ``y[M, N] = x[M, K] . W[N, K]^T`` as an XLA FFI
custom call (``product.cc``), for float32, bfloat16 and int8 weights (int8 with one scale per
output row or per block of 16k inputs), and W8A8 (int8 activations with one scale per row
times int8 weights with one scale per output row, on AVX-512 VNNI); their jnp references
(``reference.py``).

The shared library is built when jspec is installed (``setup.py``); :func:`available` is False
where it was not built, could not be loaded, or the CPU lacks AVX-512 (F, BW, VL), and callers
then use XLA's own product (:mod:`jspec.quant.product` makes that choice).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import jax
import jax.numpy as jnp

from cpu_kernels.few_row_product.reference import rows_product_ref, w8a8_product_ref

__all__ = ["available", "available_w8a8", "rows_product", "rows_product_ref", "library_path",
           "supports", "w8a8_product", "w8a8_product_ref"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGETS = {"float32": "jspec_rows_f32", "bfloat16": "jspec_rows_bf16", "int8": "jspec_rows_i8"}
_W8A8 = "jspec_rows_i8i8"
# JSPEC_CPU_KERNELS=0 turns the kernels off (XLA's products everywhere): for A/B timing and
# as an escape hatch.
ENV = "JSPEC_CPU_KERNELS"


def library_path() -> str | None:
    """The built shared library: ``_product*.so`` beside this file (the build names it with
    Python's extension suffix)."""
    found = sorted(glob.glob(os.path.join(_HERE, "_product*.so")))
    return found[0] if found else None


@functools.cache
def _load() -> tuple[str | None, bool]:
    """Loads and registers the kernels once: (why they are unavailable, or None when ready;
    whether the W8A8 kernel is registered too, the CPU having VNNI)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off"):
        return f"{ENV}=0", False
    path = library_path()
    if path is None:
        return "not built (reinstall jspec with a C++ compiler present)", False
    try:
        lib = ctypes.cdll.LoadLibrary(path)
    except OSError as e:
        return f"could not load {path}: {e}", False
    try:
        if not lib.jspec_rows_supported():
            return "this CPU lacks AVX-512 F/BW/VL", False
        symbols = {t: getattr(lib, t) for t in (*_TARGETS.values(), _W8A8)}
        vnni = bool(lib.jspec_rows_vnni_supported())
    except AttributeError as e:            # a library built from an older product.cc
        return f"{path} is stale ({e}): reinstall jspec", False
    for target, fn in symbols.items():
        if target != _W8A8 or vnni:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="cpu")
    return None, vnni


def available() -> bool:
    return _load()[0] is None


def unavailable_reason() -> str | None:
    return _load()[0]


def available_w8a8() -> bool:
    """The W8A8 kernel too (AVX-512 VNNI)."""
    return _load()[1]


def supports(w_dtype, k: int, scale_shape=None) -> bool:
    """Whether the kernel takes a weight of this dtype (and int8 scales of this shape)."""
    name = jnp.dtype(w_dtype).name
    if name not in _TARGETS or (name == "int8") != (scale_shape is not None):
        return False
    if scale_shape is not None:
        nb = scale_shape[-1]
        return nb >= 1 and k % nb == 0 and (nb == 1 or (k // nb) % 16 == 0)
    return True


def rows_product(x, w, scale=None):
    """``x [M, K]`` times ``w [N, K]`` -> ``[M, N]`` float32 through the kernel (the caller
    checks :func:`available` and :func:`supports`). ``x`` is read as float32; ``scale`` (int8
    weights only) as float32 ``[N, 1]`` or ``[N, K / B]``."""
    why = unavailable_reason()
    if why is not None:
        raise RuntimeError(f"the few-row CPU product is unavailable: {why}")
    M, K = x.shape
    N = w.shape[0]
    args = [x.astype(jnp.float32), w]
    if scale is not None:
        args.append(scale.astype(jnp.float32))
    call = jax.ffi.ffi_call(_TARGETS[jnp.dtype(w.dtype).name],
                            jax.ShapeDtypeStruct((M, N), jnp.float32),
                            vmap_method="sequential")
    return call(*args)


def w8a8_product(xq, xscale, wq, wscale):
    """int8 ``xq [M, K]`` (one float32 scale a row, ``xscale [M, 1]``) times int8 ``wq [N, K]``
    (``wscale [N, 1]``) -> ``[M, N]`` float32: the int32 sum, then ``(sum * xscale) * wscale``
    (the caller checks :func:`available_w8a8`)."""
    if not available_w8a8():
        raise RuntimeError("the W8A8 CPU product is unavailable: "
                           f"{unavailable_reason() or 'this CPU lacks AVX-512 VNNI'}")
    M, N = xq.shape[0], wq.shape[0]
    call = jax.ffi.ffi_call(_W8A8, jax.ShapeDtypeStruct((M, N), jnp.float32),
                            vmap_method="sequential")
    return call(xq, xscale.astype(jnp.float32).reshape(M, 1), wq,
                wscale.astype(jnp.float32).reshape(N, 1))
