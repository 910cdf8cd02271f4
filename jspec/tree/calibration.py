"""Acceptance-aware node selection: rank draft-tree nodes by a *calibrated* probability of
being accepted instead of the drafter's own probability (EAGLE-2).

Under greedy verification a drafted node survives when its token is the target's argmax
after its parent, and its parent survived. A drafter's probabilities are not calibrated
for that: a rank-0 token at q = 0.3 is accepted far more often than 30% of the time, a
rank-2 token at the same q far less, and how much depends on the depth. So the table here
maps (depth, rank among its siblings, drafter probability q) to the measured rate at which
such a node matches the target's greedy token *given its parent is on the greedy path*:

    table [D, R, BINS]: log of that rate, for tree steps 0..D-1 (step s drafts depth s+1),
    sibling ranks 0..R-1 (deeper steps and later ranks use the last row), and q in BINS
    equal bins of [0, 1], read by linear interpolation between bin centres.

The path score is the sum of the calibrated log-rates along the path, i.e. the log of
the product of calibrated node probabilities: the probability that the whole path is
accepted. It replaces the cumulative drafter log-probability in both places EAGLE-2 uses
it: the frontier kept inside the draft loop and the global top-(N-1) selection. A node's
calibrated log-rate is <= 0, so a child never outscores its parent and the selection stays
ancestor-closed exactly as before. Exactness does not depend on which nodes are drafted.

Fitting (:func:`fit`) is histogram binning made monotone in q by weighted isotonic
regression (pool adjacent violators), with a Beta prior that pulls thin bins towards the
cell's mean rate. Records come from teacher-forced draft runs on held-out text
(:mod:`jspec.train.calibrate`); the table is stored beside the drafter checkpoint as
``jspec_calibration.json`` and read back by :func:`jspec.drafters.load_drafter`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

FILENAME = "jspec_calibration.json"
PARAM_KEY = "calibration"       # where a drafter's params carry the table for the draft loop
FLOOR = 1e-4                    # rates never reach 0: a log-rate stays finite and ordered


class CalibrationError(ValueError):
    """A calibrated selection without a usable calibration table."""


# ------------------------------------------------------------------ in the draft loop
def node_scores(selection: str, logq: jax.Array, step, params) -> jax.Array:
    """Per-node log-scores of one tree step's candidates.

    ``logq [..., K]``: drafter log-probabilities of a parent's top-K children, siblings in
    rank order on the last axis; ``step``: the tree step (0 for the root's children; may
    be traced). EAGLE-2 scores a node by ``logq``; ``calibrated`` by the table in
    ``params["calibration"]``.
    """
    if selection == "eagle2":
        return logq
    return lookup(params[PARAM_KEY], step, jnp.arange(logq.shape[-1]), logq)


def lookup(table: jax.Array, step, rank, logq: jax.Array) -> jax.Array:
    """Calibrated log-rates of nodes at tree ``step`` with sibling ``rank`` and drafter
    log-probability ``logq`` (all broadcast together)."""
    D, R, nb = table.shape
    rows = jnp.asarray(table)[jnp.minimum(step, D - 1), jnp.minimum(rank, R - 1)]   # [..., nb]
    # Linear interpolation between bin centres (flat beyond the outer centres): nodes in one
    # bin still order by q, which keeps ties rare.
    x = jnp.clip(jnp.exp(logq.astype(jnp.float32)) * nb - 0.5, 0.0, nb - 1.0)
    lo = jnp.floor(x).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, nb - 1)
    w = x - lo
    rows = jnp.broadcast_to(rows, x.shape + (nb,))
    at = lambda i: jnp.take_along_axis(rows, i[..., None], axis=-1)[..., 0]
    out = (1 - w) * at(lo) + w * at(hi)
    return jnp.where(jnp.isnan(logq), -jnp.inf, out)


def check(drafter, spec) -> None:
    """Refuse ``selection="calibrated"`` where it cannot apply, before anything compiles: a
    drafter without a dynamic tree, or without a calibration table."""
    if spec is None or spec.selection == "eagle2":
        return
    if not drafter.module.has_pool:
        from jspec.drafters import registry
        pooled = registry.names(lambda k: getattr(k.module, "has_pool", False) is True)
        raise CalibrationError(
            f"selection={spec.selection!r} ranks the candidates of a dynamic (EAGLE-2) tree; a "
            f"{drafter.kind} drafter drafts a fixed tree, without a candidate pool (kinds with "
            f"one: {', '.join(pooled)})")
    table = table_of(drafter)
    if table is None:
        raise CalibrationError(
            "selection='calibrated' needs the drafter's calibration table: run "
            "`python -m jspec.train calibrate --target T --drafter D --heldout-seqs S` "
            f"(writes D/{FILENAME}, which load_drafter reads) or attach one with "
            "jspec.tree.calibration.attach")
    if np.ndim(table) != 3:
        raise CalibrationError(f"calibration table must be [depth, rank, bins], got shape "
                               f"{np.shape(table)}")


def table_of(drafter):
    """The calibration table a drafter carries in its params, or None."""
    params = drafter.params
    return params.get(PARAM_KEY) if isinstance(params, dict) else None


def attach(drafter, table):
    """The drafter with ``table [D, R, BINS]`` (log-rates) in its params."""
    from jspec.drafters import Drafter
    return Drafter(drafter.module, {**drafter.params, PARAM_KEY: jnp.asarray(table, jnp.float32)},
                   source=drafter.source)


# ------------------------------------------------------------------ fitting
def _pav(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) regression by pool adjacent violators."""
    blocks = []                                          # [value, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.concatenate([np.full(c, v) for v, _, c in blocks])


