"""DFlash (z-lab, arXiv 2602.06036): a whole block drafted in one parallel forward.

The context is the target's states at the configured layers, concatenated and projected
once: ``c = hidden_norm(fc(cat(aux)))``. Context positions never pass through the
drafter's layers; each layer keeps only their keys and values (``k_norm(k_proj(c))`` with
RoPE, ``v_proj(c)``) in the drafter's own paged KV, one cache layer per decoder layer,
committed on acceptance like every kind (``prefill`` / ``extend``). The block is
``[root, MASK x S]`` at positions ``L .. L + S`` (``L`` the committed length, the root the
last emitted token), embedded with the target's embedding. Each Qwen3-style decoder layer
(``q_norm`` / ``k_norm`` on each head before RoPE) attends from every block position to the
whole context and, bidirectionally, to the whole block; the block's keys live in a dense
window (:class:`~jspec.kv_cache.WindowedCache`), never in the pool. The output at block
index ``i >= 1``, through the final ``norm`` and the target's LM head, is the draft of the
token at position ``L + i``: one top-k list per depth, from which a chain (``topk == 1``)
or a static tree (:meth:`jspec.tree.static.StaticTree.for_spec`) is read, as Medusa's are.

Block length: a head is trained on blocks of ``block_size`` (``S = block_size - 1``
drafts); ``spec.num_steps`` may ask for fewer, and the block then holds ``num_steps + 1``
positions. jspec's trainer draws a block length per anchor (:mod:`jspec.train.dflash_loss`)
so its heads serve any length up to ``block_size``; a published head trained at one size
is only measured at it.

Layers: ``aux_layers`` in jspec's convention (the residual stream *entering* layer i,
:mod:`jspec.llama`); the published ``dflash_config.target_layer_ids`` count layer
*outputs* (HF ``output_hidden_states[id + 1]``), so the loader adds one. Published layout
(z-lab / SpecForge; facts and sources in docs/research/dflash.md): ``fc.weight``,
``hidden_norm.weight``, ``norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, the layer norms and MLP; no embedding and no LM
head (the target's are read, not copied).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from jspec import kv_cache as kvc
from jspec.attention import windowed_attention_ref
from jspec.config import LlamaConfig
from jspec.drafters.base import DrafterMismatchError, target_embedding, target_head, \
    target_head_out_major
from jspec.drafters.protocol import DraftModuleDefaults
from jspec.checkpoint.common import CheckpointError
from jspec.config import ConfigError
from jspec.drafters import hf_layout as hf
from jspec.drafters.registry import DrafterKind, register
from jspec.kernels import attention_fn
from jspec.llama import MLP, RMSNorm, dense, out_major_params
from jspec.rope import apply_rope, rope_inv_freq
from jspec.serving_layout import linear, precision
from jspec.spec_config import SpecConfig
from jspec.topk import top_k
from jspec.tree.static import StaticTree, static_tree_tokens


def default_aux_layers(num_target_layers: int, taps: int) -> tuple[int, ...]:
    """The published default taps (``build_target_layer_ids``: one tap at the middle layer,
    else evenly spaced from layer output 1 to ``L - 3``), in jspec's convention (+1)."""
    L = num_target_layers
    if taps == 1:
        ids = [L // 2]
    else:
        ids = [round(1 + i * (L - 4) / (taps - 1)) for i in range(taps)]
    return tuple(min(max(i, 0), L - 2) + 1 for i in ids)


class DFlashAttention(nn.Module):
    cfg: LlamaConfig
    out_major: bool = False

    def _heads(self, x, positions, name: str, n: int, axes: str, norm: bool):
        c = self.cfg
        B, T, _ = x.shape
        y = dense(n * c.head_dim, ("embed", axes), c, f"{name}_proj", self.out_major)(x)
        y = y.reshape(B, T, n, c.head_dim)
        if not norm:
            return y
        y = RMSNorm(c.head_dim, c.rms_norm_eps, c.dtype, name=f"{name}_norm")(y)
        return apply_rope(y, positions, rope_inv_freq(c.rope, c.head_dim))

    @nn.compact
    def __call__(self, x, positions, window=None, layer=0, mask=None, attend=None):
        """Context (``window`` None): ``(k, v)`` of ``x``. Block: the attention's output
        over the window's prefix and the block written into the window, and the window."""
        c = self.cfg
        k = self._heads(x, positions, "k", c.num_kv_heads, "kv_heads", True)
        v = self._heads(x, positions, "v", c.num_kv_heads, "kv_heads", False)
        if window is None:
            return k, v
        q = self._heads(x, positions, "q", c.num_heads, "heads", True)
        window = window.write(layer, k, v, 0)
        o = attend(q, window, layer, mask)
        B, T = x.shape[:2]
        return dense(c.hidden_size, ("heads", "embed"), c, "o_proj",
                     self.out_major)(o.reshape(B, T, -1)), window


class DFlashLayer(nn.Module):
    cfg: LlamaConfig
    out_major: bool = False

    @nn.compact
    def __call__(self, x, positions, window=None, layer=0, mask=None, attend=None):
        c = self.cfg
        attn = DFlashAttention(c, self.out_major, name="self_attn")
        if window is None:                       # context: keys and values only
            return attn(x, positions)
        norm = lambda name: RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, name=name)
        a, window = attn(norm("input_layernorm")(x), positions, window, layer, mask, attend)
        x = x + a
        return x + MLP(c, self.out_major, name="mlp")(norm("post_attention_layernorm")(x)), window


