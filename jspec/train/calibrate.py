"""Fit a drafter's acceptance calibration (:mod:`jspec.tree.calibration`) on held-out text,
and compare node selection policies teacher forced.

Records come from the drafter's real EAGLE-2 draft loop at a wide shape (default S=7, K=8,
so every depth and rank a served tree uses is observed) at every committed length of the
calibration sequences; only candidates whose parent is on the target's greedy path count.
The comparison runs on *other* held-out sequences, at equal (S, K, N), both policies in
one run; with ``ceiling`` it adds the target as its own drafter at (5, 4, 8), calibrated on
the first of the calibration sequences.
"""

from __future__ import annotations

import time

import numpy as np

from jspec.spec_config import SpecConfig
from jspec.train.acceptance import TeacherForced, aux_layers_of, spec_name
from jspec.drafters.calibration import attach
from jspec.tree import calibration as C

CALIBRATION_SPEC = SpecConfig(7, 8, 64)
COMPARE_SPECS = (SpecConfig(5, 4, 8), SpecConfig(6, 8, 32))
# The target as its own drafter costs K uncached target passes per tree step: its ceiling is
# fitted on fewer sequences at a narrower shape and compared at (5, 4, 8) only.
SELF_CALIBRATION_SPEC = SpecConfig(6, 4, 16)
SELF_FIT_SEQS = 10
CEILING_SPECS = (SpecConfig(5, 4, 8),)


def _teacher_forced(target, drafter, seqs, stride, depth):
    return TeacherForced(target, seqs, aux_layers=aux_layers_of(drafter.module), stride=stride,
                         max_depth=depth)


def _logistic(x, y, offset, prior, l2: float, iters: int = 30):
    """Newton's method with backtracking for a logistic regression with a fixed offset, its
    weights pulled towards ``prior`` by an L2 term (which also keeps a separable cell, one the
    drafter always or never gets right, finite)."""
    def loss(w):
        z = offset + x @ w
        return np.sum(np.logaddexp(0, z) - y * z) + 0.5 * l2 * np.sum((w - prior) ** 2)
    eye, w = l2 * np.eye(x.shape[1]), prior.copy()
    cur = loss(w)
    for _ in range(iters):
        p = 1 / (1 + np.exp(-np.clip(offset + x @ w, -40, 40)))
        g = x.T @ (p - y) + l2 * (w - prior)
        step, t = np.linalg.solve((x * (p * (1 - p))[:, None]).T @ x + eye, g), 1.0
        while t > 1e-4 and loss(w - t * step) > cur:
            t /= 2
        if t <= 1e-4:
            break
        w = w - t * step
        new = loss(w)
        if cur - new < 1e-9 * max(1.0, abs(cur)):
            break
        cur = new
    return w


def _bias(keys, y, z, bias, l2: float, iters: int = 30):
    """Diagonal Newton for additive biases over ``keys`` on top of logits ``z``, each pulled
    towards 0 by ``l2`` (pseudo-observations' worth: a rare key keeps a small bias)."""
    n = bias.size
    for _ in range(iters):
        p = 1 / (1 + np.exp(-np.clip(z + bias[keys], -40, 40)))
        bias = bias - (np.bincount(keys, p - y, n) + l2 * bias) \
            / (np.bincount(keys, p * (1 - p), n) + l2)
    return bias


def fit(rec: dict, vocab: int, *, depths: int = 8, ranks: int = 8, l2: float = 1.0,
        token_l2: float = 10.0, pair_l2: float = 3.0, pairs: bool = True,
        rounds: int = 3) -> dict:
    """Records (:meth:`TeacherForced.records`) -> a calibration model
    (:mod:`jspec.tree.calibration`): ``weights [depths, ranks, F]``, ``token_bias
    [2 * vocab]``, ``pair_bias [PAIR_BUCKETS]``.

    Each (step, rank) cell is a logistic regression on the node features, pulled by ``l2``
    towards its neighbour: the same rank at the previous step, or at step 0 the previous
    rank (a 1% rate for the first cell). A cell with few records thus stays close to its
    neighbour, and one with none copies it. The token and pair biases are diagonal Newton
    fits with L2 priors (``token_l2``, ``pair_l2``), each on top of what comes before it;
    the three alternate ``rounds`` times. ``pairs=False`` leaves the pair biases at 0: they
    are the most context-specific term, the first to stop transferring when the text served
    differs from the text fitted on.
    """
    x, y = rec["x"].astype(np.float64), rec["hit"].astype(np.float64)
    tk, pk = rec["token_key"], rec["pair_key"]
    s, r = np.minimum(rec["step"], depths - 1), np.minimum(rec["rank"], ranks - 1)
    W = np.zeros((depths, ranks, x.shape[1]))
    first = np.zeros(x.shape[1])
    first[0] = np.log(0.01 / 0.99)
    tb, pb = np.zeros(2 * vocab), np.zeros(C.PAIR_BUCKETS)
    for _ in range(rounds):
        offset = tb[tk] + pb[pk]
        for d in range(depths):
            for k in range(ranks):
                prior = W[d - 1, k] if d else (W[d, k - 1] if k else first)
                sel = (s == d) & (r == k)
                W[d, k] = _logistic(x[sel], y[sel], offset[sel], prior, l2) if sel.any() else prior
        z = np.einsum("nf,nf->n", x, W[s, r])
        tb = _bias(tk, y, z + pb[pk], tb, token_l2)
        if pairs:
            pb = _bias(pk, y, z + tb[tk], pb, pair_l2)
    return {"weights": W.astype(np.float32), "token_bias": tb.astype(np.float32),
            "pair_bias": pb.astype(np.float32)}


