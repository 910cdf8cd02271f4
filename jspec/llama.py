"""Llama-3 target: parameters in the checkpoints' layout, one forward over a packed layout.

One forward (:func:`forward`) handles prefill, plain decode and tree verification: it takes
a block of ``T`` new tokens per row with explicit RoPE positions, writes their KV
into the paged cache after each row's committed length, attends with a block mask
(causal by default), and returns the final post-norm hidden state plus, on request,
the residual streams *entering* chosen layers (``aux_layers``; EAGLE-3 reads
{2, L//2, L-3}). Index ``i`` of ``aux_layers`` means "input of layer i", which is HF
``output_hidden_states[i]``. Logits are a separate method so prefill can project
only the positions it needs.

Checkpoint-layout parameter names mirror Hugging Face (``layers_{i}.self_attn.q_proj``
...); kernels are stored ``[in, out]``; every parameter carries logical axis names for
sharding (see :mod:`jspec.sharding`). :func:`pack_params` turns that tree into the
serving layout once, at load time: q/k/v and gate/up fused, the layers stacked and
scanned on TPU/GPU (per-layer on CPU, see :func:`default_stacked`), so a layer is a
handful of kernels and checkpoint formats stay as they are.
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec import kv_cache as kvc
from jspec.attention import paged_attention_ref, windowed_attention_ref
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
        return rms_norm(x, scale, self.eps)


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
        if isinstance(cache, kvc.WindowedCache):      # a drafter's tree loop
            cache = cache.write(layer, k, v, offset)
            o = windowed_attention_ref(q, cache, layer, block_mask)
        else:
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
    """A decoder layer as a Flax module, in the checkpoints' (HF) parameter layout.

    Drafters with a decoder block (MTP) run it as is; the target only uses it to create
    its parameters, and runs :func:`decoder_layer` over the packed layout.
    """
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
    """The target's parameters in the checkpoints' layout, and a forward over them.

    ``apply`` packs the parameters (:func:`pack_params`) and runs :func:`forward`, so
    training and tests that hold checkpoint-layout trees see the one forward the
    decoders compile; the decoders take packed parameters directly (packed once, at
    load time: :attr:`jspec.target.Target.serving_params`).
    """
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

    def _create_params(self):
        c = self.cfg
        x = jnp.zeros((1, 1, c.hidden_size), c.dtype)
        tok = jnp.zeros((1, 1), jnp.int32)
        cache = kvc.init_cache(1, c.num_kv_heads, c.head_dim, tok, 1, 8, c.dtype)
        self.embed_tokens(tok)
        for layer in self.layers:
            layer(x, tok, cache, 0, None, None, paged_attention_ref)
        self.norm(x)
        if not self.cfg.tie_word_embeddings:
            self.lm_head(x)

    def packed(self):
        if self.is_initializing():
            self._create_params()
        return pack_params(self.cfg, nn.unbox(self.variables["params"]))

    def __call__(self, tokens, positions, cache, block_mask=None, valid=None,
                 aux_layers: Sequence[int] = (), attention_fn: AttentionFn = paged_attention_ref):
        """Returns ``(hidden [B,T,H] post-norm, aux tuple of [B,T,H], new cache)``; see
        :func:`forward`."""
        return forward(self.cfg, self.packed(), tokens, positions, cache, block_mask, valid,
                       aux_layers, attention_fn)

    def logits(self, hidden):
        """fp32 logits from post-norm hidden states."""
        return logits(self.cfg, self.packed(), hidden)

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def forward_logits(self, tokens, positions, cache):
        """Forward plus logits in one call; ``init`` uses it so every parameter gets created."""
        hidden, _, cache = self(tokens, positions, cache)
        return self.logits(hidden), cache


# ------------------------------------------------------------------ packed layout
# The serving layout: the layer stack stacked on a leading axis where the forward scans it
# (the compiled graph and compile time do not grow with depth), q/k/v fused into one
# kernel and gate/up into another (one matmul each). q/k/v are grouped by KV head,
# ``[H, KVH, G + 2, D]`` (that KV head's G query heads, then its key, then its value), so
# sharding the KV-head axis over a mesh keeps each head's q, k and v together.

def is_packed(params) -> bool:
    return "layers" in params


def is_stacked(packed) -> bool:
    """Stacked (one array per kind, a leading layer axis, scanned) or per-layer (unrolled)."""
    return isinstance(packed["layers"], dict)


def default_stacked() -> bool:
    """Scan the layer stack except on CPU. XLA:CPU copies a scanned layer's weight slice
    before each matmul (it cannot read a dynamic slice in place), which made a 100M-parameter
    decode step 2.4x slower (80 ms vs 33 ms, measured here); on TPU and GPU the slice is read
    in place and the scan keeps the compiled graph and compile time independent of depth."""
    return jax.default_backend() != "cpu"


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
        return {
            "ln1": lp["input_layernorm"]["scale"],
            "qkv": jnp.concatenate([a["q_proj"]["kernel"].reshape(H, KVH, G, D),
                                    a["k_proj"]["kernel"].reshape(H, KVH, 1, D),
                                    a["v_proj"]["kernel"].reshape(H, KVH, 1, D)], axis=2),
            "o": a["o_proj"]["kernel"],
            "ln2": lp["post_attention_layernorm"]["scale"],
            "gate_up": jnp.stack([m["gate_proj"]["kernel"], m["up_proj"]["kernel"]], axis=1),
            "down": m["down_proj"]["kernel"],
        }

    layers = tuple(layer(params[f"layers_{i}"]) for i in range(c.num_layers))
    if stacked:
        layers = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
    packed = {"embed": params["embed_tokens"]["embedding"], "norm": params["norm"]["scale"],
              "layers": layers}
    if not c.tie_word_embeddings:
        packed["lm_head"] = params["lm_head"]["kernel"]
    return packed


# Logical axis names of the packed (stacked) leaves (see jspec.sharding.LOGICAL_RULES);
# per-layer leaves drop the leading "layers".
PACKED_AXES = {
    "embed": ("vocab", "embed"),
    "norm": ("norm",),
    "lm_head": ("embed", "vocab"),
    "layers": {
        "ln1": ("layers", "norm"),
        "qkv": ("layers", "embed", "kv_heads", None, None),
        "o": ("layers", "heads", "embed"),
        "ln2": ("layers", "norm"),
        "gate_up": ("layers", "embed", None, "mlp"),
        "down": ("layers", "mlp", "embed"),
    },
}


def _precision(cfg: LlamaConfig):
    return jax.lax.Precision.HIGHEST if cfg.dtype == "float32" else None


def rms_norm(x, scale, eps: float):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * xf.astype(x.dtype)


def decoder_layer(cfg: LlamaConfig, lp, x, positions, cache, layer, block_mask, valid,
                  attention_fn: AttentionFn):
    """One layer over packed parameters ``lp`` (one slice of ``packed["layers"]``)."""
    c = cfg
    B, T, _ = x.shape
    KVH, D = c.num_kv_heads, c.head_dim
    G = c.num_heads // KVH
    prec = _precision(c)
    dt = jnp.dtype(c.dtype)
    h = rms_norm(x, lp["ln1"], c.rms_norm_eps).astype(dt)
    qkv = jnp.einsum("bth,hkgd->btkgd", h, lp["qkv"].astype(dt), precision=prec)
    inv = rope_inv_freq(c.rope, D)
    q = apply_rope(qkv[:, :, :, :G].reshape(B, T, KVH * G, D), positions, inv)
    k = apply_rope(qkv[:, :, :, G], positions, inv)
    cache = kvc.write_layer(cache, layer, k, qkv[:, :, :, G + 1], valid)
    o = attention_fn(q, cache, layer, block_mask)
    x = x + jnp.einsum("bti,ih->bth", o.reshape(B, T, -1).astype(dt), lp["o"].astype(dt),
                       precision=prec)
    h = rms_norm(x, lp["ln2"], c.rms_norm_eps).astype(dt)
    gu = jnp.einsum("bth,hci->btci", h, lp["gate_up"].astype(dt), precision=prec)
    m = (jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]).astype(dt)
    return x + jnp.einsum("bti,ih->bth", m, lp["down"].astype(dt), precision=prec), cache


def forward(cfg: LlamaConfig, packed, tokens, positions, cache, block_mask=None, valid=None,
            aux_layers: Sequence[int] = (), attention_fn: AttentionFn = paged_attention_ref):
    """The target forward over packed parameters: one ``lax.scan`` over a stacked layer
    stack, a Python loop over per-layer weights (see :func:`pack_params`).

    ``tokens, positions: [B, T]``. Writes the block's KV after each row's committed length
    (masked by ``valid [B, T]``), attends with ``block_mask`` (causal when None).
    Returns ``(hidden [B,T,H] post-norm, aux tuple of [B,T,H], new cache)``; the cache's
    ``lengths`` are not advanced (the caller keeps what it accepts). ``aux_layers[j]``
    selects the residual stream *entering* that layer (HF ``output_hidden_states[i]``).
    """
    c = cfg
    L = c.num_layers
    x = jnp.take(packed["embed"], tokens, axis=0).astype(c.dtype)
    aux_layers = tuple(int(i) for i in aux_layers)
    A = len(aux_layers)
    if not is_stacked(packed):                       # per-layer weights: unrolled
        aux = {}
        for i, lp in enumerate(packed["layers"]):
            aux[i] = x
            x, cache = decoder_layer(c, lp, x, positions, cache, i, block_mask, valid,
                                     attention_fn)
        aux = tuple(aux[i] for i in aux_layers)
    else:
        take_aux = np.zeros((L, max(A, 1)), bool)   # [i, j]: aux slot j reads layer i's input
        for j, i in enumerate(aux_layers):
            take_aux[i, j] = True

        def body(carry, xs):
            x, cache, aux = carry
            lp, i, take = xs
            if A:   # a select into a small [A, B, T, H] buffer: no per-layer branching
                aux = jnp.where(take[:, None, None, None], x[None], aux)
            x, cache = decoder_layer(c, lp, x, positions, cache, i, block_mask, valid,
                                     attention_fn)
            return (x, cache, aux), None

        aux0 = jnp.zeros((A,) + x.shape, x.dtype)
        (x, cache, aux), _ = jax.lax.scan(
            body, (x, cache, aux0), (packed["layers"], jnp.arange(L, dtype=jnp.int32),
                                     jnp.asarray(take_aux)))
        aux = tuple(aux[j] for j in range(A))
    return rms_norm(x, packed["norm"], c.rms_norm_eps), aux, cache


def logits(cfg: LlamaConfig, packed, hidden):
    """fp32 logits from post-norm hidden states (the tied embedding or ``lm_head``)."""
    dt = jnp.dtype(cfg.dtype)
    if cfg.tie_word_embeddings:
        out = jnp.einsum("...h,vh->...v", hidden.astype(dt), packed["embed"].astype(dt),
                         precision=_precision(cfg))
    else:
        out = jnp.einsum("...h,hv->...v", hidden.astype(dt), packed["lm_head"].astype(dt),
                         precision=_precision(cfg))
    return out.astype(jnp.float32)


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