class DFlashNet(nn.Module):
    cfg: LlamaConfig                  # the drafter's layers (num_layers of them)
    out_major: bool = False

    @nn.compact
    def __call__(self, ctx=None, block=None):
        """``ctx = (feats [B, T, F], positions, cache, valid)``: the context's keys and values
        written after each row's committed length; ``block = (emb [B, T, H], positions,
        window, mask [B, T, T], attend)``: the block's post-norm hidden states. Returns
        ``(cache or None, hidden or None)``."""
        c = self.cfg
        layers = [DFlashLayer(c, self.out_major, name=f"layers_{i}") for i in range(c.num_layers)]
        cache = hidden = None
        if ctx is not None:
            feats, positions, cache, valid = ctx
            h = dense(c.hidden_size, ("embed", "embed"), c, "fc", self.out_major)(
                feats.astype(c.dtype))
            h = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, name="hidden_norm")(h)
            for i, layer in enumerate(layers):
                k, v = layer(h, positions)
                cache = kvc.write_layer(cache, i, k, v, valid)
        if block is not None:
            x, positions, window, mask, attend = block
            for i, layer in enumerate(layers):
                x, window = layer(x, positions, window, i, mask, attend)
            hidden = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, name="norm")(x)
        return cache, hidden


@struct.dataclass
class DFlashState:
    cache: kvc.PagedKVCache           # the context's keys and values, one layer per decoder layer


