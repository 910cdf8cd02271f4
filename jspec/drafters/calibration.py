"""A drafter's calibration model (:mod:`jspec.tree.calibration`) on disk and on the drafter:
``jspec_calibration.json`` beside its weights, read by :func:`jspec.drafters.load_drafter`."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jspec import atomic
from jspec.drafters import registry
from jspec.drafters.drafter import Drafter
from jspec.tree.calibration import (FEATURES, PARAM_KEY, VERSION, CalibrationError, model_of,
                                    validate)

FILENAME = "jspec_calibration.json"


def check(drafter, spec) -> None:
    """Refuse ``selection="calibrated"`` where it cannot apply, before anything compiles: a
    drafter without a dynamic tree, or without a calibration model."""
    if spec is None or spec.selection == "eagle2":
        return
    if not drafter.module.has_pool:
        pooled = registry.names(lambda k: getattr(k.module, "has_pool", False) is True)
        raise CalibrationError(
            f"selection={spec.selection!r} ranks the candidates of a dynamic (EAGLE-2) tree; a "
            f"{drafter.kind} drafter drafts a fixed tree, without a candidate pool (kinds with "
            f"one: {', '.join(pooled)})")
    model = model_of(drafter)
    if model is None:
        raise CalibrationError(
            "selection='calibrated' needs the drafter's calibration: run "
            "`python -m jspec.train calibrate --target T --drafter D --heldout-seqs S` "
            f"(writes D/{FILENAME}, which load_drafter reads) or attach one with "
            "jspec.drafters.calibration.attach")
    validate(model, getattr(drafter.module, "target_vocab", None))


def attach(drafter, model):
    """The drafter with ``model`` (``{"weights", "token_bias", "pair_bias"}``) in its params."""
    validate(model, getattr(drafter.module, "target_vocab", None))
    model = {k: jnp.asarray(v, jnp.float32) for k, v in model.items()}
    return Drafter(drafter.module, {**drafter.params, PARAM_KEY: model}, source=drafter.source)


def _sparse(v) -> dict:
    v = np.asarray(v, np.float64).round(4)
    ids = np.flatnonzero(v)
    return {"size": int(v.size), "ids": ids.tolist(), "values": v[ids].tolist()}


def _dense(doc: dict, path, name: str) -> np.ndarray:
    ids, values = np.asarray(doc["ids"], np.int64), np.asarray(doc["values"], np.float32)
    if ids.shape != values.shape or (ids.size and (ids.min() < 0 or ids.max() >= doc["size"])):
        raise CalibrationError(f"{path}: {name} ids must lie in [0, {doc['size']}) and match "
                               f"the values one for one")
    out = np.zeros(int(doc["size"]), np.float32)
    out[ids] = values
    return out


def save(drafter_dir, model, meta: dict | None = None) -> Path:
    """Write ``drafter_dir/jspec_calibration.json`` atomically: the weights to 5 decimals,
    the biases sparsely (the entries not 0 at 4 decimals)."""
    validate(model)
    path = Path(drafter_dir) / FILENAME
    doc = {"format": "jspec-calibration", "version": VERSION, "features": list(FEATURES),
           "weights": np.asarray(model["weights"], np.float64).round(5).tolist(),
           "token_bias": _sparse(model["token_bias"]), "pair_bias": _sparse(model["pair_bias"]),
           "meta": meta or {}}
    return atomic.write_text(path, json.dumps(doc))


def load(drafter_dir) -> dict | None:
    """The stored model (numpy arrays), or None when the drafter has none."""
    path = Path(drafter_dir) / FILENAME
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if doc.get("version") != VERSION:
        raise CalibrationError(
            f"{path}: calibration format version {doc.get('version')} (jspec reads version "
            f"{VERSION}); refit it with `python -m jspec.train calibrate --drafter "
            f"{Path(drafter_dir)} ...`")
    if doc.get("features") != list(FEATURES):
        raise CalibrationError(f"{path}: features {doc.get('features')}, expected {list(FEATURES)}")
    model = {"weights": np.asarray(doc["weights"], np.float32),
             "token_bias": _dense(doc["token_bias"], path, "token_bias"),
             "pair_bias": _dense(doc["pair_bias"], path, "pair_bias")}
    validate(model)
    if not all(np.isfinite(v).all() for v in model.values()):
        raise CalibrationError(f"{path}: non-finite calibration weights")
    return model
