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


def fit_records(rec: dict, **kw) -> tuple[np.ndarray, dict]:
    """Records -> (table, summary: counts and log-losses)."""
    table = C.fit(rec["step"], rec["rank"], rec["q"], rec["hit"], **kw)
    nll_cal, nll_raw = C.log_loss(table, rec["step"], rec["rank"], rec["q"], rec["hit"])
    return table, {"records": int(len(rec["hit"])), "hit_rate": float(np.mean(rec["hit"])),
                   "nll_calibrated": nll_cal, "nll_drafter": nll_raw}


def calibrate(target, drafter, seqs, *, stride: int = 2, spec: SpecConfig = CALIBRATION_SPEC,
              self_draft: bool = False, ranks: int = 8, log=print):
    """Fit on ``seqs``. Returns ``(table, summary, tf)``; with ``self_draft`` the table is the
    target-as-drafter's (``drafter`` then only names the aux layers to prepare). ``ranks=1``
    calibrates per depth only (every sibling rank shares one curve)."""
    t0 = time.time()
    if self_draft:
        spec, seqs = SELF_CALIBRATION_SPEC, seqs[:SELF_FIT_SEQS]
    tf = _teacher_forced(target, drafter, seqs, stride, spec.num_steps)
    rec = tf.records(None if self_draft else drafter, spec)
    table, summary = fit_records(rec, ranks=ranks)
    summary.update(spec=spec_name(spec), ranks=ranks, rows=int(len(tf.rows)), seconds=time.time() - t0)
    log(f"calibration ({'target as drafter' if self_draft else drafter.kind}): {summary}")
    return table, summary


def compare(target, drafter, table, seqs, *, stride: int = 2, specs=COMPARE_SPECS,
            self_table=None, prompts=(), max_new_tokens: int = 128, log=print) -> list[dict]:
    """Teacher-forced mean accept length under EAGLE-2 and calibrated selection, on ``seqs``;
    rows for the target as its own drafter when ``self_table`` is given; with ``prompts``,
    also end to end (greedy :func:`jspec.generate`, tokens per verify pass)."""
    from jspec.train.acceptance import e2e_accept
    tf = _teacher_forced(target, drafter, seqs, stride, max(s.num_steps for s in specs))
    calibrated = C.attach(drafter, table)
    rows = []
    for spec in specs:
        sources = [(drafter.kind, drafter, None)]
        if self_table is not None and spec in CEILING_SPECS:
            sources.append(("target as drafter", None, self_table))
        for name, d, tab in sources:
            t0 = time.time()
            e2 = tf.accept(d, spec)
            cal = tf.accept(calibrated if d is not None else None,
                            spec.with_selection("calibrated"), calibration=tab)
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
