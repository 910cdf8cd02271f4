"""The Llama decoder layer as Flax modules, in the checkpoints' (HF) parameter layout:
what creates the target's parameters (:class:`jspec.llama.Llama`) and what drafters with a
decoder block run as is. The target itself runs :func:`jspec.llama.forward` over the packed
layout (:mod:`jspec.serving_layout`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec import kv_cache as kvc
from jspec.attention import windowed_attention_ref
from jspec.config import LlamaConfig
from jspec.invariant_ops import plain_sum
from jspec.platform import target_platform
from jspec.rope import apply_rope, rope_inv_freq
from jspec.serving_layout import linear, precision_of


def sum_square(x):
    xf = x.astype(jnp.float32)
    if target_platform() == "cpu":
        # XLA's own loop, not the YNN library fusion a plain reduce goes to on XLA:CPU: that
        # fusion takes neighbouring ops along at some batch shapes and not at others, so a
        # token's norm moved in the last bit with the block it was in (jspec.invariant_ops).
        return plain_sum(xf * xf, -1, keepdims=True)
    return jnp.sum(xf * xf, axis=-1, keepdims=True)


def rms_norm(x, scale, eps: float, ss=None):
    """``ss``: :func:`sum_square` of ``x`` when the caller has it (a scanned stack computes
    the next layer's in the kernel of the residual add that makes ``x``). Sum, then divide,
    as ``jnp.mean``: the same values either way. ``scale=None``: the scale was folded into
    the weight the result feeds (:func:`jspec.serving_layout.fold_scale`)."""
    xf = x.astype(jnp.float32)
    ss = sum_square(x) if ss is None else ss
    xf = xf * jax.lax.rsqrt(ss / jnp.float32(x.shape[-1]) + eps)
    return xf.astype(x.dtype) if scale is None else scale * xf.astype(x.dtype)



class Linear(nn.Module):
    """``nn.Dense`` with the same parameters (name, initialiser, logical axes), plus an
    output-major form: with ``out_major`` the kernel is held ``[out, in]`` (the transpose of
    the checkpoint's ``[in, out]``; see :func:`out_major_params`) and multiplied by
    :func:`linear`, the product XLA:CPU runs fast for a few tokens."""
    features: int
    axes: tuple
    dtype: str = "float32"
    use_bias: bool = False
    out_major: bool = False

    @nn.compact
    def __call__(self, x):
        dt = jnp.dtype(self.dtype)
        shape, axes = (x.shape[-1], self.features), self.axes
        if self.out_major:
            shape, axes = shape[::-1], axes[::-1]
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                                   axes), shape, dt)
        prec = precision_of(self.dtype)
        x = x.astype(dt)
        y = linear(x, kernel.astype(dt), prec) if self.out_major else jnp.einsum(
            "...k,kn->...n", x, kernel.astype(dt), precision=prec)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), dt)
            y = y + bias.astype(dt)
        return y


def dense(features, axes, cfg: LlamaConfig, name, out_major: bool = False, use_bias=False):
    return Linear(features, axes, cfg.dtype, use_bias, out_major, name=name)


def out_major_params(params):
    """The output-major copy of a parameter tree made of :class:`Linear` layers: every 2-D
    ``kernel`` transposed, axis metadata dropped. Modules built with ``out_major=True`` read
    it; checkpoints keep the ``[in, out]`` layout."""
    def swap(path, x):
        return x.T if getattr(path[-1], "key", None) == "kernel" and x.ndim == 2 else x
    return jax.tree_util.tree_map_with_path(swap, nn.unbox(params))


class RMSNorm(nn.Module):
    dim: int
    eps: float
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (self.dim,), self.dtype)
        return rms_norm(x, scale, self.eps)


class Attention(nn.Module):
    cfg: LlamaConfig
    out_major: bool = False

    @nn.compact
    def __call__(self, x, positions, cache, layer, block_mask, valid, attention_fn, offset=0):
        c = self.cfg
        B, T, _ = x.shape
        om = self.out_major
        q = dense(c.num_heads * c.head_dim, ("embed", "heads"), c, "q_proj", om)(x)
        k = dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), c, "k_proj", om)(x)
        v = dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), c, "v_proj", om)(x)
        inv = rope_inv_freq(c.rope, c.head_dim)
        q = apply_rope(q.reshape(B, T, c.num_heads, c.head_dim), positions, inv)
        k = apply_rope(k.reshape(B, T, c.num_kv_heads, c.head_dim), positions, inv)
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim)
        if isinstance(cache, kvc.WindowedCache):      # a drafter's tree loop
            cache = cache.write(layer, k, v, offset)
            # Kernels read the prefix from the pool (no gather); the reference gathers.
            o = getattr(attention_fn, "windowed", windowed_attention_ref)(q, cache, layer,
                                                                          block_mask)
        else:
            cache = kvc.write_layer(cache, layer, k, v, valid, offset)
            o = attention_fn(q, cache, layer, block_mask)
        o = dense(c.hidden_size, ("heads", "embed"), c, "o_proj", om)(o.reshape(B, T, -1))
        return o, cache


class MLP(nn.Module):
    cfg: LlamaConfig
    out_major: bool = False

    @nn.compact
    def __call__(self, x):
        c, om = self.cfg, self.out_major
        g = dense(c.intermediate_size, ("embed", "mlp"), c, "gate_proj", om)(x)
        u = dense(c.intermediate_size, ("embed", "mlp"), c, "up_proj", om)(x)
        return dense(c.hidden_size, ("mlp", "embed"), c, "down_proj", om)(nn.silu(g) * u)


class DecoderLayer(nn.Module):
    """A decoder layer as a Flax module, in the checkpoints' (HF) parameter layout.

    Drafters with a decoder block (MTP) run it as is; the target only uses it to create
    its parameters, and runs :func:`decoder_layer` over the packed layout.
    """
    cfg: LlamaConfig
    out_major: bool = False

    @nn.compact
    def __call__(self, x, positions, cache, layer, block_mask, valid, attention_fn, offset=0):
        c = self.cfg
        h, cache = Attention(c, self.out_major, name="self_attn")(
            RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, name="input_layernorm")(x),
            positions, cache, layer, block_mask, valid, attention_fn, offset)
        x = x + h
        x = x + MLP(c, self.out_major, name="mlp")(
            RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(x))
        return x, cache
