"""Acceptance collapse: a trained drafter that almost never guesses right is a wiring bug,
not a weak head. The peers' trackers show the usual causes: an aux-layer convention one off
(EAGLE-3 reading layer outputs where it was trained on layer inputs), a zero or missing
``d2t`` map, a head paired with another target or tokenizer. Output stays exact either way
(every token is verified), so without a check the user only sees a slow run.

:func:`warn_if_collapsed` reads the first-step acceptance off a finished ``generate`` call's
stats (free: ``generate`` calls it for drafters loaded from a checkpoint);
:func:`jspec.generate.check_acceptance` runs a short calibration for it.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

log = logging.getLogger("jspec")

# Below this first-step acceptance a checkpoint's head is treated as collapsed: a trained
# EAGLE-3 head on the shipped model accepts ~68% of first drafts, the same head with its d2t
# zeroed 0.8% (measured, 4 held-out prompts x 32 tokens).
COLLAPSE_RATE = 0.05
# Fewer verify passes than this say too little to warn on.
MIN_ITERATIONS = 32


def first_step_acceptance(stats: Sequence[dict]) -> tuple[float, int]:
    """``(rate, iterations)``: the share of verify passes that kept at least one draft, over
    every row of a ``generate`` result's ``stats``."""
    hist = np.sum([s["accept_hist"] for s in stats], axis=0)
    total = int(hist[1:].sum())
    return (float(hist[2:].sum()) / total if total else 0.0), total


def likely_causes(drafter) -> list[str]:
    """What to check first, most specific first."""
    causes = []
    d2t = drafter.params.get("d2t") if isinstance(drafter.params, dict) else None
    if d2t is not None and not np.any(np.asarray(d2t)):
        causes.append("its d2t map is all zeros, so draft id i proposes target id i (a d2t "
                      "buffer saved as zeros or never filled)")
    elif d2t is not None:
        causes.append("its d2t map (draft id -> target id) does not belong to this head")
    layers = tuple(getattr(drafter.module, "target_layers", ()) or ())
    if layers:
        causes.append(f"the aux-layer convention: it reads the residual streams entering target "
                      f"layers {layers} (HF hidden_states[i]); a head trained on layer outputs "
                      f"(hidden_states[i + 1]) is one off")
    causes.append("it was trained for another target model or tokenizer")
    return causes


def warn_if_collapsed(drafter, stats: Sequence[dict]) -> float | None:
    """Warn when a drafter loaded from a checkpoint (``drafter.source``) accepted almost no
    first drafts in a finished call; returns the rate when it warned."""
    if getattr(drafter, "source", None) is None:       # random or built in memory: no claim
        return None
    rate, iterations = first_step_acceptance(stats)
    if iterations < MIN_ITERATIONS or rate >= COLLAPSE_RATE:
        return None
    log.warning("drafter %s accepted %.1f%% of first drafts over %d verify passes: a trained "
                "head should accept far more. Likely causes: %s. Output is still exactly the "
                "target's; only the speed-up is lost.", drafter.source, 100 * rate, iterations,
                "; ".join(likely_causes(drafter)))
    return rate
