"""Llama-3 target: parameters in the checkpoints' layout, one forward over a packed layout.

One forward (:func:`forward`) handles prefill, plain decode and tree verification: it takes
a block of ``T`` new tokens per row with explicit RoPE positions, writes their KV
into the paged cache after each row's committed length, attends with a block mask
(causal by default), and returns the final post-norm hidden state plus, on request,
the residual streams *entering* chosen layers (``aux_layers``; EAGLE-3 reads
{2, L//2, L-3}). Index ``i`` of ``aux_layers`` means "input of layer i", which is HF
``output_hidden_states[i]``. Logits are a separate method so prefill can project
only the positions it needs.

Checkpoint-layout parameter names (the layers: :mod:`jspec.layers`) mirror Hugging Face
(``layers_{i}.self_attn.q_proj`` ...); kernels are stored ``[in, out]``; every parameter
carries logical axis names for sharding (see :mod:`jspec.sharding`). :func:`pack_params`
turns that tree into the serving layout once, at load time: q/k/v and gate/up fused, the
layers stacked and scanned on TPU/GPU (per-layer on CPU, see :func:`default_stacked`), so a
layer is a handful of kernels and checkpoint formats stay as they are.
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec import kv_cache as kvc
from jspec.attention import paged_attention_ref
from jspec.attention import prepare as prepare_attention
from jspec.config import LlamaConfig
from jspec.invariant_attention import for_params as invariant_if_needed
# The layers in the checkpoints' layout are jspec.layers; they are this module's API too.
from jspec.layers import (MLP, Attention, DecoderLayer, Linear, RMSNorm, dense,  # noqa: F401
                          out_major_params, rms_norm, sum_square)
from jspec.platform import target_platform
from jspec.rope import rope_inv_freq, rope_tables, rotate, rotate_by_product
from jspec.serving_layout import is_stacked, linear, pack_params, precision

AttentionFn = Callable[..., jax.Array]


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
            self.lm_head = dense(c.vocab_size, ("embed", "vocab"), c, "lm_head")

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


@struct.dataclass
class Shared:
    """What every layer of one forward reads and no layer changes, computed once before the
    layer loop: the RoPE tables, the block's KV write index and the attention backend's
    prepared block. In a scanned stack XLA recomputed them in each layer's body, about a
    dozen scalar and index kernels per layer (deviceless TPU compile, 8B shape)."""
    cos: jax.Array
    sin: jax.Array
    write_index: jax.Array
    block: object
    kernel_write: bool = struct.field(pytree_node=False, default=False)


# Name scopes of a scanned layer stack's loops: its first loop, and the later ones of a stack
# that stops at aux layers (benchmarks.hlo counts the first as the stack's layer body).
LAYER_SCOPE = "layer_stack"
LAYER_SCOPE_REST = "layer_stack_rest"


def _rotates_whole_block() -> bool:
    # TPU/GPU: one rotation over a KV head's whole fused [G + 2] q/k/v block (the value's
    # slot the identity), the roll done as a product (rope.rotate_by_product), then one
    # guard: XLA fuses them into one kernel after the projection, where slicing q and k out
    # first and rolling each cost a TPU layer about eight kernels. XLA:CPU does better with
    # q and k rotated apart (the block's roll was one more kernel per layer there).
    return target_platform() != "cpu"


def shared_inputs(cfg: LlamaConfig, positions, cache, block_mask, valid,
                  attention_fn: AttentionFn) -> Shared:
    B, T = positions.shape
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    tables = getattr(attention_fn, "rope_tables", None)          # jspec.invariant_attention's
    cos, sin = (rope_tables(positions, inv_freq) if tables is None else
                tables(positions, inv_freq, cache.max_len))                   # [B, T, 1, D]
    if _rotates_whole_block():      # one row per slot of the [G + 2] block: [B, T, 1, G+2, D]
        G = cfg.num_heads // cfg.num_kv_heads
        is_v = (jnp.arange(G + 2) == G + 1)[None, None, None, :, None]
        cos = jnp.where(is_v, 1.0, cos[:, :, :, None])
        sin = jnp.where(is_v, 0.0, sin[:, :, :, None])
    q = jax.ShapeDtypeStruct((B, T, cfg.num_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
    # The backend's KV write kernel takes flat slots; the scatter its (head, slot) index.
    kernel_write = getattr(attention_fn, "writes_kv", lambda cache, T: False)(cache, T)
    index = (kvc.write_slots if kernel_write else kvc.write_index)(cache, T, valid)
    # Materialised once, before the layers: XLA sinks cheap producers (the tables' selects,
    # the write index, the kernels' flattened page table) into a scanned body and redoes them
    # in every layer; unrolled on TPU, it fuses them into each layer's kernels (one more
    # kernel per plain-step layer without the barrier).
    return jax.lax.optimization_barrier(Shared(cos, sin, index,
                                               prepare_attention(attention_fn, cache, block_mask, q),
                                               kernel_write))


def _rotated_qkv(cfg: LlamaConfig, qkv, shared: Shared):
    """``(q [B, T, H, D], k, v [B, T, KVH, D], block)`` from the projection's
    ``[B, T, KVH, G + 2, D]`` (see :func:`_rotates_whole_block`); ``block``: the rotated and
    guarded whole block, or None where k and v are rotated apart and not yet guarded. The
    accelerators' guard zeroes a non-finite query as well as the key and value; plain
    decoding runs this same forward, so speculative and plain outputs still agree wherever a
    row meets one."""
    B, T, KVH, _, D = qkv.shape
    G = cfg.num_heads // KVH
    if _rotates_whole_block():
        qkv = kvc.finite_or_zero(rotate_by_product(qkv, shared.cos, shared.sin))
        q = qkv[:, :, :, :G].reshape(B, T, KVH * G, D)
        return q, qkv[:, :, :, G], qkv[:, :, :, G + 1], qkv
    q = rotate(qkv[:, :, :, :G].reshape(B, T, KVH * G, D), shared.cos, shared.sin)
    return q, rotate(qkv[:, :, :, G], shared.cos, shared.sin), qkv[:, :, :, G + 1], None


def _write_kv(cache, layer, k, v, block, shared: Shared, layer_idx, attention_fn):
    """The layer's KV write: ``(cache, rows)``, by the backend's kernel (``shared.kernel_write``;
    ``rows``: the rows it wrote from, for the attention kernel) or by the scatter (None)."""
    if not shared.kernel_write:
        return kvc.write_layer(cache, layer, k, v, index=shared.write_index, layer_idx=layer_idx,
                               guarded=block is not None), None
    B, T, KVH, D = k.shape
    if block is not None:
        # [B, KVH, (G + 2) * T, D]: row g * T + t, the projection's own layout on TPU (a
        # bitcast there): the grouped queries, then the keys at G * T + t, then the values.
        rows = block.transpose(0, 2, 3, 1, 4).reshape(B, KVH, -1, D)
        G = rows.shape[2] // T - 2
        return attention_fn.write_kv(cache, layer, rows, T, G * T, (G + 1) * T,
                                     shared.write_index), rows
    kv = kvc.finite_or_zero(jnp.concatenate([k, v], axis=1).transpose(0, 2, 1, 3))
    return attention_fn.write_kv(cache, layer, kv, T, 0, T, shared.write_index), None


def decoder_layer(cfg: LlamaConfig, lp, x, shared: Shared, cache, layer,
                  attention_fn: AttentionFn, layer_idx=None, ss=None):
    """One layer over packed parameters ``lp`` (one slice of ``packed["layers"]``);
    ``layer_idx``: this layer's KV write index (:func:`jspec.kv_cache.layer_index`);
    ``ss``: :func:`sum_square` of ``x``, when the previous layer computed it."""
    c = cfg
    B, T, _ = x.shape
    prec = precision(c)
    dt = jnp.dtype(c.dtype)
    h = rms_norm(x, None, c.rms_norm_eps, ss).astype(dt)      # scales folded into qkv, gate_up
    qkv = linear(h, lp["qkv"].astype(dt), prec)                          # [B, T, KVH, G+2, D]
    q, k, v, block = _rotated_qkv(c, qkv, shared)
    cache, rows = _write_kv(cache, layer, k, v, block, shared, layer_idx, attention_fn)
    o = attention_fn(q, cache, layer, shared.block) if rows is None else attention_fn(
        q, cache, layer, shared.block, grouped=rows)
    x = x + linear(o.reshape(B, T, -1).astype(dt), lp["o"].astype(dt), prec)
    h = rms_norm(x, None, c.rms_norm_eps).astype(dt)
    gu = linear(h, lp["gate_up"].astype(dt), prec)                        # [B, T, 2, I]
    m = (jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]).astype(dt)
    return x + linear(m, lp["down"].astype(dt), prec), cache


def forward(cfg: LlamaConfig, packed, tokens, positions, cache, block_mask=None, valid=None,
            aux_layers: Sequence[int] = (), attention_fn: AttentionFn = paged_attention_ref):
    """The target forward over packed parameters: one ``lax.fori_loop`` over a stacked layer
    stack (its counter is the layer index the body needs), a Python loop over per-layer
    weights (see :func:`pack_params`).

    ``tokens, positions: [B, T]``. Writes the block's KV after each row's committed length
    (masked by ``valid [B, T]``), attends with ``block_mask`` (causal when None).
    Returns ``(hidden [B,T,H] post-norm, aux tuple of [B,T,H], new cache)``; the cache's
    ``lengths`` are not advanced (the caller keeps what it accepts). ``aux_layers[j]``
    selects the residual stream *entering* that layer (HF ``output_hidden_states[i]``).
    """
    c = cfg
    L = c.num_layers
    attention_fn = invariant_if_needed(packed, attention_fn)
    x = jnp.take(packed["embed"], tokens, axis=0).astype(c.dtype)
    aux_layers = tuple(int(i) for i in aux_layers)
    if any(not 0 <= i < L for i in aux_layers):
        raise ValueError(f"aux_layers {aux_layers}: each is a layer's input, in 0 .. {L - 1}")
    shared = shared_inputs(c, positions, cache, block_mask, valid, attention_fn)
    if not is_stacked(packed):                       # per-layer weights: unrolled
        aux = {}
        for i, lp in enumerate(packed["layers"]):
            aux[i] = x
            x, cache = decoder_layer(c, lp, x, shared, cache, i, attention_fn)
        aux = tuple(aux[i] for i in aux_layers)
    else:
        # Every layer's KV write index, built before the loop (the body only slices it).
        idx = None if shared.kernel_write else jax.lax.optimization_barrier(jax.vmap(
            lambda i: kvc.layer_index(shared.write_index, i))(jnp.arange(L, dtype=jnp.int32)))
        lps = packed["layers"]
        # On TPU/GPU the next layer's norm statistic is reduced in the kernel that adds the
        # residual (one kernel less per layer); XLA:CPU does not fuse it there (two more).
        next_ss = sum_square if target_platform() != "cpu" else (lambda x: None)

        def body(i, carry):
            x, ss, cache = carry
            at = lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
            x, cache = decoder_layer(c, jax.tree.map(at, lps), x, shared, cache, i, attention_fn,
                                     None if idx is None else at(idx), ss)
            return x, next_ss(x), cache

        # The loop stops before each layer whose input an aux state is: the states are the
        # carry there, and nothing else is written. (One loop filling an [A + 1, B, T, H]
        # buffer wrote it in every layer: 67 MB of an 8B verify's 24 GB on v5p, for three
        # states of 0.5 MB.) Each stop is one more loop over the same body; the scopes name
        # the loops in the HLO (benchmarks.hlo counts the first as the layer body).
        carry, taken, lo, scope = (x, next_ss(x), cache), {}, 0, LAYER_SCOPE
        for hi in sorted(set(aux_layers)) + [L]:
            if hi == lo + 1:              # (libtpu's SPMD partitioner aborts on a 1-trip loop)
                carry = body(jnp.int32(lo), carry)
            elif hi > lo:                 # counted from 0, so its trip count shows in the HLO
                with jax.named_scope(scope):
                    carry = jax.lax.fori_loop(0, hi - lo, lambda k, c, lo=lo: body(lo + k, c),
                                              carry)
                scope = LAYER_SCOPE_REST
            taken[hi], lo = carry[0], hi
        x, _, cache = carry
        aux = tuple(taken[i] for i in aux_layers)
    return rms_norm(x, packed["norm"], c.rms_norm_eps), aux, cache


def logits(cfg: LlamaConfig, packed, hidden):
    """fp32 logits from post-norm hidden states (the tied embedding or ``lm_head``)."""
    dt = jnp.dtype(cfg.dtype)
    # A tied head quantized on request (jspec.quant) is a separate "lm_head" beside the table.
    head = packed["lm_head"] if "lm_head" in packed else packed["embed"]        # [V, H]
    return linear(hidden.astype(dt), head.astype(dt), precision(cfg)).astype(jnp.float32)


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
