"""Drafter checkpoints: the published Hugging Face layouts and jspec's own Orbax format.

:func:`load_drafter` reads a directory and returns a :class:`~jspec.drafters.Drafter`
fitted to a target. Everything is checked on the host before anything is traced for
decoding: the config (hidden size, vocabulary, aux layers) against the target, then
every tensor's shape from the safetensors headers (before any tensor data is read),
then the index maps (``d2t``, ``token_map``). Failures name the field or tensor:
:class:`~jspec.drafters.DrafterMismatchError` when the drafter does not fit the target,
:class:`~jspec.checkpoint.CheckpointError` when the checkpoint itself is malformed.

Layouts (``config.json`` + ``model.safetensors`` / a sharded
``model.safetensors.index.json`` / a single other ``*.safetensors`` file), detected from
the tensor names (then the config), or forced with ``kind=``:

- ``eagle1`` (SafeAILab): ``fc.weight [H, 2H]`` (+ ``fc.bias`` when config ``bias``),
  ``layers.0.{self_attn,mlp}.*``, ``layers.0.post_attention_layernorm.weight``.
  (A draft-vocabulary EAGLE-1 or MTP, ``vocab_size > 0``, has no published layout; it is
  saved and loaded in jspec's Orbax format only.)
- ``eagle3`` (SafeAILab / SpecForge): ``fc.weight [H, 3H]``, ``midlayer.*``,
  ``norm.weight``, ``lm_head.weight [Vd, H]``, ``d2t [Vd]`` (``t2d`` ignored); optional
  jspec extensions ``fc_norm.weight [3H]`` (``fc_norm="full"``) or
  ``fc_norm_{0,1,2}.weight [H]`` (``"per_chunk"``), and the config flag
  ``norm_before_residual``. Aux layers: config
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` count layer *outputs* (the HF/SpecForge
  convention); jspec's ``Eagle3.aux_layers`` count layer *inputs*
  (``output_hidden_states`` indices), so the loader adds 1 to each id. Without that
  field the default ``(2, L // 2, L - 3)`` (input convention) is used.
- ``mtp`` (DeepSeek-V3): ``model.layers.{L+k}.{enorm,hnorm,eh_proj,self_attn.*,mlp.*,
  input_layernorm,post_attention_layernorm,shared_head.norm,shared_head.head}`` for
  ``k < num_nextn_predict_layers``, L = the target's depth; no ``shared_head.head`` means
  the target's LM head is used.
- ``medusa``: FasterDecoding ``{i}.{j}.linear.{weight,bias}`` + ``{i}.{L}.weight``
  (config ``medusa_num_heads``, ``medusa_num_layers``), or vLLM
  ``blocks.{i}.layers.{j}.{weight,bias}`` + ``lm_heads.{i}.weight`` (config ``num_heads``,
  ``num_hidden_layers``) with an optional truncated vocabulary: config
  ``truncated_vocab_size`` and a ``token_map [Vd]`` tensor (draft id -> target id).

The drafter's decoder layer takes ``hidden_size``, ``intermediate_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps`` and the
RoPE fields from its ``config.json``, falling back to the target's. Parameters are cast
to ``dtype``, by default the target's (the drafter reads the target's embeddings).

jspec's own format (:func:`save_drafter`): ``jspec_drafter.json`` (kind, the spec's
static fields, the layer config; ``vocab_size`` among them) + Orbax params (the draft
heads and the ``d2t`` / ``token_map`` map among them), written to a hidden sibling
directory and renamed into place. Every stored tensor's shape is checked against the
spec's before any data is read; the map's length and range by the spec's ``validate``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import save_file

from jspec.checkpoint.common import CheckpointError, check_shape, flatten, path_str, to_param, unflatten
from jspec.checkpoint.hf import SafetensorsDir
from jspec.checkpoint.orbax_io import move_into_place, restore_numpy, restore_sharded
from jspec.config import ConfigError, LlamaConfig, rope_from_hf
from jspec.drafters import Drafter, draft_layer_config
from jspec.drafters.base import DrafterMismatchError
from jspec.drafters.eagle1 import Eagle1
from jspec.drafters.eagle3 import Eagle3, default_aux_layers
from jspec.drafters.medusa import Medusa
from jspec.drafters.mtp import MTP
from jspec.drafters.vocab import check_d2t, check_token_map
from jspec.tree import calibration

DRAFTER_CONFIG_FILE = "jspec_drafter.json"
FORMAT = "jspec-drafter-orbax"
VERSION = 1
PARAMS_DIR = "params"
KINDS = {"eagle1": Eagle1, "eagle3": Eagle3, "mtp": MTP, "medusa": Medusa}
MEDUSA_LAYOUTS = ("fasterdecoding", "vllm")

Row = tuple[str, tuple[str, ...], bool]   # (HF name, param path, transpose [out,in] -> [in,out])

# ----------------------------------------------------------------- name tables
_ATTN = tuple((f"self_attn.{p}_proj.weight", f"self_attn/{p}_proj/kernel", True) for p in "qkvo")
_MLP = tuple((f"mlp.{p}_proj.weight", f"mlp/{p}_proj/kernel", True) for p in ("gate", "up", "down"))
_POST_NORM = (("post_attention_layernorm.weight", "post_attention_layernorm/scale", False),)

EAGLE1_TABLE = (("fc.weight", "fc/kernel", True),) + tuple(
    (f"layers.0.{n}", p, t) for n, p, t in _ATTN + _POST_NORM + _MLP)
EAGLE1_BIAS = (("fc.bias", "fc/bias", False),)

EAGLE3_TABLE = (
    ("fc.weight", "fc/kernel", True),
    ("midlayer.input_layernorm.weight", "input_layernorm/scale", False),
    ("midlayer.hidden_norm.weight", "hidden_norm/scale", False),
) + tuple((f"midlayer.{n}", p, t) for n, p, t in _ATTN + _POST_NORM + _MLP) + (
    ("norm.weight", "norm/scale", False),
    ("lm_head.weight", "lm_head/kernel", True),
)
EAGLE3_FC_NORM = {
    "none": (),
    "full": (("fc_norm.weight", "fc_norm/scale", False),),
    "per_chunk": tuple((f"fc_norm_{i}.weight", f"fc_norm_{i}/scale", False) for i in range(3)),
}

# Under ``model.layers.{L+k}.``; param paths under ``module_{k}``.
MTP_TABLE = (
    ("enorm.weight", "enorm/scale", False),
    ("hnorm.weight", "hnorm/scale", False),
    ("eh_proj.weight", "eh_proj/kernel", True),
    ("input_layernorm.weight", "block/input_layernorm/scale", False),
) + tuple((n, f"block/{p}", t) for n, p, t in _ATTN + _POST_NORM + _MLP) + (
    ("shared_head.norm.weight", "shared_head_norm/scale", False),
)
MTP_HEAD = (("shared_head.head.weight", "shared_head_head/kernel", True),)

# {i}: head, {j}: residual block, {L}: number of blocks.
MEDUSA_TABLES = {
    "fasterdecoding": ((("{i}.{j}.linear.weight", "head_{i}_block_{j}/kernel", True),
                        ("{i}.{j}.linear.bias", "head_{i}_block_{j}/bias", False)),
                       ("{i}.{L}.weight", "head_{i}_lm/kernel", True)),
    "vllm": ((("blocks.{i}.layers.{j}.weight", "head_{i}_block_{j}/kernel", True),
              ("blocks.{i}.layers.{j}.bias", "head_{i}_block_{j}/bias", False)),
             ("lm_heads.{i}.weight", "head_{i}_lm/kernel", True)),
}


def _rows(rows, name_prefix: str = "", path_prefix: str = "net") -> list[Row]:
    return [(name_prefix + n, tuple(f"{path_prefix}/{p}".split("/")), t) for n, p, t in rows]


def hf_table(module, layout: str | None = None, num_target_layers: int | None = None) -> list[Row]:
    """Every HF tensor ``module``'s parameter tree needs (index maps excluded), in order."""
    kind = module.kind
    if kind == "eagle1":
        return _rows(EAGLE1_TABLE + (EAGLE1_BIAS if module.fc_bias else ()))
    if kind == "eagle3":
        return _rows(EAGLE3_TABLE[:1] + EAGLE3_FC_NORM[module.fc_norm] + EAGLE3_TABLE[1:])
    if kind == "mtp":
        if num_target_layers is None:
            raise ValueError("the MTP layout needs the target's num_layers")
        out = []
        for k in range(module.num_modules):
            rows = MTP_TABLE + (MTP_HEAD if module.own_head else ())
            out += _rows(rows, f"model.layers.{num_target_layers + k}.", f"net/module_{k}")
        return out
    if kind == "medusa":
        layout = layout or "fasterdecoding"
        if layout not in MEDUSA_TABLES:
            raise ValueError(f"medusa layout {layout!r}: one of {MEDUSA_TABLES}")
        block, lm = MEDUSA_TABLES[layout]
        L = module.num_layers
        rows = []
        for i in range(module.num_heads):
            for j in range(L):
                rows += [(n.format(i=i, j=j), p.format(i=i, j=j), t) for n, p, t in block]
            if module.vocab_size:
                rows.append((lm[0].format(i=i, L=L), lm[1].format(i=i), lm[2]))
        return _rows(rows)
    raise ValueError(f"no HF layout for drafter kind {kind!r}")


