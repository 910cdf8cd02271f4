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

jspec's own format (:func:`save_drafter`) is :mod:`jspec.drafters.orbax_format`; the HF
layouts are read and written by :mod:`jspec.drafters.hf_io`, each kind's described in its
own file's registry entry.
"""

from __future__ import annotations

import os
from pathlib import Path

from jspec.checkpoint.common import CheckpointError
from jspec.config import LlamaConfig
from jspec.drafters import hf_io, orbax_format, registry, vocab
from jspec.drafters.drafter import Drafter
from jspec.drafters.hf_io import save_hf_drafter, state_dict_from_drafter
from jspec.drafters.hf_layout import Tensors, dtype_name, read_config
from jspec.drafters.orbax_format import CONFIG_FILE as DRAFTER_CONFIG_FILE
from jspec.drafters.orbax_format import save_drafter
from jspec.drafters import calibration as _calibration


def _claimed(d: Path) -> registry.DrafterKind | None:
    """The kind that claims a directory that is not a drafter checkpoint (a draft model's)."""
    return next((k for k in registry.KINDS.values() if k.claims is not None and k.claims(d)), None)


def detect_drafter_kind(path: str | os.PathLike) -> str:
    """The kind of drafter a directory holds (``"eagle3"``, ``"medusa"``, ...)."""
    d = Path(path)
    if (d / DRAFTER_CONFIG_FILE).is_file():
        return orbax_format.read_meta(d)["kind"]
    claimed = _claimed(d)
    if claimed is not None:
        return claimed.name
    cfg = read_config(d, DRAFTER_CONFIG_FILE)
    with Tensors(d) as ts:
        return hf_io.resolve_kind(cfg, ts, None).name


def _as_config(target) -> LlamaConfig:
    return target.config if hasattr(target, "config") else target


def load_drafter(path: str | os.PathLike, target_config, dtype=None, *, kind: str | None = None,
                 aux_layers=None, mesh=None, calibration: bool = True) -> Drafter:
    """Load a drafter for ``target_config`` (a :class:`LlamaConfig` or a ``Target``).

    ``kind`` forces the layout (``"eagle1"``, ``"eagle3"``, ``"mtp"``, ``"medusa"``), or
    names a kind with its own loader (``"model"``: any Llama checkpoint as a draft model);
    ``aux_layers`` overrides EAGLE-3's aux layers, in jspec's input-of-layer convention.
    ``dtype`` defaults to the target's. Raises :class:`DrafterMismatchError` or
    :class:`CheckpointError` (naming the field or tensor) before anything is compiled.
    A ``d2t`` that is all zeros over a reduced draft vocabulary (the map of a buffer saved
    before it was filled) loads, with a warning on the ``"jspec"`` logger.
    A ``jspec_calibration.json`` beside the weights (``python -m jspec.train calibrate``)
    is attached for ``SpecConfig(selection="calibrated")``, unless ``calibration=False``
    (the calibrate command itself, which replaces it). ``mesh``: parameters placed by
    :meth:`jspec.drafters.Drafter.shardings` (a jspec Orbax drafter is restored straight into
    them; HF layouts are read slice by slice into them).
    """
    drafter = _load_drafter(path, target_config, dtype, kind=kind, aux_layers=aux_layers,
                            mesh=mesh)
    vocab.warn_zero_d2t(drafter.module, drafter.params, _as_config(target_config).vocab_size,
                        path)
    if not calibration:
        return drafter
    try:
        model = _calibration.load(path)
        return drafter if model is None else _calibration.attach(drafter, model)
    except (_calibration.CalibrationError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{Path(path) / _calibration.FILENAME}: {e}") from e


def _load_drafter(path, target_config, dtype=None, *, kind=None, aux_layers=None,
                  mesh=None) -> Drafter:
    target = _as_config(target_config)
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"{d}: no such file or directory")
    if not d.is_dir():
        raise CheckpointError(f"{d}: a drafter checkpoint is a directory")
    dtype = dtype_name(dtype, target)
    if (d / DRAFTER_CONFIG_FILE).is_file():
        # Restored straight into the mesh's shardings, maps included.
        module, params = orbax_format.load_orbax(d, target, dtype, mesh)
        if kind is not None and module.kind != kind:
            raise CheckpointError(f"{d}: holds a {module.kind} drafter, kind={kind!r} was asked for")
        if aux_layers is not None and tuple(aux_layers) != module.target_layers:
            raise ValueError(f"aux_layers={tuple(aux_layers)}: a jspec checkpoint stores its "
                             f"own ({module.target_layers})")
        return Drafter(module, params, source=str(d))
    entry = registry.kind(kind) if kind is not None else _claimed(d)
    if entry is not None and entry.load is not None:
        if aux_layers is not None:
            raise ValueError(f"aux_layers= does not apply to a {entry.name} drafter")
        module, params = entry.load(d, target_config, dtype)
    else:
        cfg = read_config(d, DRAFTER_CONFIG_FILE)
        module, params = hf_io.load_hf(d, cfg, target, dtype, kind, mesh, aux_layers=aux_layers)
    drafter = Drafter(module, params, source=str(d))
    if mesh is not None:          # what the reader did not place (the small maps) is replicated
        drafter = drafter.placed(target, mesh)
    return drafter

__all__ = ["load_drafter", "save_drafter", "save_hf_drafter", "detect_drafter_kind",
           "state_dict_from_drafter", "DRAFTER_CONFIG_FILE"]
