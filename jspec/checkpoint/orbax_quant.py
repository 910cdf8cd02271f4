"""A quantized target as a jspec Orbax checkpoint (``python -m jspec.convert --quantize``).

A quantized target's params are the packed serving layout with :class:`~jspec.quant.QWeight`
leaves, which no checkpoint layout names. They are written as that tree, stacked, with every
quantized weight stored as its arrays (``q/qvalue``, ``q/scale``, and ``in_scale`` where a GGUF
block carries one) and described in ``jspec_config.json`` (``jspec.quant``: the mode and, per
weight, its stored type and activation type). Loading rebuilds the tree from that description
and the stored shapes, so a pod restores each int8 slice and its scales straight into their
shardings (:func:`jspec.serving_layout.packed_param_shardings`); nothing is requantized, and
the numbers are the ones that were saved.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import qwix

from jspec.checkpoint.common import CheckpointError, unflatten, with_dtype
from jspec.checkpoint.orbax_io import (PARAMS_DIR, restore_numpy, restore_sharded,
                                       saved_tokenizer, stored_tensors, write_checkpoint)
from jspec.config import LlamaConfig
from jspec.quant import QWeight, as_quant_config, is_qweight, mode_of
from jspec.serving_layout import default_stacked, pack_params, packed_param_shardings
from jspec.target import Target


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def storable(packed) -> tuple[dict, dict]:
    """``(flat {path tuple: array}, {weight path: description})`` of a quantized packed tree."""
    flat, qweights = {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(packed, is_leaf=is_qweight)[0]:
        p = tuple(_key(k) for k in path)
        if not is_qweight(leaf):
            flat[p] = leaf
            continue
        if leaf.q.zero_point is not None:     # no mode here makes one; refuse, don't drop it
            raise CheckpointError(f"{'/'.join(p)}: a zero point cannot be saved")
        qweights["/".join(p)] = {"qtype": jnp.dtype(leaf.q.qtype).name, "act": leaf.act}
        flat[p + ("q", "qvalue")] = leaf.q.qvalue
        flat[p + ("q", "scale")] = leaf.q.scale
        if leaf.in_scale is not None:
            flat[p + ("in_scale",)] = leaf.in_scale
    return flat, qweights


def rebuild(flat: dict, qweights: dict) -> dict:
    """The packed tree from :func:`storable`'s output (leaves: arrays or shape structs)."""
    out: dict = {}
    for name, desc in qweights.items():
        p = tuple(name.split("/"))
        try:
            q = qwix.QArray(flat[p + ("q", "qvalue")], flat[p + ("q", "scale")],
                            qtype=jnp.dtype(desc["qtype"]))
        except KeyError as e:
            raise CheckpointError(f"quantized weight {name!r}: tensor {e} is missing") from None
        w = QWeight(q, flat.get(p + ("in_scale",)), desc["act"])
        _put(out, p, w)
    taken = quantized_parts(qweights)
    for p, v in flat.items():
        if p not in taken:
            _put(out, p, v)
    return out


def quantized_parts(qweights: dict) -> set:
    """The stored paths that belong to quantized weights."""
    return {tuple(n.split("/")) + part for n in qweights
            for part in (("q", "qvalue"), ("q", "scale"), ("in_scale",))}


def _put(tree: dict, path: tuple, v) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = v


def save_quantized_orbax(target: Target, path: str | os.PathLike, overwrite: bool = False) -> None:
    """Write a quantized target (its packed params hold :class:`QWeight` s)."""
    cfg = target.config
    mode = mode_of(target.params)
    if mode is None:
        raise CheckpointError("save_quantized_orbax: the target is not quantized")
    flat, qweights = storable(pack_params(cfg, target.params, stacked=True))
    write_checkpoint(target, path, unflatten(flat), overwrite,
                     {"quant": {"mode": mode, "weights": qweights}})


def load_quantized_orbax(path: str | os.PathLike, meta: dict, dtype=None, mesh=None,
                         quantize=None) -> Target:
    """A target saved by :func:`save_quantized_orbax` (``meta``: its checked config JSON).
    ``dtype``: the compute dtype (the stored values and scales stay as saved)."""
    d = Path(path).absolute()
    info = meta["jspec"]
    saved = info["quant"]["mode"]
    qc = as_quant_config(quantize)
    if qc is not None and qc.mode != saved:
        raise CheckpointError(f"{d} holds a target quantized as {saved}; it cannot be "
                              f"loaded as {qc.mode} (convert the float checkpoint instead)")
    cfg: LlamaConfig = with_dtype(LlamaConfig.from_hf(meta), dtype)
    ckptr = ocp.PyTreeCheckpointer()
    pdir = d / info.get("params", PARAMS_DIR)
    stored = stored_tensors(ckptr, pdir)
    weights = info["quant"]["weights"]
    abstract = rebuild({p: jax.ShapeDtypeStruct(m.shape, m.dtype) for p, m in stored.items()},
                       weights)
    # Values and scales stay as saved; the float params (embeddings, norms) take cfg's dtype.
    dtypes = {p: m.dtype if p in quantized_parts(weights) else cfg.dtype
              for p, m in stored.items()}
    if mesh is not None:
        flat = restore_sharded(ckptr, pdir, storable(packed_param_shardings(mesh, abstract))[0],
                               dtypes)
    else:
        raw = restore_numpy(ckptr, pdir, list(stored))
        flat = {p: jnp.asarray(raw[p].astype(dtypes[p], copy=False)) for p in stored}
    params = pack_params(cfg, rebuild(flat, info["quant"]["weights"]), stacked=default_stacked())
    return Target(cfg, params, saved_tokenizer(d, info, cfg))
