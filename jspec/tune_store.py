"""The tuner's stored pick: ``jspec_tuning.json`` beside a drafter checkpoint, keyed by device
kind and batch (:func:`store`), and what ``generate(spec="auto")`` makes of it
(:func:`resolve_spec`). The pick itself comes from :func:`jspec.tune.tune`."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import jax

from jspec import atomic
from jspec.spec_config import SpecConfig

log = logging.getLogger("jspec")

TUNING_FILE = "jspec_tuning.json"


def device_kind() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '') or d.platform}"


def _key(device: str, batch: int) -> str:
    return f"{device}|batch={batch}"


def store(result, drafter_dir: str | os.PathLike) -> Path:
    """Add the pick of a :class:`jspec.tune.TuneResult` to ``drafter_dir/jspec_tuning.json`` (other keys kept); written whole to
    a temporary file in the same directory, then renamed over the old one."""
    best = next(r for r in result.rows if r["spec"] == result.pick)
    entry = {"spec": [result.pick.num_steps, result.pick.topk, result.pick.num_draft_tokens],
             "selection": result.pick.selection, "tokens_per_s": best["tok/s meas"],
             "plain_tokens_per_s": result.plain_tokens_per_s}
    return _update(drafter_dir, "picks", {_key(result.device, result.batch): entry})


def _read(drafter_dir) -> dict:
    """The tuning file's contents beside a drafter ({} when there is none)."""
    path = None if drafter_dir is None else Path(drafter_dir) / TUNING_FILE
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def _update(drafter_dir, section: str, entries: dict) -> Path:
    """Add ``entries`` (stamped with jax's version and the date) to ``section`` of the tuning
    file, other keys kept; written whole to a temporary file in the same directory, then
    renamed over the old one."""
    path = Path(drafter_dir) / TUNING_FILE
    data = _read(drafter_dir) or {"picks": {}}
    stamp = {"jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    data.setdefault(section, {}).update({k: {**v, **stamp} for k, v in entries.items()})
    return atomic.write_text(path, json.dumps(data, indent=1))


def stored_spec(drafter, batch: int, device: str | None = None) -> SpecConfig | None:
    """The stored pick for this drafter (loaded from a directory), device kind and batch;
    None when there is none."""
    pick = _read(getattr(drafter, "source", None)).get("picks", {}).get(
        _key(device or device_kind(), batch))
    return None if pick is None else SpecConfig(*pick["spec"], pick.get("selection", "eagle2"))


def resolve_spec(drafter, spec, batch: int):
    """``spec="auto"``: the stored pick, else the drafter's default with a warning."""
    if not (isinstance(spec, str) and spec == "auto"):
        if isinstance(spec, str):
            raise ValueError(f"spec={spec!r}: pass a SpecConfig, None (the drafter's default) "
                             f"or 'auto' (the pick stored by `python -m jspec tune`)")
        return spec
    picked = stored_spec(drafter, batch)
    if picked is None:
        log.warning("spec='auto': no tuned pick for this drafter on %s at batch %d; using its "
                    "default. Run `python -m jspec tune --model M --drafter D --prompts FILE "
                    "--batch %d` to measure one.", device_kind(), batch, batch)
        return drafter.default_spec
    return picked


# ---------------------------------------------------------------- engine occupancy picks
MISSING = object()


def _occupancy_key(device: str, bucket: int) -> str:
    return f"{device}|occupancy={bucket}"


def store_occupancy(rates: dict, picks: dict, drafter_dir: str | os.PathLike,
                    device: str | None = None, measured_at: dict | None = None) -> Path:
    """Add the engine's per-bucket picks (``{bucket: mode label}``) and the measured rates
    behind them (``{bucket: {label: tokens/s}}``) to ``drafter_dir/jspec_tuning.json``;
    written whole to a temporary file, then renamed. ``measured_at``: the engine settings
    the rates hold for (slots, max_new_cap), kept beside them."""
    device = device or device_kind()
    return _update(drafter_dir, "occupancy", {
        _occupancy_key(device, b): {"mode": label, "tokens_per_s": rates[b],
                                    **(measured_at or {})}
        for b, label in picks.items()})


def stored_mode(drafter, bucket: int, device: str | None = None):
    """The stored engine pick (a mode label: ``"plain"``, ``"default"`` or ``"S,K,N[/cal]"``)
    for this drafter, device kind and bucket of live slots; :data:`MISSING` when none."""
    entry = _read(getattr(drafter, "source", None)).get("occupancy", {}).get(
        _occupancy_key(device or device_kind(), bucket))
    return MISSING if entry is None else entry["mode"]
