"""The target's serving layout: :func:`pack_params` turns the checkpoint layout into it
once, at load time, and :func:`linear` multiplies by its weights.

The layer stack stacked on a leading axis where the forward scans it
(the compiled graph and compile time do not grow with depth), q/k/v fused into one
kernel and gate/up into another (one matmul each). q/k/v are grouped by KV head,
``[KVH, G + 2, D, H]`` (that KV head's G query heads, then its key, then its value), so
sharding the KV-head axis over a mesh keeps each head's q, k and v together.

Every projection is stored output-major, ``[out..., in]`` (PyTorch's ``Linear`` layout,
the transpose of the checkpoints' Flax kernels). On TPU and GPU either order is native to
the matmul units; on XLA:CPU it decides the speed of the verify pass: Eigen multiplies a
few tokens by an ``[out, in]`` matrix into an ``[out, tokens]`` result about 3x faster than
into ``[tokens, out]`` (measured here, 768 x 24576 fp32: 8 tokens 5.1 ms vs 16.8 ms; one
token 3-4 ms either way). See :func:`linear`.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from jax.sharding import NamedSharding

from jspec.config import LlamaConfig
from jspec.platform import target_platform
from jspec.quant.product import cpu_rows
from jspec.quant.qweight import is_qweight, quantized_linear
from jspec.sharding import logical_spec


def is_packed(params) -> bool:
    return "layers" in params


def is_stacked(packed) -> bool:
    """Stacked (one array per kind, a leading layer axis, scanned) or per-layer (unrolled)."""
    return isinstance(packed["layers"], dict)


STACKED_ENV = "JSPEC_STACKED_LAYERS"


def default_stacked() -> bool:
    """Scan the layer stack on TPU only. XLA:CPU copies a scanned layer's weight slice
    before each matmul (it cannot read a dynamic slice in place), which made a 100M-parameter
    decode step 2.4x slower (80 ms vs 33 ms, measured here). XLA:GPU does the same (its
    gemm fusions take no dynamic slice): compiled for an H200 (deviceless), an 8B bf16 plain
    step at batch 8 and 8k context moved 52.1 GB scanned against 24.2 GB unrolled, its
    weights and KV (``bench anatomy --topology h200 --layout scan|per-layer``), for 1.9 s
    against 6.8 s of compile. On TPU the slice is read in place, and the scan keeps the
    compiled graph and compile time independent of depth.

    ``JSPEC_STACKED_LAYERS=1`` (or ``0``) overrides the backend's choice. The test suite sets
    it: its tiny models run in no time either way, and the scan compiles faster (a stories260K
    EAGLE-3 generate: 7.2 s -> 5.8 s here)."""
    env = os.environ.get(STACKED_ENV, "").strip().lower()
    if env:
        if env not in ("0", "1", "true", "false"):
            raise ValueError(f"{STACKED_ENV}={env!r}: expected 1 or 0")
        return env in ("1", "true")
    return target_platform() == "tpu"


def fold_scale(w, scale):
    """An output-major weight ``[out..., in]`` times the RMSNorm scale ``[in]`` that feeds it,
    as one rounding of the fp32 product: ``(norm(x) * scale) @ W == norm(x) @ (scale * W)``.
    A scanned layer's norm scales were two kernels of its body on TPU (XLA slices a stacked
    ``[L, H]`` scale in a kernel of its own and will not fuse it into the projection).
    Plain and speculative decoding run the same folded weights; against the checkpoint's
    own arithmetic it differs by one rounding of the weight (bf16: about 2^-9 relative)."""
    return (w.astype(jnp.float32) * scale.astype(jnp.float32)).astype(w.dtype)


def pack_params(cfg: LlamaConfig, params, stacked: bool | None = None) -> dict:
    """Checkpoint layout (``layers_{i}.self_attn.q_proj`` ...) -> packed layout.

    ``stacked`` (default :func:`default_stacked`): ``layers`` is one dict of ``[L, ...]``
    arrays (the forward scans it) or a tuple of per-layer dicts (unrolled). Packed params
    are returned as they are when ``stacked`` is None, else converted to the asked layout.
    """
    if is_packed(params):
        if stacked is None or stacked == is_stacked(params):
            return params
        layers = params["layers"]
        if stacked:
            layers = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
        else:
            layers = tuple(jax.tree_util.tree_map(lambda x: x[i], layers)
                           for i in range(cfg.num_layers))
        return {**params, "layers": layers}
    stacked = default_stacked() if stacked is None else stacked
    c = cfg
    H, KVH, D = c.hidden_size, c.num_kv_heads, c.head_dim
    G = c.num_heads // KVH

    def layer(lp):
        a, m = lp["self_attn"], lp["mlp"]
        qkv = jnp.concatenate([a["q_proj"]["kernel"].reshape(H, KVH, G, D),
                               a["k_proj"]["kernel"].reshape(H, KVH, 1, D),
                               a["v_proj"]["kernel"].reshape(H, KVH, 1, D)], axis=2)
        gate_up = jnp.stack([m["gate_proj"]["kernel"].T, m["up_proj"]["kernel"].T])
        return {
            "qkv": fold_scale(jnp.moveaxis(qkv, 0, -1),                        # [KVH, G+2, D, H]
                              lp["input_layernorm"]["scale"]),
            "o": a["o_proj"]["kernel"].T,                                      # [H, Hq*D]
            "gate_up": fold_scale(gate_up, lp["post_attention_layernorm"]["scale"]),  # [2, I, H]
            "down": m["down_proj"]["kernel"].T,                                # [H, I]
        }

    layers = tuple(layer(params[f"layers_{i}"]) for i in range(c.num_layers))
    if stacked:
        layers = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
    packed = {"embed": params["embed_tokens"]["embedding"], "norm": params["norm"]["scale"],
              "layers": layers}
    if not c.tie_word_embeddings:
        packed["lm_head"] = params["lm_head"]["kernel"].T                     # [V, H]
    return packed


# Logical axis names of the packed (stacked) leaves (see jspec.sharding.LOGICAL_RULES);
# per-layer leaves drop the leading "layers".
PACKED_AXES = {
    "embed": ("vocab", "embed"),
    "norm": ("norm",),
    "lm_head": ("vocab", "embed"),
    "layers": {
        "qkv": ("layers", "kv_heads", None, None, "embed"),
        "o": ("layers", "embed", "heads"),
        "gate_up": ("layers", None, "mlp", "embed"),
        "down": ("layers", "embed", "mlp"),
    },
}


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def packed_param_shardings(mesh, packed_shapes):
    """NamedShardings for the packed layout (:data:`PACKED_AXES`)."""
    from jspec.quant.pack import qweight_shardings

    axes = {k: v for k, v in PACKED_AXES.items() if k in packed_shapes}
    if isinstance(packed_shapes["layers"], (list, tuple)):       # per-layer weights
        one = {k: v[1:] for k, v in PACKED_AXES["layers"].items()}
        axes["layers"] = tuple(one for _ in packed_shapes["layers"])

    def place(names, s):
        if is_qweight(s):
            return qweight_shardings(mesh, names, s)
        return NamedSharding(mesh, logical_spec(names, s.shape, mesh))
    return jax.tree_util.tree_map(place, axes, packed_shapes, is_leaf=_is_axes)


def pack_for_serving(cfg, params):
    """Pack checkpoint-layout params once (jitted); on the same mesh when they are sharded."""
    if is_packed(params):
        return params
    pack = lambda p: pack_params(cfg, p)
    leaf = jax.tree_util.tree_leaves(params)[0]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        shapes = jax.eval_shape(pack, params)
        out = packed_param_shardings(sharding.mesh, shapes)
        return jax.jit(pack, out_shardings=out)(params)
    return jax.jit(pack)(params)


def precision_of(dtype) -> jax.lax.Precision | None:
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def precision(cfg: LlamaConfig):
    return precision_of(cfg.dtype)


def linear(x, w, precision=None):
    """``x [..., in]`` times an output-major weight ``w [out..., in]`` -> ``[..., out...]``.

    On CPU the product is formed as ``[out..., tokens]`` (the fast Eigen path for a few
    tokens, see the packed layout's note) behind an optimization barrier, then transposed:
    without the barrier XLA folds the transpose back into the dot and picks the slow
    ``[tokens, out]`` product again. One token (a matrix-vector product, as fast either way),
    more than :data:`CPU_FEW_TOKENS` tokens, and other backends: one plain contraction (the
    barrier and transpose only add kernels; measured: they made the 3.4M-parameter default
    model's plain decode step 2x slower). A quantized weight (:mod:`jspec.quant`) takes
    qwix's product instead.

    First of all, on one CPU device and for at most 64 token rows, the few-row CPU kernel
    takes the product where it applies (:func:`jspec.quant.product.cpu_rows`: the weight read
    once, as stored, for every row; a row's result independent of the others); the forms
    below are what remains: other backends, prefill-sized blocks, and CPUs without it."""
    if is_qweight(w):
        return quantized_linear(x, w, precision)
    y = cpu_rows(x, w)                      # the few-row CPU kernel, where it applies
    if y is not None:
        return y
    lead, k = x.shape[:-1], x.shape[-1]
    out = w.shape[:-1]
    m = math.prod(lead)
    if target_platform() != "cpu":
        # The weight's output dims stay separate (no reshape of w): merging [2, I] of a
        # gate/up pair sharded over I is not a tiled sharding, and the SPMD partitioner
        # all-gathered the whole weight for it (an 8B MLP's 458 MB per layer per verify,
        # `jspec.bench plan`). CPU keeps the reshaped forms below: the batch-1 plain step
        # measured 1.3-1.5x slower on the shipped model with this one.
        return jnp.einsum("mk,...k->m...", x.reshape(-1, k), w,
                          precision=precision).reshape(lead + out)
    if m == 1 or m > CPU_FEW_TOKENS:
        return jnp.einsum("mk,nk->mn", x.reshape(-1, k), w.reshape(-1, k),
                          precision=precision).reshape(lead + out)
    x = x.reshape(-1, k)
    pad = -m % CPU_TOKEN_MULTIPLE if m > CPU_TOKEN_MULTIPLE else 0
    y = jnp.einsum("nk,mk->nm", w.reshape(-1, k), jnp.pad(x, ((0, pad), (0, 0))),
                   precision=precision)
    return jax.lax.optimization_barrier(y).T[:m].reshape(lead + out)


# Past this many tokens (a prefill, a training batch) Eigen's product is a well-shaped GEMM
# either way, and the barrier only blocks fusion: a 16-layer, 6.7M-parameter training step
# (16 x 256 tokens) took 7.39 s through the few-token form and 6.58 s as one contraction.
CPU_FEW_TOKENS = 64

# Eigen's few-token product is fastest at a multiple of 4 tokens (measured: 5, 6 and 7 tokens
# cost more than 8); blocks past 4 tokens are zero-padded up to one. One token stays a
# matrix-vector product.
CPU_TOKEN_MULTIPLE = 4
