"""A loaded target quantized (:mod:`jspec.quant`), placed on its mesh, with the warning W8A8
owes where it is not token-exact.

This sits in :mod:`jspec.checkpoint`, above both :mod:`jspec.quant` (the quantized product) and
:mod:`jspec.serving_layout` (the packed params that product reads), so neither of those has to
reach up to the other.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
from jax.sharding import NamedSharding

from jspec.platform import target_platform
from jspec.quant import QuantConfig, as_quant_config, quantize_packed
from jspec.serving_layout import default_stacked, pack_params, packed_param_shardings

__all__ = ["place_packed", "quantize_target", "warn_if_inexact"]


def warn_if_inexact(qc: QuantConfig) -> None:
    """W8A8 rounds activations to int8, so a float difference of one bit between two shapes
    (a verify block against a 1-token step) can move a token. On XLA:CPU with an unrolled
    layer stack (jspec's CPU default) a W8A8 target runs a batch-invariant forward
    (:mod:`jspec.invariant_attention`), and ``generate``, the serving engine and its prompt
    scoring compile with the options that keep it so inside a loop
    (:func:`jspec.invariant_attention.compiler_options`): token-exact there. A scanned stack
    fused differently from one program to the next, and TPU/GPU are unmeasured; the warning
    says where it is exact (docs/quantization.md)."""
    if not qc.activations:
        return
    where = ("it is here" if target_platform() == "cpu" and not default_stacked() else
             f"not here: {target_platform()}, "
             f"{'scanned' if default_stacked() else 'unrolled'} layers")
    logging.getLogger("jspec").warning(
        "quantize=w8a8: speculative decoding equals plain decoding of a W8A8 target only on "
        "CPU with an unrolled layer stack (%s): rounding activations to int8 turns a "
        "last-bit difference between a verify block and a 1-token step into another token "
        "now and then; int8 and fp8 (weight-only) are exact everywhere", where)


def _mesh_of(params):
    sharding = getattr(jax.tree_util.tree_leaves(params)[0], "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def place_packed(packed, mesh=None):
    """Packed (possibly quantized) params put on ``mesh`` by their logical axes, or left
    where they are without one."""
    if mesh is None:
        return packed
    return jax.device_put(packed, packed_param_shardings(mesh, packed))


def quantize_target(target, quantize):
    """``target`` with its packed serving params quantized (``quantize``: a mode name or a
    :class:`~jspec.quant.QuantConfig`; None returns it as it is). Runs once, jitted; on a
    mesh the quantized weights and their scales land sharded as the weights were. The float
    params are not kept."""
    qc = as_quant_config(quantize)
    if qc is None:
        return target
    warn_if_inexact(qc)
    cfg = target.config
    fn = lambda p: quantize_packed(cfg, pack_params(cfg, p), qc)
    mesh = _mesh_of(target.params)
    out = None if mesh is None else packed_param_shardings(mesh, jax.eval_shape(fn, target.params))
    params = jax.jit(fn, out_shardings=out)(target.params)
    return dataclasses.replace(target, params=params)
