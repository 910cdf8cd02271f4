"""EAGLE-1: ``fc(cat(embed(x), h))`` then one decoder layer without an input norm.

The feature h is the target's final post-norm hidden state; the layer's output is
fed back as the next feature and read by the target's own LM head (no norm), or, with
a draft vocabulary (``vocab_size = Vd > 0``), by the drafter's own ``lm_head [H, Vd]``
(initialised from the target head's columns of the kept tokens) and mapped back to
target ids through ``d2t`` (see :mod:`jspec.drafters.vocab`).

Checkpoint (SafeAILab layout): ``fc.weight [H, 2H]`` (+ ``fc.bias`` when the config's
``bias`` is true), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.post_attention_layernorm.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``;
an ``embed_tokens.weight`` is ignored (the target's embedding is used). A draft-vocabulary
EAGLE-1 (params ``lm_head/kernel [H, Vd]``, ``d2t [Vd]``) has no published layout: jspec's
Orbax format only.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec.checkpoint.common import CheckpointError
from jspec.config import LlamaConfig
from jspec.drafters import hf_layout as hf
from jspec.drafters.base import (RecurrentDrafter, kept_rows, random_recurrent, target_embedding,
                                 target_head, target_head_out_major)
from jspec.drafters.registry import DrafterKind, register
from jspec.drafters.vocab import DraftVocab, check_draft_vocab
from jspec.kernels import attention_fn
from jspec.llama import MLP, Attention, RMSNorm, dense
from jspec.serving_layout import linear, precision
from jspec.spec_config import SpecConfig


class Eagle1Net(nn.Module):
    cfg: LlamaConfig
    fc_bias: bool = False
    kernels: str = "reference"         # the attention's jspec.kernels mode
    out_major: bool = False            # kernels held [out, in] (serving; see Linear)

    @nn.compact
    def __call__(self, emb, feats, positions, cache, block_mask, valid, offset):
        c = self.cfg
        fc = dense(c.hidden_size, ("embed", "embed"), c, "fc", self.out_major, self.fc_bias)
        x = fc(jnp.concatenate([emb, feats.astype(emb.dtype)], -1))
        h, cache = Attention(c, self.out_major, name="self_attn")(
            x, positions, cache, 0, block_mask, valid, attention_fn(self.kernels), offset)
        x = x + h
        x = x + MLP(c, self.out_major, name="mlp")(
            RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(x))
        return x, cache


@dataclasses.dataclass(frozen=True)
class Eagle1(DraftVocab, RecurrentDrafter):
    fc_bias: bool = False
    vocab_size: int = 0                # draft vocabulary Vd with its own head (0: the target's head)
    kind = "eagle1"

    @property
    def draft_head_paths(self):
        return (("lm_head", "kernel"),) if self.vocab_size else ()

    def net(self, kernels: str = "reference") -> Eagle1Net:
        return Eagle1Net(self.layer, self.fc_bias, kernels, self.out_major)

    def init_params(self, key, target_cfg):
        emb, feats, pos, cache = self._dummy(target_cfg, target_cfg.hidden_size)
        params = {"net": self.net().init(key, emb, feats, pos, cache, None, None, 0)["params"]}
        if self.vocab_size:
            H, Vd = self.layer.hidden_size, self.draft_vocab
            kernel = nn.initializers.normal(0.02)(jax.random.fold_in(key, 1), (H, Vd),
                                                  jnp.dtype(self.layer.dtype))
            params.update(lm_head={"kernel": kernel}, **self.init_map())
        return params

    def validate(self, target_cfg: LlamaConfig, params=None) -> None:
        super().validate(target_cfg, params)
        check_draft_vocab(self, target_cfg.vocab_size, params)

    def net_apply(self, params, target_cfg, target_params, tokens, feats, step, positions,
                  cache, block_mask, valid, offset, keep=None, *, kernels: str = "reference"):
        emb = target_embedding(target_params)[tokens]
        out, cache = self.net(kernels).apply({"params": params["net"]}, emb, feats, positions,
                                             cache, block_mask, valid, offset)
        # The own head is [H, Vd] in checkpoints and [Vd, H] out-major; each layout gets its own
        # product (a transposed view under `linear` would be folded into the slow CPU form).
        if self.out_major:
            head = (params["lm_head"]["kernel"] if self.vocab_size
                    else target_head_out_major(target_cfg, target_params))
            logits = linear(kept_rows(out, keep), head.astype(out.dtype), precision(self.layer))
        else:
            head = (params["lm_head"]["kernel"] if self.vocab_size
                    else target_head(target_cfg, target_params))
            logits = kept_rows(out, keep) @ head.astype(out.dtype)
        return out, logits.astype(jnp.float32), cache


# ------------------------------------------------------------------ HF layout (SafeAILab)
TABLE = (("fc.weight", "fc/kernel", True),) + tuple(
    (f"layers.0.{n}", p, t) for n, p, t in hf.ATTN + hf.POST_NORM + hf.MLP)
BIAS = (("fc.bias", "fc/bias", False),)


def _read(d, ts: hf.Tensors, target: LlamaConfig, dtype: str):
    has_bias = "fc.bias" in ts
    bias = d.get("bias")
    if bias is None:
        bias = has_bias
    elif not bias and has_bias:
        raise CheckpointError("checkpoint has tensor 'fc.bias' but config.json says bias=false")
    module = Eagle1(hf.layer_config(d, target, dtype, ts.shape_or("fc.weight", 0, None)),
                    hf.int_field(d, "vocab_size", default=target.vocab_size), fc_bias=bool(bias))
    return module, {}, None


def _write_config(module: Eagle1, layout, num_target_layers) -> dict:
    hf.no_draft_vocab(module, "eagle1")
    return {"architectures": ["EagleForCausalLM"], **hf.layer_fields(module.layer),
            "num_hidden_layers": 1, "vocab_size": module.target_vocab, "bias": module.fc_bias}


ENTRY = register(DrafterKind(
    name="eagle1", module=Eagle1, default_spec=SpecConfig(5, 4, 8),
    build=random_recurrent(Eagle1),
    modes={"chain": SpecConfig.chain(5), "default": SpecConfig(5, 4, 8),
           "wide": SpecConfig(6, 8, 32)},
    loss=("recurrent", {"unroll": 2, "reg": 1.0}),
    hf=hf.HFLayout(
        detect_keys=lambda ks: "fc.weight" in ks and any(k.startswith("layers.0.") for k in ks),
        detect_config=lambda d: "eagle" in " ".join(d.get("architectures") or []).lower(),
        read=_read,
        table=lambda m, layout, L: hf.rows(TABLE + (BIAS if m.fc_bias else ())),
        write_config=_write_config, priority=90),
    features="final"))