# ---------------------------------------------------------------- tensor files
class _Tensors(SafetensorsDir):
    """:class:`SafetensorsDir` seen through a name prefix (e.g. ``"model."`` when a
    drafter's tensors were saved under a wrapper module)."""

    def __init__(self, d: Path):
        super().__init__(d, any_single_file=True)
        self.prefix = ""

    def keys(self) -> list[str]:
        n = len(self.prefix)
        return [k[n:] for k in self._where if k.startswith(self.prefix)]

    def __contains__(self, name) -> bool:
        return self.prefix + name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return super().shape(self.prefix + name)

    def get(self, name: str) -> np.ndarray:
        return self[self.prefix + name]

    def sharded(self, name: str, sharding, dtype, transpose: bool = False):
        return super().sharded(self.prefix + name, sharding, dtype, transpose)


# ------------------------------------------------------------------- detection
_MEDUSA_FD = re.compile(r"\d+\.\d+\.linear\.weight")
_MTP_KEY = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight")


def _detect_from_keys(keys) -> str | None:
    ks = set(keys)
    if any(k.startswith("midlayer.") for k in ks):
        return "eagle3"
    if any(_MTP_KEY.fullmatch(k) for k in ks):
        return "mtp"
    if any(k.startswith(("blocks.", "lm_heads.")) or _MEDUSA_FD.fullmatch(k) for k in ks):
        return "medusa"
    if "fc.weight" in ks and any(k.startswith("layers.0.") for k in ks):
        return "eagle1"
    return None


