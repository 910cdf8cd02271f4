"""Acceptance-aware node selection: rank draft-tree nodes by a *calibrated* probability of
being accepted instead of the drafter's own probability (EAGLE-2).

Under greedy verification a drafted node survives when its token is the target's argmax
after its parent, and its parent survived. A drafter's probabilities are not calibrated
for that: a rank-0 token at q = 0.3 is accepted far more often than 30% of the time, a
rank-2 token at the same q far less, a runner-up whose rank-0 sibling is sure almost never,
and some tokens (the rest of a word, punctuation) are surer than their q says. So the model
here gives the probability that a node is the target's greedy token *given its parent is
on the greedy path*, as a logistic regression per (tree step, sibling rank) cell plus a
per-token bias:

    rate = sigmoid(weights[min(step, D-1), min(rank, R-1)] . x + token_bias[token])
    x    = (1, log q, log q of the rank-0 sibling, log q of the rank-1 sibling,
            parent is rank 0, parent is a later rank, log q of the parent)

(:data:`FEATURES`; a root child's parent is the root: both parent flags 0, its log q 0; log
q is floored at :data:`LOGQ_FLOOR`). ``token`` is the node's id in the *target* vocabulary.
Everything it reads is already in the draft loop, so scoring costs a few elementwise ops and
one gather per tree step.

The path score is the sum of the log-rates along the path: the log of the probability that
the whole path is accepted. It replaces the cumulative drafter log-probability in both
places EAGLE-2 uses it: the frontier kept inside the draft loop and the global top-(N-1)
selection. A log-sigmoid is < 0, so a child never outscores its parent and the selection
stays ancestor-closed exactly as before. Since the accepted drafts of a tree are one chain
of on-path nodes, the expected accept length is 1 + the sum of the selected nodes' path
probabilities, which the top-(N-1) by path score maximises for a given pool. Exactness does
not depend on which nodes are drafted.

The model is fitted on teacher-forced draft runs over held-out text
(:mod:`jspec.train.calibrate`) and stored beside the drafter checkpoint as
``jspec_calibration.json`` (version 2; version 1, an isotonic table over (step, rank, q),
is refused with the command that refits it), read back by :func:`jspec.drafters.load_drafter`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

FILENAME = "jspec_calibration.json"
PARAM_KEY = "calibration"       # where a drafter's params carry the model for the draft loop
VERSION = 2
FEATURES = ("bias", "logq", "logq_rank0", "logq_rank1", "parent_rank0", "parent_later",
            "parent_logq")
LOGQ_FLOOR = -20.0              # log q below this (or -inf: a missing sibling) reads as this


class CalibrationError(ValueError):
    """A calibrated selection without a usable calibration model."""


# ------------------------------------------------------------------ features and scores
def node_features(logq, parent_rank, parent_logq, xp=jnp):
    """``logq [..., K]``: drafter log-probabilities of one parent's top-K children in rank
    order; ``parent_rank, parent_logq [...]``: that parent's sibling rank (-1 for the root)
    and log q (0 for the root). Returns ``x [..., K, F]`` (:data:`FEATURES`). ``xp``: jnp in
    the draft loop, np when fitting, so both read one definition."""
    lq = xp.maximum(xp.where(xp.isnan(logq), LOGQ_FLOOR, logq), LOGQ_FLOOR).astype(xp.float32)
    K = lq.shape[-1]
    at = lambda r: xp.broadcast_to(lq[..., r:r + 1], lq.shape) if r < K \
        else xp.full(lq.shape, LOGQ_FLOOR, xp.float32)
    per_parent = lambda v: xp.broadcast_to(xp.asarray(v, xp.float32)[..., None], lq.shape)
    pr = xp.asarray(parent_rank)
    plq = xp.maximum(xp.asarray(parent_logq, xp.float32), LOGQ_FLOOR)
    return xp.stack([xp.ones_like(lq), lq, at(0), at(1), per_parent(pr == 0),
                     per_parent(pr > 0), per_parent(xp.where(pr < 0, 0.0, plq))], axis=-1)


def pool_features(logq, parents, K: int, xp=jnp):
    """:func:`node_features` of every candidate of an EAGLE-2 pool (``logq, parents [B, M]``
    in the layout of :mod:`jspec.tree.select`: siblings are K contiguous entries with one
    parent) -> ``[B, M, F]``."""
    B, M = logq.shape
    sib = logq.reshape(B, M // K, K)
    par = parents[:, ::K]                                             # [B, groups]
    safe = xp.clip(par, 0, M - 1)
    plq = xp.take_along_axis(logq, safe, axis=1)
    x = node_features(sib, xp.where(par < 0, -1, par % K), xp.where(par < 0, 0.0, plq), xp)
    return x.reshape(B, M, len(FEATURES))


def log_rates(model, step, rank, x, tokens):
    """Calibrated log-rates of nodes at tree ``step`` (may be traced) with sibling ``rank``,
    features ``x [..., F]`` and target-vocabulary ``tokens`` (broadcast together)."""
    w = jnp.asarray(model["weights"])
    D, R, _ = w.shape
    rows = w[jnp.minimum(step, D - 1), jnp.minimum(rank, R - 1)]        # [..., F]
    z = jnp.sum(jnp.asarray(x, jnp.float32) * rows, -1) + jnp.asarray(model["token_bias"])[tokens]
    return jax.nn.log_sigmoid(z)


def node_scores(selection: str, logq: jax.Array, step, params, tokens=None, parent_rank=None,
                parent_logq=None) -> jax.Array:
    """Per-node log-scores of one tree step's candidates.

    ``logq [..., K]``: drafter log-probabilities of a parent's top-K children, siblings in
    rank order on the last axis; ``step``: the tree step (0 for the root's children; may be
    traced). EAGLE-2 scores a node by ``logq``; ``calibrated`` by the model in
    ``params["calibration"]``, which also reads the children's target-vocabulary ``tokens``
    (the shape of ``logq``) and their parent's ``parent_rank`` / ``parent_logq`` (``logq``'s
    shape without the last axis; -1 / 0 for the root).
    """
    if selection == "eagle2":
        return logq
    x = node_features(logq, parent_rank, parent_logq)
    out = log_rates(params[PARAM_KEY], step, jnp.arange(logq.shape[-1]), x, tokens)
    return jnp.where(jnp.isnan(logq), -jnp.inf, out)


# ------------------------------------------------------------------ drafter plumbing
def check(drafter, spec) -> None:
    """Refuse ``selection="calibrated"`` where it cannot apply, before anything compiles: a
    drafter without a dynamic tree, or without a calibration model."""
    if spec is None or spec.selection == "eagle2":
        return
    if not drafter.module.has_pool:
        from jspec.drafters import registry
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
            "jspec.tree.calibration.attach")
    validate(model, getattr(drafter.module, "target_vocab", None))


def validate(model, vocab: int | None = None) -> None:
    """Shape checks of a model ``{"weights": [D, R, F], "token_bias": [V]}``."""
    if not isinstance(model, dict) or set(model) != {"weights", "token_bias"}:
        raise CalibrationError("a calibration model is {'weights': [depth, rank, features], "
                               f"'token_bias': [vocab]}}, got {type(model).__name__}"
                               + (f" with keys {sorted(model)}" if isinstance(model, dict) else ""))
    w, b = np.shape(model["weights"]), np.shape(model["token_bias"])
    if len(w) != 3 or w[2] != len(FEATURES) or min(w) < 1:
        raise CalibrationError(f"calibration weights must be [depth, rank, {len(FEATURES)}], "
                               f"got {list(w)}")
    if len(b) != 1 or (vocab is not None and b[0] != vocab):
        raise CalibrationError(f"calibration token_bias must be [{vocab or 'vocab'}] (the "
                               f"target vocabulary), got {list(b)}")


def model_of(drafter):
    """The calibration model a drafter carries in its params, or None."""
    params = drafter.params
    return params.get(PARAM_KEY) if isinstance(params, dict) else None


def attach(drafter, model):
    """The drafter with ``model`` (``{"weights", "token_bias"}``) in its params."""
    from jspec.drafters import Drafter
    validate(model, getattr(drafter.module, "target_vocab", None))
    model = {k: jnp.asarray(v, jnp.float32) for k, v in model.items()}
    return Drafter(drafter.module, {**drafter.params, PARAM_KEY: model}, source=drafter.source)


# ------------------------------------------------------------------ storage
def save(drafter_dir, model, meta: dict | None = None) -> Path:
    """Write ``drafter_dir/jspec_calibration.json`` atomically: the weights to 5 decimals,
    the token biases sparsely (ids whose bias is not 0)."""
    validate(model)
    path = Path(drafter_dir) / FILENAME
    bias = np.asarray(model["token_bias"], np.float64).round(4)
    ids = np.flatnonzero(bias)
    doc = {"format": "jspec-calibration", "version": VERSION, "features": list(FEATURES),
           "weights": np.asarray(model["weights"], np.float64).round(5).tolist(),
           "token_bias": {"vocab": int(bias.size), "ids": ids.tolist(),
                          "values": bias[ids].tolist()},
           "meta": meta or {}}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
    return path


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
    tb = doc["token_bias"]
    ids, values = np.asarray(tb["ids"], np.int64), np.asarray(tb["values"], np.float32)
    if ids.shape != values.shape or (ids.size and (ids.min() < 0 or ids.max() >= tb["vocab"])):
        raise CalibrationError(f"{path}: token_bias ids must lie in [0, {tb['vocab']}) and "
                               f"match the values one for one")
    bias = np.zeros(int(tb["vocab"]), np.float32)
    bias[ids] = values
    model = {"weights": np.asarray(doc["weights"], np.float32), "token_bias": bias}
    validate(model)
    if not all(np.isfinite(v).all() for v in model.values()):
        raise CalibrationError(f"{path}: non-finite calibration weights")
    return model
