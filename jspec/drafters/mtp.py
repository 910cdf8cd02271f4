"""MTP: DeepSeek-V3-style multi-token prediction modules.

A module combines ``eh_proj(cat(enorm(embed(x)), hnorm(h)))``, runs a full decoder
block, and predicts through ``shared_head`` (its own ``norm`` + ``head``, or the
target's LM head when the checkpoint has none). Embeddings at position 0 are zeroed.
The feature h is the target's final post-norm hidden state at committed positions
and the module's own output in the tree loop.

One module reused for every draft step (``num_modules = 1``, the usual serving mode),
or one module per step: step s uses module ``min(s, M - 1)``. Each module keeps its own
KV layer; at committed positions every module is fed the target's (feature, token)
pairs, which is what its attention history needs to exist. (A module k >= 1 was trained
on module k-1's outputs rather than the target's; that affects acceptance, never
exactness, which the target's verification guarantees.)

Checkpoint (DeepSeek layout): ``model.layers.{L+k}.{enorm,hnorm}.weight``,
``.eh_proj.weight [H, 2H]``, the decoder block under the same prefix
(``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``), and
``.shared_head.{norm,head}.weight``; ``.embed_tokens.weight`` is ignored.

Draft vocabulary (``vocab_size = Vd > 0``, needs ``own_head``): every module's
``shared_head_head`` is ``[H, Vd]`` and ``d2t [Vd]`` maps draft ids to target ids (see
:mod:`jspec.drafters.vocab`). No published layout has one: jspec's Orbax format only.
"""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec.checkpoint.common import CheckpointError
from jspec.config import LlamaConfig
from jspec.drafters import hf_layout as hf
from jspec.drafters.base import (DrafterMismatchError, RecurrentDrafter, kept_rows,
                                 random_recurrent, target_embedding, target_head,
                                 target_head_out_major)
from jspec.drafters.registry import DrafterKind, register
from jspec.drafters.vocab import DraftVocab, check_draft_vocab
from jspec.kernels import attention_fn
from jspec.llama import DecoderLayer, RMSNorm, dense
from jspec.serving_layout import linear, precision
from jspec.spec_config import SpecConfig


class MTPModule(nn.Module):
    cfg: LlamaConfig
    own_head: bool
    vocab: int
    layer_index: int = 0
    kernels: str = "reference"         # the attention's jspec.kernels mode
    out_major: bool = False            # kernels held [out, in] (serving; see Linear)

    @nn.compact
    def __call__(self, emb, feats, positions, cache, block_mask, valid, offset, head=None,
                 keep=None):
        c = self.cfg
        H = c.hidden_size
        norm = lambda name: RMSNorm(H, c.rms_norm_eps, c.dtype, name=name)
        emb = jnp.where((positions == 0)[..., None], 0, emb)
        x = dense(H, ("embed", "embed"), c, "eh_proj", self.out_major)(
            jnp.concatenate([norm("enorm")(emb), norm("hnorm")(feats.astype(c.dtype))], -1))
        x, cache = DecoderLayer(c, self.out_major, name="block")(
            x, positions, cache, self.layer_index, block_mask, valid, attention_fn(self.kernels),
            offset)
        hn = norm("shared_head_norm")(kept_rows(x, keep))
        if self.own_head:
            logits = dense(self.vocab, ("embed", "vocab"), c, "shared_head_head",
                            self.out_major)(hn)
        else:
            # The target's head: [V, H] out-major, else [H, V] (see MTP.net_apply).
            logits = (linear(hn, head.astype(hn.dtype), precision(c)) if self.out_major
                      else hn @ head.astype(hn.dtype))
        return x, logits.astype(jnp.float32), cache


@dataclasses.dataclass(frozen=True)
class MTP(DraftVocab, RecurrentDrafter):
    num_modules: int = 1
    own_head: bool = True
    vocab_size: int = 0                # draft vocabulary Vd of the own heads (0: the target's)
    kind = "mtp"

    @property
    def draft_head_paths(self):
        if not self.own_head:
            return ()
        return tuple(("net", f"module_{m}", "shared_head_head", "kernel")
                     for m in range(self.num_modules))

    def validate(self, target_cfg: LlamaConfig, params=None) -> None:
        super().validate(target_cfg, params)
        if self.vocab_size and not self.own_head:
            raise DrafterMismatchError(
                f"mtp drafter with a draft vocabulary (vocab_size={self.vocab_size}) needs its "
                "own head (own_head=True); the target's head covers the full vocabulary")
        check_draft_vocab(self, target_cfg.vocab_size, params)

    @property
    def cache_layers(self) -> int:
        return self.num_modules

    def block_net(self, m: int, kernels: str = "reference") -> MTPModule:
        """The Flax network of module ``m`` (one of ``num_modules``), attending with the
        :mod:`jspec.kernels` mode ``kernels``."""
        return MTPModule(self.layer, self.own_head, self.draft_vocab, m, kernels, self.out_major)

    def init_params(self, key, target_cfg):
        emb, feats, pos, cache = self._dummy(target_cfg, target_cfg.hidden_size)
        V, H = target_cfg.vocab_size, target_cfg.hidden_size
        head = jnp.zeros((V, H) if self.out_major else (H, V), self.layer.dtype)
        keys = jax.random.split(key, self.num_modules)
        return {"net": {f"module_{m}": self.block_net(m).init(
            keys[m], emb, feats, pos, cache, None, None, 0, head)["params"]
            for m in range(self.num_modules)}, **self.init_map()}

    def net_apply(self, params, target_cfg, target_params, tokens, feats, step, positions,
                  cache, block_mask, valid, offset, keep=None, *, kernels: str = "reference"):
        emb = target_embedding(target_params)[tokens]
        head = None
        if not self.own_head:
            head = (target_head_out_major if self.out_major else target_head)(target_cfg,
                                                                              target_params)

        def run(m, cache):
            return self.block_net(m, kernels).apply(
                {"params": params["net"][f"module_{m}"]}, emb, feats, positions, cache,
                block_mask, valid, offset, head, keep)

        if step is None:
            # Committed positions: every module records its KV; module 0 drafts next.
            out, logits, cache = run(0, cache)
            for m in range(1, self.num_modules):
                _, _, cache = run(m, cache)
            return out, logits, cache
        if self.num_modules == 1:
            return run(0, cache)
        branches = [lambda c, m=m: run(m, c) for m in range(self.num_modules)]
        return jax.lax.switch(jnp.minimum(step, self.num_modules - 1), branches, cache)


