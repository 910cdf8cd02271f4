"""EAGLE-3: fuses three target layers and drafts over a reduced vocabulary.

At committed positions the feature is ``fc(cat(aux_low, aux_mid, aux_high))`` (width
3H -> H), optionally normalised first (``fc_norm``: ``"full"`` one RMSNorm over 3H,
``"per_chunk"`` one per H-wide chunk). In the tree loop the feature is the drafter's
own previous (pre-norm) output. The decoder layer's attention reads
``cat(input_layernorm(embed(x)), hidden_norm(h))`` (width 2H, embedding first); its
residual is h (or ``hidden_norm(h)`` with ``norm_before_residual``). Logits come from
its own ``norm`` + ``lm_head`` over the draft vocabulary ``Vd``; ``d2t`` maps a draft id
to a target id as an offset: ``target = draft + d2t[draft]`` (``t2d`` is not needed).

Aux-layer convention: ``aux_layers`` are target layer indices whose *input* residual
stream is read, i.e. Hugging Face ``output_hidden_states[i]``; the default for an
L-layer target is ``(2, L // 2, L - 3)``. SafeAILab/SpecForge configs that list
``eagle_aux_hidden_state_layer_ids`` count *outputs* of layers; the loader adds one.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jspec.config import LlamaConfig
from jspec.kernels import attention_fn
from jspec.drafters.base import (DrafterMismatchError, RecurrentDrafter, kept_rows,
                                 target_embedding)
from jspec.drafters.vocab import DraftVocab, check_d2t, check_draft_vocab
from jspec.llama import MLP, Attention, RMSNorm, _dense


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """(2, L//2, L-3), clamped into [0, L-1] for targets shallower than 4 layers."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


class Eagle3Net(nn.Module):
    cfg: LlamaConfig
    draft_vocab: int
    fc_norm: str = "none"              # "none" | "full" | "per_chunk"
    norm_before_residual: bool = False
    attention: str = "reference"       # a concrete jspec.kernels mode
    out_major: bool = False            # kernels held [out, in] (serving; see Linear)

    @nn.compact
    def __call__(self, emb, feats, from_target: bool, positions, cache, block_mask, valid, offset,
                 keep=None):
        c = self.cfg
        H = c.hidden_size
        norm = lambda n, name: RMSNorm(n, c.rms_norm_eps, c.dtype, name=name)
        if from_target:
            if self.fc_norm == "full":
                feats = norm(3 * H, "fc_norm")(feats)
            elif self.fc_norm == "per_chunk":
                feats = jnp.concatenate([norm(H, f"fc_norm_{i}")(feats[..., i * H:(i + 1) * H])
                                         for i in range(3)], -1)
            h = _dense(H, ("embed", "embed"), c, "fc", self.out_major)(feats.astype(c.dtype))
        else:
            h = feats
        hn = norm(H, "hidden_norm")(h)
        residual = hn if self.norm_before_residual else h
        x = jnp.concatenate([norm(H, "input_layernorm")(emb), hn], -1)
        a, cache = Attention(c, self.out_major, name="self_attn")(
            x, positions, cache, 0, block_mask, valid, attention_fn(self.attention), offset)
        x = residual + a
        out = x + MLP(c, self.out_major, name="mlp")(norm(H, "post_attention_layernorm")(x))
        logits = _dense(self.draft_vocab, ("embed", "vocab"), c, "lm_head",
                        self.out_major)(norm(H, "norm")(kept_rows(out, keep)))
        return out, logits.astype(jnp.float32), cache


@dataclasses.dataclass(frozen=True)
class Eagle3(DraftVocab, RecurrentDrafter):
    aux_layers: tuple[int, ...] = ()
    vocab_size: int = 0                # draft vocabulary Vd (0: same as the target)
    fc_norm: str = "none"
    norm_before_residual: bool = False
    kind = "eagle3"
    feature_source = "aux"

    @property
    def draft_head_paths(self):
        return (("net", "lm_head", "kernel"),)

    @property
    def net(self):
        return Eagle3Net(self.layer, self.draft_vocab, self.fc_norm, self.norm_before_residual,
                         self.attention, self.out_major)

    def init_params(self, key, target_cfg):
        emb, feats, pos, cache = self._dummy(target_cfg, 3 * target_cfg.hidden_size)
        params = {"net": self.net.init(key, emb, feats, True, pos, cache, None, None, 0)["params"]}
        return {**params, **self.init_map()}     # identity-prefix map: draft id i -> target id i

    def net_apply(self, params, target_cfg, target_params, tokens, feats, step, positions,
                  cache, block_mask, valid, offset, keep=None):
        emb = target_embedding(target_params)[tokens]
        return self.net.apply({"params": params["net"]}, emb, feats, step is None, positions, cache,
                              block_mask, valid, offset, keep)

    def validate(self, target_cfg: LlamaConfig, params=None) -> None:
        super().validate(target_cfg, params)
        L = target_cfg.num_layers
        if len(self.aux_layers) != 3:
            raise DrafterMismatchError(
                f"eagle3 drafter reads 3 aux layers, config lists {len(self.aux_layers)}: "
                f"{self.aux_layers}")
        bad = [i for i in self.aux_layers if not 0 <= i < L]
        if bad:
            raise DrafterMismatchError(
                f"eagle3 aux layer {bad[0]} does not exist in a {L}-layer target (aux_layers "
                f"index the residual stream entering a layer: 0 .. {L - 1})")
        check_draft_vocab(self, target_cfg.vocab_size, params)


__all__ = ["Eagle3", "Eagle3Net", "default_aux_layers", "check_d2t"]  # check_d2t: moved to vocab