def _detect_from_config(d: dict) -> str | None:
    archs = " ".join(d.get("architectures") or []).lower()
    if "draft_vocab_size" in d or "eagle_config" in d or "eagle3" in archs:
        return "eagle3"
    if d.get("num_nextn_predict_layers"):
        return "mtp"
    if "medusa_num_heads" in d or "medusa" in archs:
        return "medusa"
    if "eagle" in archs:
        return "eagle1"
    return None


def _resolve_kind(d: dict, ts: _Tensors, kind: str | None) -> str:
    """Pick the kind (and the key prefix, set on ``ts``)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind={kind!r}: one of {sorted(KINDS)}")
    keys = ts.keys()
    for prefix in ("", "model.", "medusa_head."):
        sub = [k[len(prefix):] for k in keys if k.startswith(prefix)]
        found = _detect_from_keys(sub)
        if found is not None and (kind is None or found == kind):
            ts.prefix = prefix
            return found
    found = kind or _detect_from_config(d)
    if found is None:
        raise CheckpointError(
            "cannot tell which drafter this checkpoint holds (pass kind=); tensors: "
            f"{sorted(keys)[:8]}")
    return found


def detect_drafter_kind(path: str | os.PathLike) -> str:
    """``"eagle1"``, ``"eagle3"``, ``"mtp"`` or ``"medusa"`` for a drafter directory."""
    d = Path(path)
    if (d / DRAFTER_CONFIG_FILE).is_file():
        return _read_meta(d)["kind"]
    cfg = _read_config(d)
    with _Tensors(d) as ts:
        return _resolve_kind(cfg, ts, None)


# ------------------------------------------------------------- config -> spec
def _read_config(d: Path) -> dict:
    f = d / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{d}: no config.json (nor {DRAFTER_CONFIG_FILE})")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: not a JSON object")
    return cfg


def _int_field(d: dict, *names, default=None):
    for n in names:
        v = d.get(n)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"drafter config field {n!r} must be an int, got {v!r}")
            return v
    return default


def _layer_config(d: dict, target: LlamaConfig, dtype: str, hidden: int | None = None
                  ) -> LlamaConfig:
    """The drafter's one-layer decoder config: its config.json's fields, else the target's."""
    ov: dict[str, Any] = {"dtype": dtype}
    hidden = _int_field(d, "hidden_size", default=hidden)
    if hidden is not None:
        ov["hidden_size"] = hidden
    for field, key in (("intermediate_size", "intermediate_size"),
                       ("num_heads", "num_attention_heads"),
                       ("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim")):
        v = _int_field(d, key)
        if v is not None:
            ov[field] = v
    if "head_dim" not in ov and "num_heads" in ov:
        ov["head_dim"] = ov.get("hidden_size", target.hidden_size) // ov["num_heads"]
    if "num_heads" in ov and "num_kv_heads" not in ov:
        ov["num_kv_heads"] = ov["num_heads"]
    if d.get("rms_norm_eps") is not None:
        ov["rms_norm_eps"] = float(d["rms_norm_eps"])
    if any(d.get(k) is not None for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        ov["rope"] = rope_from_hf(d)
    return draft_layer_config(target, **ov)


def _dtype_name(dtype, target: LlamaConfig) -> str:
    if dtype is None:
        return target.dtype
    try:
        return np.dtype(jax.numpy.dtype(dtype)).name
    except TypeError as e:
        raise ConfigError(f"dtype={dtype!r} is not a dtype") from e


def _shape_or(ts: _Tensors, name: str, axis: int, default):
    return ts.shape(name)[axis] if name in ts else default


def _eagle1(d, ts, target, dtype):
    hidden = _shape_or(ts, "fc.weight", 0, None)
    has_bias = "fc.bias" in ts
    bias = d.get("bias")
    if bias is None:
        bias = has_bias
    elif not bias and has_bias:
        raise CheckpointError("checkpoint has tensor 'fc.bias' but config.json says bias=false")
    module = Eagle1(_layer_config(d, target, dtype, hidden),
                    _int_field(d, "vocab_size", default=target.vocab_size), fc_bias=bool(bias))
    return module, {}


def _eagle3_aux(d, target: LlamaConfig, aux_layers) -> tuple[int, ...]:
    if aux_layers is not None:
        return tuple(int(i) for i in aux_layers)
    field, ids = "eagle_config.eagle_aux_hidden_state_layer_ids", None
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


def _eagle3(d, ts, target, dtype, aux_layers=None):
    hidden = _shape_or(ts, "fc.weight", 0, None)
    V = _int_field(d, "vocab_size", default=target.vocab_size)
    Vd = _int_field(d, "draft_vocab_size", default=_shape_or(ts, "lm_head.weight", 0, V))
    fc_norm = d.get("fc_norm")
    found = ("full" if "fc_norm.weight" in ts else
             "per_chunk" if any(f"fc_norm_{i}.weight" in ts for i in range(3)) else "none")
    if fc_norm is None:
        fc_norm = found
    elif fc_norm not in EAGLE3_FC_NORM:
        raise ConfigError(f"config field 'fc_norm'={fc_norm!r}: one of {sorted(EAGLE3_FC_NORM)}")
    elif found != "none" and found != fc_norm:
        raise CheckpointError(f"config.json says fc_norm={fc_norm!r} but the checkpoint has "
                              f"{found!r} fc_norm tensors")
    module = Eagle3(_layer_config(d, target, dtype, hidden), V,
                    aux_layers=_eagle3_aux(d, target, aux_layers), vocab_size=0 if Vd == V else Vd,
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
    return module, extra


def _mtp(d, ts, target, dtype):
    L = _int_field(d, "num_hidden_layers", default=target.num_layers)
    if L != target.num_layers:
        raise DrafterMismatchError(
            f"config field 'num_hidden_layers'={L}: these MTP layers follow a {L}-layer model, "
            f"the target has {target.num_layers} layers")
    present = sorted(int(m.group(1)) for k in ts.keys() if (m := _MTP_KEY.fullmatch(k)))
    M = _int_field(d, "num_nextn_predict_layers")
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
    V = _int_field(d, "vocab_size", default=_shape_or(
        ts, f"model.layers.{L}.shared_head.head.weight", 0, target.vocab_size))
    module = MTP(_layer_config(d, target, dtype, _shape_or(ts, eh, 0, None)), V, num_modules=M,
                 own_head=all(heads))
    return module, {}


def _medusa_layout(ts: _Tensors) -> str:
    return "vllm" if any(k.startswith(("blocks.", "lm_heads.")) for k in ts.keys()) else "fasterdecoding"


def _medusa(d, ts, target, dtype):
    layout = _medusa_layout(ts)
    keys = ts.keys()
    if layout == "vllm":
        heads = _int_field(d, "medusa_num_heads", "num_heads")
        layers = _int_field(d, "medusa_num_layers", "num_hidden_layers")
        if heads is None:
            heads = len({k.split(".")[1] for k in keys if k.startswith("lm_heads.")})
        if layers is None:
            layers = len({k.split(".")[3] for k in keys
                          if re.fullmatch(r"blocks\.0\.layers\.\d+\.weight", k)})
        lm0, blk0 = "lm_heads.0.weight", "blocks.0.layers.0.weight"
    else:
        heads = _int_field(d, "medusa_num_heads")
        layers = _int_field(d, "medusa_num_layers")
        if heads is None:
            heads = len({k.split(".")[0] for k in keys if re.fullmatch(r"\d+\..*", k)})
        if layers is None:
            layers = len({k.split(".")[1] for k in keys if re.fullmatch(r"0\.\d+\.linear\.weight", k)})
        lm0, blk0 = f"0.{layers}.weight", "0.0.linear.weight"
    if not heads:
        raise CheckpointError(f"no Medusa heads found ({layout} layout)")
    hidden = _int_field(d, "hidden_size", default=_shape_or(
        ts, blk0, 0, _shape_or(ts, lm0, 1, target.hidden_size)))
    truncated_size = _int_field(d, "truncated_vocab_size")
    V = target.vocab_size
    if layout == "vllm":
        V = _int_field(d, "vocab_size", default=V)
    Vd = _shape_or(ts, lm0, 0, truncated_size or V)
    if truncated_size is not None and truncated_size != Vd and lm0 in ts:
        raise CheckpointError(f"config field truncated_vocab_size={truncated_size} but tensor "
                              f"{lm0!r} predicts {Vd} tokens")
    extra = {}
    truncated = False
    if "token_map" in ts:
        shape = ts.shape("token_map")
        if shape != (Vd,):
            raise DrafterMismatchError(
                f"token_map has shape {shape}, expected ({Vd},) (one target id per draft id)")
        tm = np.asarray(ts.get("token_map")).astype(np.int64)
        check_token_map(tm, Vd, target.vocab_size)
        if not (Vd == target.vocab_size and np.array_equal(tm, np.arange(Vd))):
            truncated = True
            extra["token_map"] = jax.numpy.asarray(tm.astype(np.int32))
    elif Vd != V:
        if truncated_size is not None:
            raise CheckpointError(f"config truncated_vocab_size={truncated_size} but the "
                                  "checkpoint has no 'token_map' tensor")
    module = Medusa(num_heads=heads, num_layers=layers, hidden=hidden, target_vocab=V,
                    vocab_size=Vd, truncated=truncated, dtype=dtype)
    return module, extra, layout


# ---------------------------------------------------------------------- loading
def _expected(module, target: LlamaConfig) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Flat ``{path: ShapeDtypeStruct}`` of the tree ``module.init_params`` builds."""
    tree = jax.eval_shape(lambda k: module.init_params(k, target), jax.random.key(0))
    return flatten(nn.unbox(tree))


def _hf_shape(shape, transpose):
    return tuple(reversed(shape)) if transpose else tuple(shape)


def _as_config(target) -> LlamaConfig:
    return target.config if hasattr(target, "config") else target


def load_drafter(path: str | os.PathLike, target_config, dtype=None, *, kind: str | None = None,
                 aux_layers=None, mesh=None) -> Drafter:
    """Load a drafter for ``target_config`` (a :class:`LlamaConfig` or a ``Target``).

    ``kind`` forces the layout (``"eagle1"``, ``"eagle3"``, ``"mtp"``, ``"medusa"``);
    ``aux_layers`` overrides EAGLE-3's aux layers, in jspec's input-of-layer convention.
    ``dtype`` defaults to the target's. Raises :class:`DrafterMismatchError` or
    :class:`CheckpointError` (naming the field or tensor) before anything is compiled.
    A ``jspec_calibration.json`` beside the weights (``python -m jspec.train calibrate``)
    is attached for ``SpecConfig(selection="calibrated")``. ``mesh``: parameters placed by
    :func:`jspec.sharding.drafter_shardings` (a jspec Orbax drafter is restored straight into
    them; HF layouts are read slice by slice into them).
    """
    drafter = _load_drafter(path, target_config, dtype, kind=kind, aux_layers=aux_layers,
                            mesh=mesh)
    try:
        table = calibration.load(path)
    except (calibration.CalibrationError, ValueError, KeyError) as e:
        raise CheckpointError(f"{Path(path) / calibration.FILENAME}: {e}") from e
    return drafter if table is None else calibration.attach(drafter, table)


def _load_drafter(path, target_config, dtype=None, *, kind=None, aux_layers=None,
                  mesh=None) -> Drafter:
    target = _as_config(target_config)
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"{d}: no such file or directory")
    if not d.is_dir():
        raise CheckpointError(f"{d}: a drafter checkpoint is a directory")
    dtype = _dtype_name(dtype, target)
    if (d / DRAFTER_CONFIG_FILE).is_file():
        drafter = _load_orbax(d, target, dtype, mesh)
        if kind is not None and drafter.kind != kind:
            raise CheckpointError(f"{d}: holds a {drafter.kind} drafter, kind={kind!r} was asked for")
        return dataclasses.replace(drafter, source=str(d))
    cfg = _read_config(d)
    with _Tensors(d) as ts:
        k = _resolve_kind(cfg, ts, kind)
        layout = None
        if k == "eagle1":
            module, extra = _eagle1(cfg, ts, target, dtype)
        elif k == "eagle3":
            module, extra = _eagle3(cfg, ts, target, dtype, aux_layers)
        elif k == "mtp":
            module, extra = _mtp(cfg, ts, target, dtype)
        else:
            module, extra, layout = _medusa(cfg, ts, target, dtype)
        if aux_layers is not None and k != "eagle3":
            raise ValueError(f"aux_layers= applies to eagle3 drafters, this is {k}")
        module.validate(target)                     # hidden size, vocabulary, aux layers
        expected = _expected(module, target)
        table = hf_table(module, layout, target.num_layers)
        _check_table_covers(module, table, expected, extra)
        # Every shape from the headers first, so a bad file fails before data is read.
        for name, p, t in table:
            want = _hf_shape(expected[p].shape, t)
            if name not in ts:
                raise CheckpointError(f"checkpoint is missing tensor {ts.prefix + name!r} "
                                      f"(expected shape {want})")
            check_shape(ts.prefix + name, want, ts.shape(name))
        flat, sh = {}, None
        if mesh is not None:      # each device's block read by slice, as the target's
            from jspec.sharding import drafter_shardings
            sh = flatten(drafter_shardings(Drafter(module, unflatten(expected)), target, mesh))
        for name, p, t in table:
            dt = np.dtype(expected[p].dtype).name
            if sh is not None:
                flat[p] = ts.sharded(name, sh[p], dt, t)
            else:
                arr = np.asarray(ts.get(name))
                flat[p] = to_param(arr.T if t else arr, dt)
    params = unflatten(flat)
    params.update(extra)
    module.validate(target, params)                 # index maps (d2t, token_map)
    drafter = Drafter(module, params, source=str(d))
    if mesh is not None:          # the small maps in ``extra`` are replicated
        from jspec.sharding import shard_drafter
        drafter = shard_drafter(drafter, target, mesh)
    return drafter


def _check_table_covers(module, table, expected, extra) -> None:
    have = {p for _, p, _ in table} | {(k,) for k in extra}
    want = set(expected)
    if module.kind == "eagle3":
        have.discard(("d2t",))
        want.discard(("d2t",))
    if have != want:   # a bug in the tables, not in the checkpoint
        raise AssertionError(f"{module.kind} table/param tree mismatch: "
                             f"{sorted(map(path_str, have ^ want))}")


# ------------------------------------------------------------------ Orbax format
def _module_fields(module) -> dict:
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
            if f.name != "layer" and not f.metadata.get("runtime")}


def save_drafter(drafter: Drafter, path: str | os.PathLike, overwrite: bool = False) -> None:
    """Write jspec's drafter format: ``jspec_drafter.json`` + Orbax params, atomically."""
    module = drafter.module
    if module.kind not in KINDS:
        raise ValueError(f"cannot save a {module.kind!r} drafter (one of {sorted(KINDS)})")
    dst = Path(path).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists (pass overwrite=True to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    meta = {"jspec": {"format": FORMAT, "version": VERSION, "params": PARAMS_DIR},
            "kind": module.kind, "module": _module_fields(module)}
    if hasattr(module, "layer"):
        meta["layer"] = module.layer.to_hf()
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        (tmp / DRAFTER_CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        ckptr = ocp.PyTreeCheckpointer()
        params = dict(nn.unbox(drafter.params))
        table = params.pop(calibration.PARAM_KEY, None)
        ckptr.save(tmp / PARAMS_DIR, jax.tree_util.tree_map(np.asarray, params))
        ckptr.close()
        if table is not None:
            calibration.save(tmp, np.asarray(table), {"saved_with": "save_drafter"})
        move_into_place(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_meta(d: Path) -> dict:
    f = d / DRAFTER_CONFIG_FILE
    try:
        meta = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: cannot read ({e})") from e
    info = meta.get("jspec") if isinstance(meta, dict) else None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a jspec drafter checkpoint (no jspec.format={FORMAT!r})")
    if info.get("version") != VERSION:
        raise CheckpointError(f"{f}: jspec.version={info.get('version')!r}, this build reads "
                              f"version {VERSION}")
    if meta.get("kind") not in KINDS:
        raise CheckpointError(f"{f}: kind={meta.get('kind')!r}, one of {sorted(KINDS)}")
    return meta


def _load_orbax(d: Path, target: LlamaConfig, dtype: str, mesh=None) -> Drafter:
    d = d.absolute()
    meta = _read_meta(d)
    cls = KINDS[meta["kind"]]
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in meta.get("module", {}).items()}
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"{d / DRAFTER_CONFIG_FILE}: unknown {meta['kind']} fields {unknown}")
    if "layer" in known:
        if "layer" not in meta:
            raise CheckpointError(f"{d / DRAFTER_CONFIG_FILE}: no 'layer' config")
        fields["layer"] = LlamaConfig.from_hf(meta["layer"], dtype=dtype)
    if "dtype" in known:
        fields["dtype"] = dtype
    try:
        module = cls(**fields)
    except TypeError as e:
        raise CheckpointError(f"{d / DRAFTER_CONFIG_FILE}: bad {meta['kind']} fields ({e})") from e
    module.validate(target)
    expected = _expected(module, target)
    ckptr = ocp.PyTreeCheckpointer()
    pdir = d / meta["jspec"].get("params", PARAMS_DIR)
    try:
        stored = flatten(ckptr.metadata(pdir).item_metadata.tree)
    except Exception as e:
        raise CheckpointError(f"{pdir}: cannot read Orbax metadata ({e})") from e
    # A d2t over the full vocabulary (a permutation) is optional: absent means the identity.
    optional = {("d2t",)} if getattr(module, "map_key", None) == "d2t" else set()
    for p, leaf in expected.items():
        if p not in stored:
            raise CheckpointError(f"checkpoint is missing tensor {path_str(p)!r} "
                                  f"(expected shape {tuple(leaf.shape)})")
        if p != ("d2t",):     # d2t's length is checked (and named) by validate
            check_shape(path_str(p), leaf.shape, stored[p].shape)
    extra = sorted(path_str(p) for p in stored if p not in expected and p not in optional)
    if extra:
        raise CheckpointError(f"checkpoint has tensors the {module.kind} spec does not: {extra[:5]}")
    want = {p: np.dtype(expected[p].dtype if p in expected else np.int32) for p in stored}
    if mesh is not None:
        # Straight into the shardings its layers' logical axes give (jspec.sharding).
        from jspec.sharding import drafter_shardings
        shapes = unflatten({p: jax.ShapeDtypeStruct(stored[p].shape, want[p]) for p in stored})
        sh = flatten(drafter_shardings(Drafter(module, shapes), target, mesh))
        params = unflatten(restore_sharded(ckptr, pdir, sh, want))
    else:
        raw = restore_numpy(ckptr, pdir, stored)
        params = unflatten({p: to_param(arr, want[p].name) for p, arr in raw.items()})
    module.validate(target, params)
    return Drafter(module, params)


# ------------------------------------------------------------------ HF writing
def state_dict_from_drafter(drafter: Drafter, layout: str | None = None,
                            num_target_layers: int | None = None) -> dict[str, np.ndarray]:
    """HF-named host arrays for ``drafter`` (inverse of the load tables)."""
    module = drafter.module
    flat = flatten(nn.unbox(drafter.params))
    out = {}
    for name, p, t in hf_table(module, layout, num_target_layers):
        arr = np.asarray(flat[p])
        out[name] = np.ascontiguousarray(arr.T if t else arr)
    if ("d2t",) in flat:
        out["d2t"] = np.asarray(flat[("d2t",)]).astype(np.int64)
    if ("token_map",) in flat:
        out["token_map"] = np.asarray(flat[("token_map",)]).astype(np.int64)
    return out


def _layer_fields(layer: LlamaConfig) -> dict:
    d = layer.to_hf()
    return {k: d[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                              "rope_scaling", "torch_dtype")}


def save_hf_drafter(drafter: Drafter, path: str | os.PathLike, layout: str | None = None,
                    target_config=None) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the drafter's published layout.

    ``layout``: for Medusa ``"fasterdecoding"`` (default) or ``"vllm"`` (needed for a
    truncated vocabulary). MTP needs ``target_config`` (its layers sit after the target's).
    """
    module = drafter.module
    kind = module.kind
    L = None
    if kind == "mtp":
        if target_config is None:
            raise ValueError("save_hf_drafter of an MTP drafter needs target_config")
        L = _as_config(target_config).num_layers
    if kind in ("eagle1", "mtp") and module.vocab_size:
        raise ValueError(f"a draft-vocabulary {kind} drafter (vocab_size={module.vocab_size}) has "
                         "no published layout: save it with save_drafter (jspec's Orbax format)")
    if kind == "medusa":
        layout = layout or ("vllm" if module.truncated else "fasterdecoding")
        if module.truncated and layout != "vllm":
            raise ValueError("a truncated-vocabulary Medusa drafter needs layout='vllm'")
        if not module.vocab_size:
            raise ValueError("Medusa heads without their own LM head have no HF layout")
    tensors = state_dict_from_drafter(drafter, layout, L)
    if kind == "eagle1":
        cfg = {"architectures": ["EagleForCausalLM"], **_layer_fields(module.layer),
               "num_hidden_layers": 1, "vocab_size": module.target_vocab, "bias": module.fc_bias}
    elif kind == "eagle3":
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], **_layer_fields(module.layer),
               "num_hidden_layers": 1, "vocab_size": module.target_vocab,
               "draft_vocab_size": module.draft_vocab,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                [i - 1 for i in module.aux_layers]},
               "norm_before_residual": module.norm_before_residual}
        if module.fc_norm != "none":
            cfg["fc_norm"] = module.fc_norm
    elif kind == "mtp":
        cfg = {**_layer_fields(module.layer), "num_hidden_layers": L,
               "vocab_size": module.target_vocab, "num_nextn_predict_layers": module.num_modules}
    elif kind == "medusa":
        if layout == "vllm":
            cfg = {"architectures": ["MedusaModel"], "model_type": "medusa",
                   "hidden_size": module.hidden, "vocab_size": module.target_vocab,
                   "num_heads": module.num_heads, "num_hidden_layers": module.num_layers,
                   "truncated_vocab_size": module.vocab_size if module.truncated else None}
        else:
            cfg = {"medusa_num_heads": module.num_heads, "medusa_num_layers": module.num_layers,
                   "hidden_size": module.hidden}
    else:
        raise ValueError(f"no HF layout for drafter kind {kind!r}")
    dst = Path(path).absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        move_into_place(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["load_drafter", "save_drafter", "save_hf_drafter", "detect_drafter_kind",
           "state_dict_from_drafter", "hf_table", "DRAFTER_CONFIG_FILE"]
