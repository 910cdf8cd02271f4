"""jspec's own drafter format, for every kind that registers as ``saveable``.

``jspec_drafter.json`` (format, version, kind, the architecture's static fields, the
decoder layer's config) + Orbax params (the draft heads, the ``d2t`` / ``token_map`` map
among them), written to a hidden sibling directory and renamed into place. Every stored
tensor's shape is checked against the architecture's before any data is read; the map's
length and range by its ``validate``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp

from jspec.checkpoint.common import (CheckpointError, check_shape, flatten, path_str, to_param,
                                     unflatten)
from jspec.checkpoint import orbax_io
from jspec.checkpoint.orbax_io import atomic_dir, restore_numpy, restore_sharded, stored_tensors
from jspec.config import LlamaConfig
from jspec.drafters import registry
from jspec.drafters.drafter import Drafter
from jspec.drafters.hf_io import expected_params
from jspec.drafters import calibration

CONFIG_FILE = "jspec_drafter.json"
FORMAT = "jspec-drafter-orbax"
VERSION = 1
PARAMS_DIR = "params"
# Fields older jspec versions wrote for kinds that no longer have them (value: what they held).
LEGACY_FIELDS = {"aux_layers": ()}


def _module_fields(module) -> dict:
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
            if f.name != "layer" and not f.metadata.get("runtime")}


def _saveable() -> list[str]:
    return sorted(registry.names(lambda k: k.saveable))


def _local_checkpointer():
    """An Orbax checkpointer that this process runs alone: a drafter is host values, and in
    a multi-host run one process writes it (the others must not be waited for)."""
    if jax.process_count() == 1:
        return ocp.PyTreeCheckpointer()
    me = jax.process_index()
    mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=mp),
                            multiprocessing_options=mp)


def save_drafter(drafter, path, overwrite: bool = False) -> None:
    """Write jspec's drafter format: ``jspec_drafter.json`` + Orbax params, atomically."""
    module = drafter.module
    if not registry.of(drafter).saveable:
        raise ValueError(f"cannot save a {module.kind!r} drafter (one of {_saveable()})")
    meta = {"jspec": {"format": FORMAT, "version": VERSION, "params": PARAMS_DIR},
            "kind": module.kind, "module": _module_fields(module)}
    if hasattr(module, "layer"):
        meta["layer"] = module.layer.to_hf()
    with atomic_dir(path, overwrite) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        ckptr = _local_checkpointer()
        params = dict(nn.unbox(drafter.params))
        model = params.pop(calibration.PARAM_KEY, None)
        ckptr.save(tmp / PARAMS_DIR, jax.tree_util.tree_map(np.asarray, params))
        ckptr.close()
        if model is not None:
            calibration.save(tmp, model, {"saved_with": "save_drafter"})


def read_meta(d: Path) -> dict:
    f = d / CONFIG_FILE
    meta = orbax_io.read_meta(d, CONFIG_FILE, FORMAT, VERSION, "jspec drafter checkpoint")
    if meta.get("kind") not in _saveable():
        raise CheckpointError(f"{f}: kind={meta.get('kind')!r}, one of {_saveable()}")
    return meta


def _architecture(d: Path, meta: dict, dtype: str):
    cls = registry.kind(meta["kind"]).module
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in meta.get("module", {}).items()}
    known = {f.name for f in dataclasses.fields(cls)}
    for k, empty in LEGACY_FIELDS.items():
        if k not in known and fields.get(k, empty) == empty:
            fields.pop(k, None)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"{d / CONFIG_FILE}: unknown {meta['kind']} fields {unknown}")
    if "layer" in known:
        if "layer" not in meta:
            raise CheckpointError(f"{d / CONFIG_FILE}: no 'layer' config")
        fields["layer"] = LlamaConfig.from_hf(meta["layer"], dtype=dtype)
    if "dtype" in known:
        fields["dtype"] = dtype
    try:
        return cls(**fields)
    except TypeError as e:
        raise CheckpointError(f"{d / CONFIG_FILE}: bad {meta['kind']} fields ({e})") from e


def load_orbax(d: Path, target: LlamaConfig, dtype: str, mesh=None):
    """``(module, params)`` of the jspec drafter in ``d``."""
    d = d.absolute()
    meta = read_meta(d)
    module = _architecture(d, meta, dtype)
    module.validate(target)
    expected = expected_params(module, target)
    ckptr = ocp.PyTreeCheckpointer()
    pdir = d / meta["jspec"].get("params", PARAMS_DIR)
    stored = stored_tensors(ckptr, pdir)
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
        raise CheckpointError(f"checkpoint has tensors the {module.kind} architecture does not: "
                              f"{extra[:5]}")
    want = {p: np.dtype(expected[p].dtype if p in expected else np.int32) for p in stored}
    if mesh is not None:
        # Straight into the shardings its layers' logical axes give (jspec.sharding).
        shapes = unflatten({p: jax.ShapeDtypeStruct(stored[p].shape, want[p]) for p in stored})
        sh = flatten(Drafter(module, shapes).shardings(target, mesh))
        params = unflatten(restore_sharded(ckptr, pdir, sh, want))
    else:
        raw = restore_numpy(ckptr, pdir, stored)
        params = unflatten({p: to_param(arr, want[p].name) for p, arr in raw.items()})
    module.validate(target, params)
    return module, params
