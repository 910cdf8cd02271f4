"""Acceptance-aware node selection: rank draft-tree nodes by a *calibrated* probability of
being accepted instead of the drafter's own probability (EAGLE-2).

Under greedy verification a drafted node survives when its token is the target's argmax
after its parent, and its parent survived. A drafter's probabilities are not calibrated
for that: a rank-0 token at q = 0.3 is accepted far more often than 30% of the time, a
rank-2 token at the same q far less, a runner-up whose rank-0 sibling is sure almost never,
some tokens (the rest of a word, punctuation) are surer than their q says, and a drafter has
habitual confusions (it ranks "he" over "she" where the target says "she"). So the model here
gives the probability that a node is the target's greedy token *given its parent is on the
greedy path*, as a logistic regression per (tree step, sibling rank) cell plus two biases:

    rate = sigmoid(weights[min(step, D-1), min(rank, R-1)] . x
                   + token_bias[token_key] + pair_bias[pair_key])
    x    = (1, log q, log q of the rank-0 sibling, log q of the rank-1 sibling,
            parent is rank 0, parent is a later rank, log q of the parent)

(:data:`FEATURES`; a root child's parent is the root: both parent flags 0, its log q 0; log
q is floored at :data:`LOGQ_FLOOR`). ``token_key`` is the node's token (target vocabulary)
and whether it is rank 0 or later, ``2 * token + (rank > 0)``; ``pair_key`` hashes that with
its *rival*, the rank-1 sibling's token for a rank-0 node and the rank-0 sibling's for a later
one, into :data:`PAIR_BUCKETS` buckets (:func:`pair_keys`). Everything it reads is already in
the draft loop, so scoring costs a few elementwise ops and two gathers per tree step.

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
is refused with the command that refits it), read back by :func:`jspec.drafters.load_drafter`
(its I/O, and attaching a model to a drafter, in :mod:`jspec.drafters.calibration`).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

PARAM_KEY = "calibration"       # where a drafter's params carry the model for the draft loop
VERSION = 2
FEATURES = ("bias", "logq", "logq_rank0", "logq_rank1", "parent_rank0", "parent_later",
            "parent_logq")
LOGQ_FLOOR = -20.0              # log q below this (or -inf: a missing sibling) reads as this
PAIR_BITS = 18
PAIR_BUCKETS = 1 << PAIR_BITS   # hashed (token, rival, rank 0 or later) biases: 1 MB of float32


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


def pair_keys(tokens, xp=jnp):
    """``tokens [..., K]``: one parent's top-K children in rank order (target vocabulary).
    Returns ``(token_key, pair_key) [..., K]`` (see the module docstring). With K = 1 a node
    is its own rival. The hash is multiplicative over uint32 (wrapping alike in numpy and
    XLA), its top :data:`PAIR_BITS` bits the bucket."""
    t = xp.asarray(tokens).astype(xp.uint32)
    K = t.shape[-1]
    later = (xp.arange(K) > 0).astype(xp.uint32)
    first = xp.broadcast_to(t[..., :1], t.shape)
    rival = xp.where(later > 0, first, xp.broadcast_to(t[..., 1:2], t.shape) if K > 1 else t)
    h = (t * xp.uint32(0x9E3779B1)) ^ ((rival + xp.uint32(0x7F4A7C15)) * xp.uint32(0x85EBCA77)) \
        ^ (later * xp.uint32(0xC2B2AE3D))
    token_key = (t * xp.uint32(2) + later).astype(xp.int32)
    return token_key, (h >> xp.uint32(32 - PAIR_BITS)).astype(xp.int32)


def pool_features(logq, parents, tokens, K: int, xp=jnp):
    """:func:`node_features` and :func:`pair_keys` of every candidate of an EAGLE-2 pool
    (``logq, parents, tokens [B, M]`` in the layout of :mod:`jspec.tree.select`: siblings are
    K contiguous entries with one parent) -> ``(x [B, M, F], token_key, pair_key [B, M])``."""
    B, M = logq.shape
    sib = logq.reshape(B, M // K, K)
    par = parents[:, ::K]                                             # [B, groups]
    safe = xp.clip(par, 0, M - 1)
    plq = xp.take_along_axis(logq, safe, axis=1)
    x = node_features(sib, xp.where(par < 0, -1, par % K), xp.where(par < 0, 0.0, plq), xp)
    tk, pk = pair_keys(tokens.reshape(B, M // K, K), xp)
    return x.reshape(B, M, len(FEATURES)), tk.reshape(B, M), pk.reshape(B, M)


def log_rates(model, step, rank, x, token_key, pair_key):
    """Calibrated log-rates of nodes at tree ``step`` (may be traced) with sibling ``rank``,
    features ``x [..., F]`` and keys (:func:`pair_keys`), all broadcast together."""
    w = jnp.asarray(model["weights"])
    D, R, _ = w.shape
    rows = w[jnp.minimum(step, D - 1), jnp.minimum(rank, R - 1)]        # [..., F]
    z = jnp.sum(jnp.asarray(x, jnp.float32) * rows, -1) \
        + jnp.asarray(model["token_bias"])[token_key] + jnp.asarray(model["pair_bias"])[pair_key]
    return jax.nn.log_sigmoid(z)


def node_scores(selection: str, logq: jax.Array, step, params, tokens=None, parent_rank=None,
                parent_logq=None) -> jax.Array:
    """Per-node log-scores of one tree step's candidates.

    ``logq [..., K]``: drafter log-probabilities of a parent's top-K children, siblings in
    rank order on the last axis; ``step``: the tree step (0 for the root's children; may be
    traced). EAGLE-2 scores a node by ``logq``; ``calibrated`` by the model in
    ``params["calibration"]``, which also reads the children's target-vocabulary ``tokens``
    (the shape of ``logq``, siblings in rank order too) and their parent's ``parent_rank``
    and ``parent_logq`` (``logq``'s shape without the last axis; None: the parent is the
    root, rank -1 and log q 0).
    """
    if selection == "eagle2":
        return logq
    if parent_rank is None:
        parent_rank = jnp.full(logq.shape[:-1], -1, jnp.int32)
        parent_logq = jnp.zeros(logq.shape[:-1], jnp.float32)
    x = node_features(logq, parent_rank, parent_logq)
    out = log_rates(params[PARAM_KEY], step, jnp.arange(logq.shape[-1]), x, *pair_keys(tokens))
    return jnp.where(jnp.isnan(logq), -jnp.inf, out)


# ------------------------------------------------------------------ the model a drafter carries
KEYS = ("weights", "token_bias", "pair_bias")


def validate(model, vocab: int | None = None) -> None:
    """Shape checks of a model ``{"weights": [D, R, F], "token_bias": [2 * vocab],
    "pair_bias": [PAIR_BUCKETS]}``."""
    if not isinstance(model, dict) or set(model) != set(KEYS):
        raise CalibrationError(f"a calibration model is a dict with keys {list(KEYS)}, got "
                               + (f"keys {sorted(model)}" if isinstance(model, dict)
                                  else type(model).__name__))
    w, b, p = (np.shape(model[k]) for k in KEYS)
    if len(w) != 3 or w[2] != len(FEATURES) or min(w) < 1:
        raise CalibrationError(f"calibration weights must be [depth, rank, {len(FEATURES)}], "
                               f"got {list(w)}")
    if len(b) != 1 or b[0] % 2 or (vocab is not None and b[0] != 2 * vocab):
        want = 2 * vocab if vocab else "2 * vocab"
        raise CalibrationError(f"calibration token_bias must be [{want}] (rank 0 and later "
                               f"ranks of each target token), got {list(b)}")
    if p != (PAIR_BUCKETS,):
        raise CalibrationError(f"calibration pair_bias must be [{PAIR_BUCKETS}], got {list(p)}")


def model_of(drafter):
    """The calibration model a drafter carries in its params, or None."""
    params = drafter.params
    return params.get(PARAM_KEY) if isinstance(params, dict) else None
