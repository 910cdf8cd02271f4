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
from jspec.quant.pack import is_quantized, mode_of, quantize_packed, quantize_weight
from jspec.quant.qweight import QWeight, is_qweight, quantized_linear

__all__ = ["MODES", "QuantConfig", "QuantizeError", "QWeight", "as_quant_config", "is_quantized",
           "is_qweight", "mode_of", "place_packed", "warn_if_inexact", "quantize_packed", "quantize_target",
           "quantize_weight", "quantized_linear"]


def warn_if_inexact(qc: QuantConfig) -> None:
    """W8A8 rounds activations to int8, which amplifies the float rounding differences that
    attention has between two shapes (a verify block against a 1-token step, two cache sizes):
    its speculative output can differ from its own plain output (docs/quantization.md)."""
    if qc.activations:
        logging.getLogger("jspec").warning(
            "quantize=w8a8: activations are rounded to int8, so outputs can depend on batch "
            "and cache shapes, and speculative decoding is not token-exact against plain "
            "decoding of this target; int8 and fp8 (weight-only) are")


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