def log_loss(model: dict, rec: dict) -> tuple[float, float]:
    """Mean negative log-likelihood of ``hit`` under the model and under the drafter's raw q:
    how much better the model predicts acceptance."""
    hit = np.asarray(rec["hit"], bool)
    cal = np.asarray(C.log_rates(model, rec["step"], rec["rank"], rec["x"], rec["token_key"],
                                 rec["pair_key"]))

    def nll(logp):
        p = np.clip(np.exp(logp), 1e-6, 1 - 1e-6)
        return float(-np.mean(np.where(hit, np.log(p), np.log1p(-p))))
    return nll(cal), nll(np.log(np.clip(rec["q"], 1e-12, 1.0)))


def fit_records(rec: dict, vocab: int, **kw) -> tuple[dict, dict]:
    """Records -> (model, summary: counts and log-losses)."""
    model = fit(rec, vocab, **kw)
    nll_cal, nll_raw = log_loss(model, rec)
    return model, {"records": int(len(rec["hit"])), "hit_rate": float(np.mean(rec["hit"])),
                   "nll_calibrated": nll_cal, "nll_drafter": nll_raw}


def calibrate(target, drafter, seqs, *, stride: int = 2, spec: SpecConfig = CALIBRATION_SPEC,
              self_draft: bool = False, ranks: int = 8, pairs: bool = True, log=print):
    """Fit on ``seqs``. Returns ``(model, summary)``; with ``self_draft`` the model is the
    target-as-drafter's (``drafter`` then only names the aux layers to prepare). ``ranks=1``
    fits one cell per depth (every sibling rank shares its weights)."""
    t0 = time.time()
    if self_draft:
        spec, seqs = SELF_CALIBRATION_SPEC, seqs[:SELF_FIT_SEQS]
    tf = _teacher_forced(target, drafter, seqs, stride, spec.num_steps)
    rec = tf.records(None if self_draft else drafter, spec)
    model, summary = fit_records(rec, target.config.vocab_size, ranks=ranks, pairs=pairs)
    summary.update(spec=spec_name(spec), ranks=ranks, pairs=pairs, rows=int(len(tf.rows)),
                   seconds=time.time() - t0)
    log(f"calibration ({'target as drafter' if self_draft else drafter.kind}): {summary}")
    return model, summary


def compare(target, drafter, model, seqs, *, stride: int = 2, specs=COMPARE_SPECS,
            self_model=None, prompts=(), max_new_tokens: int = 128, log=print) -> list[dict]:
    """Teacher-forced mean accept length under EAGLE-2 and calibrated selection, on ``seqs``;
    rows for the target as its own drafter when ``self_model`` is given; with ``prompts``,
    also end to end (greedy :func:`jspec.generate`, tokens per verify pass)."""
    from jspec.train.acceptance import e2e_accept
    tf = _teacher_forced(target, drafter, seqs, stride, max(s.num_steps for s in specs))
    calibrated = attach(drafter, model)
    rows = []
    for spec in specs:
        sources = [(drafter.kind, drafter, None)]
        if self_model is not None and spec in CEILING_SPECS:
            sources.append(("target as drafter", None, self_model))
        for name, d, mod in sources:
            t0 = time.time()
            e2 = tf.accept(d, spec)
            cal = tf.accept(calibrated if d is not None else None,
                            spec.with_selection("calibrated"), calibration=mod)
            row = {"drafter": name, "spec": spec_name(spec), "eagle2": e2, "calibrated": cal,
                   "gain": cal / e2 - 1, "rows": int(len(tf.rows)), "seconds": time.time() - t0}
            if prompts and d is not None:
                row["e2e eagle2"] = e2e_accept(target, drafter, prompts, spec, max_new_tokens)
                row["e2e calibrated"] = e2e_accept(target, calibrated, prompts,
                                                   spec.with_selection("calibrated"), max_new_tokens)
            log(f"  {row}")
            rows.append(row)
    return rows


def format_rows(rows) -> str:
    head = ("| drafter | spec | teacher forced: EAGLE-2 | calibrated | gain "
            "| end to end: EAGLE-2 | calibrated |")
    lines = [head, "|---|---|--:|--:|--:|--:|--:|"]
    f = lambda r, k: f"{r[k]:.3f}" if k in r else "-"
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['spec']} | {r['eagle2']:.3f} | {r['calibrated']:.3f} "
                     f"| {r['gain']:+.1%} | {f(r, 'e2e eagle2')} | {f(r, 'e2e calibrated')} |")
    return "\n".join(lines)
