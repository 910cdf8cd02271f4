"""Quantizing a target's packed (serving) parameters: the layer stack's projections become
:class:`~jspec.quant.qweight.QWeight` s; the embedding, the norms and (unless asked) the LM
head stay in float. Runs once, jitted, at load or conversion, on the mesh the weights are on."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import qwix
from jax.sharding import NamedSharding

from jspec.config import LlamaConfig
from jspec.quant.config import QuantConfig, as_quant_config, check_tile
from jspec.quant.qweight import QWeight, is_qweight
from jspec.sharding import logical_spec

# The packed layer weights every token's product goes through (jspec.serving_layout).
LAYER_WEIGHTS = ("qkv", "o", "gate_up", "down")


def qtype_of(mode: str):
    return jnp.float8_e4m3fn if mode == "fp8" else jnp.int8


def quantize_weight(w, qc: QuantConfig, scale_dtype, in_scale=None) -> QWeight:
    """An output-major float weight ``[..., out..., in]`` -> a :class:`QWeight` with one
    scale per output channel (and per ``qc.tile`` inputs when tiled). Scales are held in
    the model's compute dtype: a weight-only product then dequantizes straight into it."""
    check_tile(qc, w.shape[-1], f"a weight of shape {tuple(w.shape)}")
    if qc.mode == "bf16":
        # Rounded to bf16, scales of one (the per-channel product's shape, exact).
        ones = jnp.ones(w.shape[:-1] + (1,), scale_dtype)
        return QWeight(qwix.QArray(w.astype(jnp.bfloat16), ones, None, jnp.bfloat16), in_scale)
    tiled = {w.ndim - 1: qc.tile} if qc.tile else None
    q = qwix.quantize(w.astype(jnp.float32), qtype_of(qc.mode),
                      channelwise_axes=tuple(range(w.ndim - 1)), tiled_axes=tiled,
                      scale_dtype=jnp.float32)
    q = dataclasses.replace(q, scale=q.scale.astype(scale_dtype))
    return QWeight(q, in_scale, "int8" if qc.activations else None)


def quantize_packed(cfg: LlamaConfig, packed, quantize) -> dict:
    """Packed params with the layer projections (and with ``lm_head=True`` the LM head)
    quantized. Weights already quantized (a GGUF's own blocks) are kept as they are."""
    qc = as_quant_config(quantize)
    dt = jnp.dtype(cfg.dtype)

    def one(lp):
        return {k: quantize_weight(v, qc, dt) if k in LAYER_WEIGHTS and not is_qweight(v) else v
                for k, v in lp.items()}

    layers = packed["layers"]
    out = {**packed, "layers": one(layers) if isinstance(layers, dict)
           else tuple(one(lp) for lp in layers)}
    if qc.lm_head and not is_qweight(packed.get("lm_head")):
        # A tied head gets a quantized copy; the float table still serves the embedding
        # lookup (jspec.llama.logits reads "lm_head" when there is one).
        out["lm_head"] = quantize_weight(packed.get("lm_head", packed["embed"]), qc, dt)
    return out


def is_quantized(packed) -> bool:
    return any(is_qweight(x) for x in jax.tree_util.tree_leaves(packed, is_leaf=is_qweight))


def quantizes_activations(params) -> bool:
    """Whether any weight of ``params`` rounds its input to a quantized type (``w8a8``):
    such a target runs a batch-invariant forward (:mod:`jspec.invariant_attention`)."""
    return any(is_qweight(x) and x.act is not None
               for x in jax.tree_util.tree_leaves(params, is_leaf=is_qweight))


def mode_of(params) -> str | None:
    """The quantization mode of a parameter tree (None: float)."""
    for x in jax.tree_util.tree_leaves(params, is_leaf=is_qweight):
        if is_qweight(x):
            if x.act is not None:
                return "w8a8"
            return {"float8_e4m3fn": "fp8", "bfloat16": "bf16"}.get(
                jnp.dtype(x.q.qvalue.dtype).name, "int8")
    return None


def qweight_shardings(mesh, names, w: QWeight) -> QWeight:
    """Each part of a quantized weight placed as its weight is: values and scales on the
    weight's logical axes (a scale axis of size 1, or one the mesh does not divide, is
    replicated by :func:`jspec.sharding.logical_spec`), ``in_scale`` on the input axis."""
    def place(x):
        n = names if x.ndim == len(names) else names[:x.ndim - 1] + names[-1:]
        return NamedSharding(mesh, logical_spec(n, x.shape, mesh))
    return jax.tree_util.tree_map(place, w)