@dataclasses.dataclass(frozen=True)
class DFlash(DraftModuleDefaults):
    layer: LlamaConfig                # the decoder layers (num_layers = the drafter's depth)
    target_vocab: int
    aux_layers: tuple[int, ...]       # jspec convention: the stream entering layer i
    block_size: int = 16
    mask_token_id: int = 0
    out_major: bool = dataclasses.field(default=False, metadata={"runtime": True})
    kind = "dflash"

    def net(self) -> DFlashNet:
        return DFlashNet(self.layer, self.out_major)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(self.aux_layers)

    @property
    def cache_layers(self) -> int:
        return self.layer.num_layers

    # No draft vocabulary: it drafts over the target's, through the target's head.
    draft_head_paths = ()

    @property
    def draft_vocab(self) -> int:
        return self.target_vocab

    # ---------------------------------------------------------------- host side
    def tree(self, spec: SpecConfig | None) -> StaticTree:
        spec = SpecConfig.chain(self.block_size - 1) if spec is None else spec
        try:
            return StaticTree.for_spec(spec, self.block_size - 1)
        except ValueError as e:
            raise DrafterMismatchError(f"dflash with block_size={self.block_size}: {e}") from None

    def check_spec(self, spec: SpecConfig | None) -> None:
        self.tree(spec)

    def tree_shape(self, spec: SpecConfig | None) -> tuple[int, int]:
        t = self.tree(spec)
        return t.depth, t.num_nodes

    def cache_slots(self, spec: SpecConfig | None) -> int:
        return self.tree(spec).depth + 1        # an extend commits at most S + 1 positions

    def validate(self, target_cfg: LlamaConfig, params=None) -> None:
        V, L = target_cfg.vocab_size, target_cfg.num_layers
        if V != self.target_vocab:
            raise DrafterMismatchError(f"dflash drafter was built for a vocabulary of "
                                       f"{self.target_vocab} tokens, the target has {V}")
        if target_cfg.hidden_size != self.layer.hidden_size:
            raise DrafterMismatchError(
                f"dflash drafter has hidden size {self.layer.hidden_size}, the target "
                f"{target_cfg.hidden_size} (it embeds and reads out with the target's)")
        bad = [i for i in self.aux_layers if not 1 <= i < L]
        if not self.aux_layers or bad:
            raise DrafterMismatchError(
                f"dflash target layers {list(self.aux_layers)} (inputs of layers) must lie in "
                f"1 .. {L - 1} of a {L}-layer target (published target_layer_ids 0 .. {L - 2})")
        if not 0 <= self.mask_token_id < V:
            raise DrafterMismatchError(f"dflash mask_token_id {self.mask_token_id} is not a row "
                                       f"of the target's {V}-token embedding")
        if self.block_size < 2:
            raise DrafterMismatchError(f"dflash block_size must be >= 2, got {self.block_size}")

    def serving(self, params):
        if self.out_major:
            return self, params
        return dataclasses.replace(self, out_major=True), out_major_params(params)

    def init_params(self, key, target_cfg: LlamaConfig):
        c = self.layer
        B, T, H = 1, 2, c.hidden_size
        cache = kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim,
                               jnp.zeros((B, 1), jnp.int32), 1, 8, c.dtype)
        pos = jnp.zeros((B, T), jnp.int32)
        feats = jnp.zeros((B, T, len(self.aux_layers) * target_cfg.hidden_size), c.dtype)
        block = (jnp.zeros((B, T, H), c.dtype), pos, kvc.WindowedCache.empty(cache, T),
                 jnp.ones((B, T, T), bool), windowed_attention_ref)
        return {"net": self.net().init(key, (feats, pos, cache, None), block)["params"]}

    # ------------------------------------------------------------- inside jit
    def init_state(self, batch, page_table, num_pages, page_size) -> DFlashState:
        c = self.layer
        return DFlashState(kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim, page_table,
                                          num_pages, page_size, c.dtype))

    def context(self, params, cache: kvc.PagedKVCache, feats, n) -> kvc.PagedKVCache:
        """The first ``n [B]`` of ``feats [B, T, F]`` written after each row's committed
        length (not advanced)."""
        T = feats.shape[1]
        j = jnp.arange(T, dtype=jnp.int32)[None]
        cache, _ = self.net().apply({"params": params["net"]},
                                    ctx=(feats, cache.lengths[:, None] + j, cache,
                                         j < n[:, None]))
        return cache

    def prefill(self, params, target, state, feats, next_tokens, lens, *,
                kernels: str = "reference"):
        return self.extend(params, target, state, feats, next_tokens, lens, kernels=kernels)

    # next_tokens: the protocol's pairs; a DFlash context position is its feature alone.
    def extend(self, params, target, state, feats, next_tokens, n, *, kernels: str = "reference"):
        n = n.astype(jnp.int32)
        return DFlashState(kvc.advance(self.context(params, state.cache, feats, n), n))

    def block_hidden(self, params, target_params, prefix: kvc.PagedKVCache, first, length: int,
                     visible=None, *, kernels: str = "reference"):
        """The post-norm hidden states ``[B, length, H]`` of the block ``[first, MASK ...]``
        at positions ``prefix.lengths + i`` over the committed context ``prefix``;
        ``visible [B, length]``: which block positions the block attends to (all)."""
        B = first.shape[0]
        toks = jnp.concatenate([first[:, None].astype(jnp.int32),
                                jnp.full((B, length - 1), self.mask_token_id, jnp.int32)], 1)
        pos = prefix.lengths[:, None] + jnp.arange(length, dtype=jnp.int32)[None]
        emb = target_embedding(target_params)[toks].astype(self.layer.dtype)
        visible = jnp.ones((B, length), bool) if visible is None else visible
        mask = jnp.broadcast_to(visible[:, None], (B, length, length))
        attend = getattr(attention_fn(kernels), "windowed", windowed_attention_ref)
        _, hidden = self.net().apply({"params": params["net"]}, block=(
            emb, pos, kvc.WindowedCache.empty(prefix, length), mask, attend))
        return hidden

    def logits(self, target_cfg, target_params, hidden):
        """Draft logits over the target's vocabulary (fp32) through the target's head."""
        if self.out_major:
            head = target_head_out_major(target_cfg, target_params)
            out = linear(hidden, head.astype(hidden.dtype), precision(self.layer))
        else:
            out = hidden @ target_head(target_cfg, target_params).astype(hidden.dtype)
        return out.astype(jnp.float32)

    def propose(self, params, target, state: DFlashState, root, spec, *,
                kernels: str = "reference"):
        cfg, tparams = target
        tree = self.tree(spec)
        hidden = self.block_hidden(params, tparams, state.cache, root, tree.depth + 1,
                                   kernels=kernels)
        logits = self.logits(cfg, tparams, hidden[:, 1:])             # [B, S, V]: depth 1..S
        _, top = top_k(logits, tree.topk)
        return static_tree_tokens(tree, root, top)


