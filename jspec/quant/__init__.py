"""Quantized targets (qwix): int8 weight-only, W8A8 and fp8 linear layers.

Quantization lives inside the one product every weight goes through
(:func:`jspec.serving_layout.linear` hands a :class:`QWeight` to
:func:`~jspec.quant.qweight.quantized_linear`); decoding, speculation, the engine and the
server run a quantized target as they run a float one. See docs/quantization.md.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
from jax.sharding import NamedSharding

from jspec.quant.config import MODES, QuantConfig, QuantizeError, as_quant_config
from jspec.quant.pack import (is_quantized, mode_of, quantize_packed, quantize_weight,
                              quantizes_activations)
from jspec.quant.qweight import QWeight, is_qweight, quantized_linear

__all__ = ["MODES", "QuantConfig", "QuantizeError", "QWeight", "as_quant_config", "is_quantized",
           "is_qweight", "mode_of", "place_packed", "warn_if_inexact", "quantize_packed", "quantize_target",
           "quantize_weight", "quantized_linear", "quantizes_activations"]


def warn_if_inexact(qc: QuantConfig) -> None:
    """W8A8 rounds activations to int8, so a float difference of one bit between two shapes
    (a verify block against a 1-token step) can move a token. The forward of such a target
    is batch-invariant (:mod:`jspec.invariant_attention`), measured bit for bit on XLA:CPU
    with an unrolled layer stack (jspec's CPU default); with a scanned stack XLA fused the
    stack's last ops differently from one program to the next, and TPU/GPU are unmeasured,
    so those say so (docs/quantization.md)."""
    from jspec.platform import target_platform
    from jspec.serving_layout import default_stacked

    if qc.activations and (target_platform() != "cpu" or default_stacked()):
        logging.getLogger("jspec").warning(
            "quantize=w8a8: speculative decoding is token-exact against plain decoding of a "
            "W8A8 target on CPU with an unrolled layer stack (jspec's CPU default); here "
            "(%s, %s layers) a token can differ where an activation sits on an int8 rounding "
            "step; int8 and fp8 (weight-only) are exact everywhere", target_platform(),
            "scanned" if default_stacked() else "unrolled")


def _mesh_of(params):
    sharding = getattr(jax.tree_util.tree_leaves(params)[0], "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def place_packed(cfg, packed, mesh=None):
    """Packed (possibly quantized) params put on ``mesh`` by their logical axes, or left
    where they are without one."""
    if mesh is None:
        return packed
    from jspec.serving_layout import packed_param_shardings
    return jax.device_put(packed, packed_param_shardings(mesh, packed))


def quantize_target(target, quantize):
    """``target`` with its packed serving params quantized (``quantize``: a mode name or a
    :class:`QuantConfig`; None returns it as it is). Runs once, jitted; on a mesh the
    quantized weights and their scales land sharded as the weights were. The float params
    are not kept."""
    qc = as_quant_config(quantize)
    if qc is None:
        return target
    warn_if_inexact(qc)
    from jspec.serving_layout import pack_params, packed_param_shardings

    cfg = target.config
    fn = lambda p: quantize_packed(cfg, pack_params(cfg, p), qc)
    mesh = _mesh_of(target.params)
    out = None if mesh is None else packed_param_shardings(mesh, jax.eval_shape(fn, target.params))
    params = jax.jit(fn, out_shardings=out)(target.params)
    return dataclasses.replace(target, params=params)