def fit(depth, rank, q, hit, *, depths: int = 8, ranks: int = 8, bins: int = 20,
        prior: float = 4.0) -> np.ndarray:
    """Records -> table ``[depths, ranks, bins]`` of log-rates.

    ``depth`` (tree step, 0-based), ``rank`` (sibling rank), ``q`` (drafter probability)
    and ``hit`` (the node equals the target's greedy token) describe candidates whose
    parent is on the greedy path. A cell without records copies the previous rank's row,
    or the previous depth's for rank 0 (or a flat 1% when there is nothing at all).
    """
    depth, rank = np.minimum(depth, depths - 1), np.minimum(rank, ranks - 1)
    b = np.clip((np.asarray(q, np.float64) * bins).astype(np.int64), 0, bins - 1)
    hit = np.asarray(hit, np.float64)
    rate = np.zeros((depths, ranks, bins))
    for d in range(depths):
        for r in range(ranks):
            sel = (depth == d) & (rank == r)
            if not sel.any():
                rate[d, r] = rate[d, r - 1] if r else (rate[d - 1, 0] if d else 0.01)
                continue
            n = np.bincount(b[sel], minlength=bins).astype(np.float64)
            h = np.bincount(b[sel], weights=hit[sel], minlength=bins)
            mean = (h.sum() + 1) / (n.sum() + 2)
            rate[d, r] = _pav((h + prior * mean) / (n + prior), n + prior)
    return np.log(np.clip(rate, FLOOR, 1.0)).astype(np.float32)


def log_loss(table: np.ndarray, depth, rank, q, hit) -> tuple[float, float]:
    """Mean negative log-likelihood of ``hit`` under the calibrated rates and under the
    drafter's raw q: how much better the table predicts acceptance."""
    hit = np.asarray(hit, bool)
    logq = np.log(np.clip(np.asarray(q, np.float64), 1e-12, 1.0))
    cal = np.asarray(lookup(table, np.asarray(depth), np.asarray(rank), jnp.asarray(logq)))

    def nll(logp):
        p = np.clip(np.exp(logp), 1e-6, 1 - 1e-6)
        return float(-np.mean(np.where(hit, np.log(p), np.log1p(-p))))
    return nll(cal), nll(logq)


# ------------------------------------------------------------------ storage
def save(drafter_dir, table: np.ndarray, meta: dict | None = None) -> Path:
    """Write ``drafter_dir/jspec_calibration.json`` atomically (log-rates to 4 decimals)."""
    path = Path(drafter_dir) / FILENAME
    doc = {"format": "jspec-calibration", "version": 1, "shape": list(table.shape),
           "log_rate": np.asarray(table, np.float64).round(4).tolist(), "meta": meta or {}}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
    return path


def load(drafter_dir) -> np.ndarray | None:
    """The stored table, or None when the drafter has none."""
    path = Path(drafter_dir) / FILENAME
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    table = np.asarray(doc["log_rate"], np.float32)
    if list(table.shape) != doc["shape"] or table.ndim != 3 or np.any(table > 0):
        raise CalibrationError(f"{path}: malformed calibration table (shape {table.shape}, "
                               f"stated {doc['shape']}; log-rates must be <= 0)")
    return table