# ------------------------------------------------------------------ HF layout (DeepSeek-V3)
# Under ``model.layers.{L+k}.``; param paths under ``module_{k}``.
TABLE = (
    ("enorm.weight", "enorm/scale", False),
    ("hnorm.weight", "hnorm/scale", False),
    ("eh_proj.weight", "eh_proj/kernel", True),
    ("input_layernorm.weight", "block/input_layernorm/scale", False),
) + tuple((n, f"block/{p}", t) for n, p, t in hf.ATTN + hf.POST_NORM + hf.MLP) + (
    ("shared_head.norm.weight", "shared_head_norm/scale", False),
)
HEAD = (("shared_head.head.weight", "shared_head_head/kernel", True),)
_KEY = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight")


def _table(module: MTP, layout, num_target_layers) -> list:
    if num_target_layers is None:
        raise ValueError("the MTP layout needs the target's num_layers")
    out = []
    for k in range(module.num_modules):
        out += hf.rows(TABLE + (HEAD if module.own_head else ()),
                       f"model.layers.{num_target_layers + k}.", f"net/module_{k}")
    return out


def _read(d, ts: hf.Tensors, target: LlamaConfig, dtype: str):
    L = hf.int_field(d, "num_hidden_layers", default=target.num_layers)
    if L != target.num_layers:
        raise DrafterMismatchError(
            f"config field 'num_hidden_layers'={L}: these MTP layers follow a {L}-layer model, "
            f"the target has {target.num_layers} layers")
    present = sorted(int(m.group(1)) for k in ts.keys() if (m := _KEY.fullmatch(k)))
    M = hf.int_field(d, "num_nextn_predict_layers")
    if M is None:
        M = 0
        while L + M in present:
            M += 1
    if M < 1:
        raise CheckpointError(
            f"no MTP module at model.layers.{L}.* (the target has {L} layers); eh_proj found at "
            f"layers {present}")
    eh = f"model.layers.{L}.eh_proj.weight"
    heads = [f"model.layers.{L + k}.shared_head.head.weight" in ts for k in range(M)]
    if any(heads) and not all(heads):
        raise CheckpointError(
            f"MTP modules disagree on having their own head: shared_head.head.weight present for "
            f"modules {[k for k, h in enumerate(heads) if h]} of {M}")
    V = hf.int_field(d, "vocab_size", default=ts.shape_or(
        f"model.layers.{L}.shared_head.head.weight", 0, target.vocab_size))
    module = MTP(hf.layer_config(d, target, dtype, ts.shape_or(eh, 0, None)), V, num_modules=M,
                 own_head=all(heads))
    return module, {}, None


def _write_config(module: MTP, layout, num_target_layers) -> dict:
    hf.no_draft_vocab(module, "mtp")
    if num_target_layers is None:
        raise ValueError("writing an MTP drafter's HF layout needs the target's config")
    return {**hf.layer_fields(module.layer), "num_hidden_layers": num_target_layers,
            "vocab_size": module.target_vocab, "num_nextn_predict_layers": module.num_modules}


ENTRY = register(DrafterKind(
    name="mtp", module=MTP, default_spec=SpecConfig.chain(3),
    build=random_recurrent(MTP),
    modes={"chain": SpecConfig.chain(3), "default": SpecConfig(3, 2, 6),
           "wide": SpecConfig(6, 8, 32)},
    loss=("recurrent", {"unroll": 3}),
    hf=hf.HFLayout(
        detect_keys=lambda ks: any(_KEY.fullmatch(k) for k in ks),
        detect_config=lambda d: bool(d.get("num_nextn_predict_layers")),
        read=_read, table=_table, write_config=_write_config, priority=20),
    features="final"))
