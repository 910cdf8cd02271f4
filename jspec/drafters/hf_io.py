"""Reading and writing drafters in their published Hugging Face layouts, for every kind
alike: each kind describes its layout (:class:`jspec.drafters.hf_layout.HFLayout`) in its
registry entry, and this module detects, checks and converts.

Directory: ``config.json`` + ``model.safetensors`` / a sharded
``model.safetensors.index.json`` / a single other ``*.safetensors`` file. The kind is
detected from the tensor names (also under a ``model.`` or ``medusa_head.`` wrapper
prefix), then from the config, or forced with ``kind=``. Every tensor's shape is checked
from the safetensors headers before any tensor data is read; failures name the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
from safetensors.numpy import save_file

from jspec.checkpoint.common import CheckpointError, check_shape, flatten, path_str, to_param, unflatten
from jspec.checkpoint.orbax_io import atomic_dir
from jspec.config import LlamaConfig
from jspec.drafters import registry
from jspec.drafters.drafter import Drafter
from jspec.drafters.hf_layout import Tensors

PREFIXES = ("", "model.", "medusa_head.")


def _layouts() -> list[registry.DrafterKind]:
    return sorted((k for k in registry.KINDS.values() if k.hf is not None),
                  key=lambda k: k.hf.priority)


def resolve_kind(cfg: dict, ts: Tensors, kind: str | None) -> registry.DrafterKind:
    """The kind whose layout this is (and the key prefix, set on ``ts``)."""
    if kind is not None:
        entry = registry.kind(kind)
        if entry.hf is None:
            raise ValueError(f"a {kind} drafter has no Hugging Face layout")
    keys = ts.keys()
    for prefix in PREFIXES:
        sub = {k[len(prefix):] for k in keys if k.startswith(prefix)}
        for entry in _layouts():
            if entry.hf.detect_keys(sub) and (kind is None or entry.name == kind):
                ts.prefix = prefix
                return entry
    if kind is not None:
        return registry.kind(kind)
    for entry in _layouts():
        if entry.hf.detect_config(cfg):
            return entry
    raise CheckpointError("cannot tell which drafter this checkpoint holds (pass kind=); "
                          f"tensors: {sorted(keys)[:8]}")


def expected_params(module, target: LlamaConfig) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Flat ``{path: ShapeDtypeStruct}`` of the tree ``module.init_params`` builds."""
    tree = jax.eval_shape(lambda k: module.init_params(k, target), jax.random.key(0))
    return flatten(nn.unbox(tree))


def _hf_shape(shape, transpose):
    return tuple(reversed(shape)) if transpose else tuple(shape)


def load_hf(d: Path, cfg: dict, target: LlamaConfig, dtype: str, kind: str | None = None,
            mesh=None, **options):
    """``(module, params)`` of the HF drafter in ``d``; ``options`` go to the kind's reader
    (EAGLE-3's ``aux_layers``)."""
    with Tensors(d) as ts:
        entry = resolve_kind(cfg, ts, kind)
        given = {k: v for k, v in options.items() if v is not None}
        bad = sorted(set(given) - set(entry.hf.options))
        if bad:
            raise ValueError(f"{', '.join(b + '=' for b in bad)} does not apply to a "
                             f"{entry.name} drafter")
        module, extra, layout = entry.hf.read(cfg, ts, target, dtype, **given)
        module.validate(target)                     # hidden size, vocabulary, aux layers
        expected = expected_params(module, target)
        table = entry.hf.table(module, layout, target.num_layers)
        _check_table_covers(entry, table, expected, extra)
        # Every shape from the headers first, so a bad file fails before data is read.
        for name, p, t in table:
            want = _hf_shape(expected[p].shape, t)
            if name not in ts:
                raise CheckpointError(f"checkpoint is missing tensor {ts.prefix + name!r} "
                                      f"(expected shape {want})")
            check_shape(ts.prefix + name, want, ts.shape(name))
        flat, sh = {}, None
        if mesh is not None:      # each device's block read by slice, as the target's
            sh = flatten(Drafter(module, unflatten(expected)).shardings(target, mesh))
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
    return module, params


def _check_table_covers(entry, table, expected, extra) -> None:
    have = {p for _, p, _ in table} | {(k,) for k in extra}
    want = set(expected)
    have -= entry.hf.optional
    want -= entry.hf.optional
    if have != want:   # a bug in the kind's table, not in the checkpoint
        raise AssertionError(f"{entry.name} table/param tree mismatch: "
                             f"{sorted(map(path_str, have ^ want))}")


# ------------------------------------------------------------------ writing
def _entry_for_writing(drafter, layout):
    entry = registry.of(drafter)
    if entry.hf is None:
        raise ValueError(f"a {entry.name} drafter has no Hugging Face layout")
    return entry, entry.hf.write_layout(drafter.module, layout)


def state_dict_from_drafter(drafter, layout: str | None = None,
                            num_target_layers: int | None = None) -> dict[str, np.ndarray]:
    """HF-named host arrays for ``drafter`` (inverse of the kind's table)."""
    entry, layout = _entry_for_writing(drafter, layout)
    flat = flatten(nn.unbox(drafter.params))
    out = {}
    for name, p, t in entry.hf.table(drafter.module, layout, num_target_layers):
        arr = np.asarray(flat[p])
        out[name] = np.ascontiguousarray(arr.T if t else arr)
    for key in ("d2t", "token_map"):
        if (key,) in flat:
            out[key] = np.asarray(flat[(key,)]).astype(np.int64)
    return out


def save_hf_drafter(drafter, path, layout: str | None = None, target_config=None,
                    overwrite: bool = False) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the drafter's published layout,
    into a hidden sibling directory renamed into place (an existing ``path`` only with
    ``overwrite=True``, as :func:`~jspec.drafters.save_drafter`).

    ``layout``: for Medusa ``"fasterdecoding"`` (default) or ``"vllm"`` (needed for a
    truncated vocabulary). MTP needs ``target_config`` (its layers sit after the target's).
    """
    entry, layout = _entry_for_writing(drafter, layout)
    L = None
    if target_config is not None:
        L = getattr(target_config, "config", target_config).num_layers
    cfg = entry.hf.write_config(drafter.module, layout, L)
    tensors = state_dict_from_drafter(drafter, layout, L)
    with atomic_dir(path, overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
