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
import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.common import CheckpointError
from jspec.config import ConfigError, LlamaConfig
from jspec.drafters import hf_layout as hf
from jspec.drafters.base import (DrafterMismatchError, RecurrentDrafter, kept_rows,
                                 random_recurrent, target_embedding)
from jspec.drafters.registry import DrafterKind, register
from jspec.drafters.vocab import DraftVocab, check_d2t, check_draft_vocab
from jspec.kernels import attention_fn
from jspec.llama import MLP, Attention, RMSNorm, dense
from jspec.spec_config import SpecConfig


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """(2, L//2, L-3), clamped into [0, L-1] for targets shallower than 4 layers."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


class Eagle3Net(nn.Module):
    cfg: LlamaConfig
    draft_vocab: int
    fc_norm: str = "none"              # "none" | "full" | "per_chunk"
    norm_before_residual: bool = False
    kernels: str = "reference"         # the attention's jspec.kernels mode
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
            h = dense(H, ("embed", "embed"), c, "fc", self.out_major)(feats.astype(c.dtype))
        else:
            h = feats
        hn = norm(H, "hidden_norm")(h)
        residual = hn if self.norm_before_residual else h
        x = jnp.concatenate([norm(H, "input_layernorm")(emb), hn], -1)
        a, cache = Attention(c, self.out_major, name="self_attn")(
            x, positions, cache, 0, block_mask, valid, attention_fn(self.kernels), offset)
        x = residual + a
        out = x + MLP(c, self.out_major, name="mlp")(norm(H, "post_attention_layernorm")(x))
        logits = dense(self.draft_vocab, ("embed", "vocab"), c, "lm_head",
                        self.out_major)(norm(H, "norm")(kept_rows(out, keep)))
        return out, logits.astype(jnp.float32), cache


@dataclasses.dataclass(frozen=True)
class Eagle3(DraftVocab, RecurrentDrafter):
    aux_layers: tuple[int, ...] = ()
    vocab_size: int = 0                # draft vocabulary Vd (0: same as the target)
    fc_norm: str = "none"
    norm_before_residual: bool = False
    kind = "eagle3"

    @property
    def draft_head_paths(self):
        return (("net", "lm_head", "kernel"),)

    def net(self, kernels: str = "reference") -> Eagle3Net:
        return Eagle3Net(self.layer, self.draft_vocab, self.fc_norm, self.norm_before_residual,
                         kernels, self.out_major)

    def init_params(self, key, target_cfg):
        emb, feats, pos, cache = self._dummy(target_cfg, 3 * target_cfg.hidden_size)
        net = self.net()
        params = {"net": net.init(key, emb, feats, True, pos, cache, None, None, 0)["params"]}
        return {**params, **self.init_map()}     # identity-prefix map: draft id i -> target id i

    def net_apply(self, params, target_cfg, target_params, tokens, feats, step, positions,
                  cache, block_mask, valid, offset, keep=None, *, kernels: str = "reference"):
        emb = target_embedding(target_params)[tokens]
        return self.net(kernels).apply({"params": params["net"]}, emb, feats, step is None,
                                       positions, cache, block_mask, valid, offset, keep)

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


    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(self.aux_layers)


# ------------------------------------------------------- HF layout (SafeAILab / SpecForge)
TABLE = (
    ("fc.weight", "fc/kernel", True),
    ("midlayer.input_layernorm.weight", "input_layernorm/scale", False),
    ("midlayer.hidden_norm.weight", "hidden_norm/scale", False),
) + tuple((f"midlayer.{n}", p, t) for n, p, t in hf.ATTN + hf.POST_NORM + hf.MLP) + (
    ("norm.weight", "norm/scale", False),
    ("lm_head.weight", "lm_head/kernel", True),
)
FC_NORM = {
    "none": (),
    "full": (("fc_norm.weight", "fc_norm/scale", False),),
    "per_chunk": tuple((f"fc_norm_{i}.weight", f"fc_norm_{i}/scale", False) for i in range(3)),
}
AUX_FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"


def _aux_layers(d, target: LlamaConfig, aux_layers) -> tuple[int, ...]:
    if aux_layers is not None:
        return tuple(int(i) for i in aux_layers)
    field, ids = AUX_FIELD, None
    ec = d.get("eagle_config")
    if isinstance(ec, dict):
        ids = ec.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and d.get("eagle_aux_hidden_state_layer_ids") is not None:
        field, ids = "eagle_aux_hidden_state_layer_ids", d["eagle_aux_hidden_state_layer_ids"]
    if ids is None:
        return default_aux_layers(target.num_layers)
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ConfigError(f"config field {field!r} must be a list of ints, got {ids!r}")
    L = target.num_layers
    if len(ids) != 3:
        raise DrafterMismatchError(
            f"config field {field!r} lists {len(ids)} layers {ids}; EAGLE-3 fuses exactly 3")
    for i in ids:
        if not -1 <= i < L - 1:
            raise DrafterMismatchError(
                f"config field {field!r}={ids}: layer id {i} (an output-of-layer index, i.e. the "
                f"input of layer {i + 1}) does not exist in a {L}-layer target (ids -1 .. {L - 2})")
    # Output of layer i == input of layer i + 1 (jspec's convention).
    return tuple(i + 1 for i in ids)


def _read(d, ts: hf.Tensors, target: LlamaConfig, dtype: str, aux_layers=None):
    V = hf.int_field(d, "vocab_size", default=target.vocab_size)
    Vd = hf.int_field(d, "draft_vocab_size", default=ts.shape_or("lm_head.weight", 0, V))
    fc_norm = d.get("fc_norm")
    found = ("full" if "fc_norm.weight" in ts else
             "per_chunk" if any(f"fc_norm_{i}.weight" in ts for i in range(3)) else "none")
    if fc_norm is None:
        fc_norm = found
    elif fc_norm not in FC_NORM:
        raise ConfigError(f"config field 'fc_norm'={fc_norm!r}: one of {sorted(FC_NORM)}")
    elif found != "none" and found != fc_norm:
        raise CheckpointError(f"config.json says fc_norm={fc_norm!r} but the checkpoint has "
                              f"{found!r} fc_norm tensors")
    module = Eagle3(hf.layer_config(d, target, dtype, ts.shape_or("fc.weight", 0, None)), V,
                    aux_layers=_aux_layers(d, target, aux_layers), vocab_size=0 if Vd == V else Vd,
                    fc_norm=fc_norm, norm_before_residual=bool(d.get("norm_before_residual", False)))
    extra = {}
    if "d2t" in ts:
        shape = ts.shape("d2t")
        if shape != (Vd,):
            raise DrafterMismatchError(
                f"d2t has shape {shape}, expected ({Vd},) (one offset per draft id; "
                f"draft_vocab_size={Vd})")
        d2t = np.asarray(ts.get("d2t")).astype(np.int64)
        check_d2t(d2t, Vd, target.vocab_size)
        if Vd != V or d2t.any():       # an all-zero map over the full vocabulary is the identity
            extra["d2t"] = jax.numpy.asarray(d2t.astype(np.int32))
    return module, extra, None


def _write_config(module: Eagle3, layout, num_target_layers) -> dict:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **hf.layer_fields(module.layer),
           "num_hidden_layers": 1, "vocab_size": module.target_vocab,
           "draft_vocab_size": module.draft_vocab,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in module.aux_layers]},
           "norm_before_residual": module.norm_before_residual}
    if module.fc_norm != "none":
        cfg["fc_norm"] = module.fc_norm
    return cfg


def _detect_config(d: dict) -> bool:
    archs = " ".join(d.get("architectures") or []).lower()
    return "draft_vocab_size" in d or "eagle_config" in d or "eagle3" in archs


ENTRY = register(DrafterKind(
    name="eagle3", module=Eagle3, default_spec=SpecConfig(5, 4, 8),
    build=random_recurrent(Eagle3, lambda cfg: {"aux_layers": default_aux_layers(cfg.num_layers)}),
    modes={"chain": SpecConfig.chain(5), "default": SpecConfig(5, 4, 8),
           "wide": SpecConfig(6, 8, 32)},
    loss=("recurrent", {"unroll": 3}),
    hf=hf.HFLayout(
        detect_keys=lambda ks: any(k.startswith("midlayer.") for k in ks),
        detect_config=_detect_config, read=_read,
        table=lambda m, layout, L: hf.rows(TABLE[:1] + FC_NORM[m.fc_norm] + TABLE[1:]),
        write_config=_write_config, options=("aux_layers",), optional=frozenset({("d2t",)}),
        priority=10),
    features="aux"))

__all__ = ["Eagle3", "Eagle3Net", "default_aux_layers", "check_d2t"]  # check_d2t: moved to vocab
