"""Llama-3 target as Flax modules, used as pure functions through ``apply``.

One forward handles prefill, plain decode and (later) tree verification: it takes
a block of ``T`` new tokens per row with explicit RoPE positions, writes their KV
into the paged cache after each row's committed length, attends with a block mask
(causal by default), and returns the final post-norm hidden state plus, on request,
the residual streams *entering* chosen layers (``aux_layers``; EAGLE-3 reads
{2, L//2, L-3}). Index ``i`` of ``aux_layers`` means "input of layer i", which is HF
``output_hidden_states[i]``. Logits are a separate method so prefill can project
only the positions it needs.

Parameter names mirror Hugging Face (``layers_{i}.self_attn.q_proj`` ...); kernels are
stored ``[in, out]``. Every parameter carries logical axis names for sharding
(see :mod:`jspec.sharding`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec import kv_cache as kvc
from jspec.attention import paged_attention_ref
from jspec.config import LlamaConfig, RopeConfig

AttentionFn = Callable[..., jax.Array]


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies, computed in float32 exactly as transformers does."""
    inv = (1.0 / (np.float32(rope.theta) ** (np.arange(0, head_dim, 2, dtype=np.int64)
                                              .astype(np.float32) / np.float32(head_dim))))
    inv = inv.astype(np.float32)
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wl = old / rope.low_freq_factor
        high_wl = old / rope.high_freq_factor
        wavelen = (2 * np.pi / inv).astype(np.float32)
        scaled = np.where(wavelen > low_wl, inv / rope.factor, inv).astype(np.float32)
        smooth = ((old / wavelen - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / rope.factor + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. ``x: [B, T, H, D]``, ``positions: [B, T]``."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


def _dense(features, axes, cfg: LlamaConfig, name):
    return nn.Dense(
        features, use_bias=False, name=name, dtype=cfg.dtype, param_dtype=cfg.dtype,
        precision=jax.lax.Precision.HIGHEST if cfg.dtype == "float32" else None,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), axes))


class RMSNorm(nn.Module):
    dim: int
    eps: float
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (self.dim,), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale * xf.astype(x.dtype)


class Attention(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x, positions, cache, layer, block_mask, valid, attention_fn, offset=0):
        c = self.cfg
        B, T, _ = x.shape
        q = _dense(c.num_heads * c.head_dim, ("embed", "heads"), c, "q_proj")(x)
        k = _dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), c, "k_proj")(x)
        v = _dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), c, "v_proj")(x)
        inv = rope_inv_freq(c.rope, c.head_dim)
        q = apply_rope(q.reshape(B, T, c.num_heads, c.head_dim), positions, inv)
        k = apply_rope(k.reshape(B, T, c.num_kv_heads, c.head_dim), positions, inv)
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim)
        cache = kvc.write_layer(cache, layer, k, v, valid, offset)
        o = attention_fn(q, cache, layer, block_mask)
        o = _dense(c.hidden_size, ("heads", "embed"), c, "o_proj")(o.reshape(B, T, -1))
        return o, cache


class MLP(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        g = _dense(c.intermediate_size, ("embed", "mlp"), c, "gate_proj")(x)
        u = _dense(c.intermediate_size, ("embed", "mlp"), c, "up_proj")(x)
        return _dense(c.hidden_size, ("mlp", "embed"), c, "down_proj")(nn.silu(g) * u)


class DecoderLayer(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x, positions, cache, layer, block_mask, valid, attention_fn, offset=0):
        c = self.cfg
        h, cache = Attention(c, name="self_attn")(
            RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, name="input_layernorm")(x),
            positions, cache, layer, block_mask, valid, attention_fn, offset)
        x = x + h
        x = x + MLP(c, name="mlp")(
            RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(x))
        return x, cache


class Llama(nn.Module):
    cfg: LlamaConfig

    def setup(self):
        c = self.cfg
        self.embed_tokens = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                        ("vocab", "embed")))
        self.layers = [DecoderLayer(c, name=f"layers_{i}") for i in range(c.num_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = _dense(c.vocab_size, ("embed", "vocab"), c, "lm_head")

    def __call__(self, tokens, positions, cache, block_mask=None, valid=None,
                 aux_layers: Sequence[int] = (), attention_fn: AttentionFn = paged_attention_ref):
        """Returns ``(hidden [B,T,H] post-norm, aux tuple of [B,T,H], new cache)``.

        The cache's ``lengths`` are not advanced: the caller decides what to keep
        (``kv_cache.advance`` or ``kv_cache.commit``).
        """
        x = self.embed_tokens(tokens)
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux[i] = x
            x, cache = layer(x, positions, cache, i, block_mask, valid, attention_fn)
        return self.norm(x), tuple(aux[i] for i in aux_layers), cache

    def logits(self, hidden):
        """fp32 logits from post-norm hidden states."""
        if self.cfg.tie_word_embeddings:
            out = self.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def forward_logits(self, tokens, positions, cache):
        """Forward plus logits in one call; ``init`` uses it so an untied head gets created."""
        hidden, _, cache = self(tokens, positions, cache)
        return self.logits(hidden), cache


def init_params(cfg: LlamaConfig, key: jax.Array, unbox: bool = True):
    """Random parameters (for tests and benchmarks). ``unbox=False`` keeps axis metadata."""
    model = Llama(cfg)
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                           np.zeros((1, 1), np.int32), 1, 8, cfg.dtype)
    tok = jnp.zeros((1, 1), jnp.int32)
    variables = model.init(key, tok, tok, cache, method=Llama.forward_logits)
    params = variables["params"]
    return nn.unbox(params) if unbox else params


def abstract_params(cfg: LlamaConfig):
    """Shapes, dtypes and logical axes of the parameter tree, without allocating it."""
    return jax.eval_shape(lambda k: init_params(cfg, k, unbox=False), jax.random.key(0))
