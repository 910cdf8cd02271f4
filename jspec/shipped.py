"""Where the shipped models are: the small default target and its drafters (19 MB).

They travel with the package: in a source checkout they are ``checkpoints/`` beside
``jspec/``; an installed wheel carries the same tree as package data (``jspec/models``, mapped
from ``checkpoints/`` in ``setup.py``), so ``pip install .`` and ``python -m jspec demo`` work
from any directory. ``JSPEC_MODELS=DIR`` points at another copy (a tree laid out like
``checkpoints/``). Shipping them costs 19 MB a wheel; the alternative, a download on first
use, would make the demo depend on the network, which TPU VMs and CI runners often lack.
"""

from __future__ import annotations

import os
from pathlib import Path

from jspec.drafters import registry

ENV = "JSPEC_MODELS"
HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent.parent / "shared" / "models" / "stories260K"
# The drafters the demo picks among: those jspec.train trains and ships as drafter checkpoints
# (drafters/KIND); the shipped draft model (drafters/model) is not one of them.
DRAFTER_ORDER = registry.names(lambda k: k.trainable)


def roots() -> list[Path]:
    """Where shipped models are looked for, in order: ``$JSPEC_MODELS``, the wheel's package
    data, the source checkout's ``checkpoints/``."""
    env = os.environ.get(ENV)
    return ([Path(env)] if env else []) + [HERE / "models", HERE.parent / "checkpoints"]


def default_model() -> Path:
    """The model the demo runs: the shipped default target, else the stories260K fixture."""
    for cand in [r / "default" / "target" for r in roots()] + [FIXTURE]:
        if cand.exists():
            return cand
    raise FileNotFoundError(
        f"no default model: none of {', '.join(str(r) for r in roots())} holds "
        f"default/target. Set {ENV}=DIR (a copy of the repository's checkpoints/) or pass "
        "--model PATH (see docs/models.md).")


def shipped_drafters(model_path: Path) -> dict[str, Path]:
    """The drafters shipped beside a target (``DIR/target`` + ``DIR/drafters/KIND``)."""
    here = Path(model_path).resolve()
    root = here.parent if here.name == "target" else here
    d = root / "drafters"
    return {k: d / k for k in DRAFTER_ORDER if (d / k / "jspec_drafter.json").is_file()}