def _random(target_cfg: LlamaConfig, key, num_layers: int = 1, aux_layers=None,
            block_size: int = 16, mask_token_id: int = 0, vocab_size: int = 0, **layer):
    """Random weights: ``num_layers`` decoder layers shaped like the target's; by default
    as many taps as layers, where the published heads put them. No draft vocabulary: it
    reads out through the target's head."""
    if vocab_size and vocab_size != target_cfg.vocab_size:
        raise ValueError(f"a dflash drafter reads out through the target's head: no draft "
                         f"vocabulary (vocab_size={vocab_size})")
    aux = tuple(aux_layers) if aux_layers else default_aux_layers(target_cfg.num_layers,
                                                                   num_layers)
    module = DFlash(hf.draft_layer_config(target_cfg, num_layers=num_layers, **layer),
                    target_cfg.vocab_size, aux, block_size, mask_token_id)
    return module, module.init_params(key, target_cfg)


# ------------------------------------------------------- HF layout (z-lab / SpecForge)
LAYER = ((("input_layernorm.weight", "input_layernorm/scale", False),) + hf.ATTN
         + tuple((f"self_attn.{n}_norm.weight", f"self_attn/{n}_norm/scale", False) for n in "qk")
         + hf.POST_NORM + hf.MLP)
TOP = (("fc.weight", "fc/kernel", True), ("hidden_norm.weight", "hidden_norm/scale", False),
       ("norm.weight", "norm/scale", False))


def _table(module: DFlash, layout, num_target_layers) -> list:
    rows = [(f"layers.{i}.{n}", f"layers_{i}/{p}", t)
            for i in range(module.layer.num_layers) for n, p, t in LAYER]
    return hf.rows(TOP + tuple(rows))


def _field(d: dict, name: str):
    """A ``dflash_config`` field, else the top-level one (z-lab's reader does the same)."""
    dc = d.get("dflash_config")
    if isinstance(dc, dict) and dc.get(name) is not None:
        return dc[name]
    return d.get(name)


def _read(d, ts: hf.Tensors, target: LlamaConfig, dtype: str, aux_layers=None):
    n = hf.int_field(d, "num_hidden_layers", default=len(
        {k.split(".")[1] for k in ts.keys() if k.startswith("layers.")}))
    if not n:
        raise CheckpointError("no DFlash decoder layers ('layers.N.*') found")
    types = d.get("layer_types") or []
    if any(t != "full_attention" for t in types):
        raise ConfigError(f"dflash layer_types {types}: only full_attention layers are supported "
                          "(sliding-window layers are not)")
    if d.get("is_causal") or _field(d, "is_causal"):
        raise ConfigError("a causal DFlash block (is_causal=true) is not supported")
    L = hf.int_field(d, "num_target_layers")
    if L is not None and L != target.num_layers:
        raise DrafterMismatchError(f"dflash drafter was trained on a {L}-layer target "
                                   f"(num_target_layers), the target has {target.num_layers}")
    mask = _field(d, "mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise ConfigError(f"dflash config needs dflash_config.mask_token_id (an int), got {mask!r}")
    if aux_layers is None:
        ids = _field(d, "target_layer_ids")
        if ids is None:
            aux_layers = default_aux_layers(target.num_layers, n)
        elif not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ConfigError(f"dflash_config.target_layer_ids must be a list of ints, got {ids!r}")
        else:
            aux_layers = tuple(i + 1 for i in ids)      # layer outputs -> layer inputs
    block = _field(d, "block_size")
    layer = hf.layer_config(d, target, dtype, ts.shape_or("fc.weight", 0, None))
    module = DFlash(layer.replace(num_layers=n), hf.int_field(d, "vocab_size",
                                                               default=target.vocab_size),
                    tuple(int(i) for i in aux_layers), int(block or 16), mask)
    return module, {}, None


def _write_config(module: DFlash, layout, num_target_layers) -> dict:
    n = module.layer.num_layers
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           **hf.layer_fields(module.layer), "num_hidden_layers": n,
           "vocab_size": module.target_vocab, "block_size": module.block_size,
           "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
           "layer_types": ["full_attention"] * n,
           "dflash_config": {"mask_token_id": module.mask_token_id,
                             "target_layer_ids": [i - 1 for i in module.aux_layers]}}
    if num_target_layers is not None:
        cfg["num_target_layers"] = num_target_layers
    return cfg


ENTRY = register(DrafterKind(
    name="dflash", module=DFlash, default_spec=None,        # a chain of block_size - 1
    build=_random,
    modes={"chain": lambda m: SpecConfig.chain(m.block_size - 1), "default": None,
           "wide": lambda m: SpecConfig(m.block_size - 1, 2, min(2 * m.block_size, 32))},
    loss=("dflash", {}),
    hf=hf.HFLayout(
        detect_keys=lambda ks: "hidden_norm.weight" in ks and "fc.weight" in ks
        and any(k.endswith("self_attn.q_norm.weight") for k in ks),
        detect_config=lambda d: "dflash_config" in d
        or "dflash" in " ".join(d.get("architectures") or []).lower(),
        read=_read, table=_table, write_config=_write_config, options=("aux_layers",),
        priority=5),
    features="aux"))
