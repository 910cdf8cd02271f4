"""``jspec.tune``: pick the tree (S, K, N) from costs and acceptance measured here.

The best shape depends on the hardware (how a verify pass's cost grows with N), the batch and
the drafter (how fast acceptance decays with depth), so it is measured, not guessed:

1. **Costs** (:func:`measure_costs`), timed call by call on this machine at the batch in use:
   ``t_1`` (a 1-token target step), ``t_V(N)`` (a target pass over N tree nodes, for N in
   :data:`COST_NODES`, interpolated between) and ``step(K)`` (one drafter tree-loop step over K
   frontier nodes). One timed run of the drafter's default shape fits the rest: a fixed
   per-iteration ``overhead`` (walk, commit, bookkeeping) or, when the loop runs faster than
   its steps timed alone (it does on this CPU), a ``scale`` on the steps.
2. **Acceptance** (:func:`predict_accept`): the acceptance profile (per depth and sibling rank,
   how often a drafted node is the target's greedy token, from one wide teacher-forced draft
   run: :func:`acceptance_profile`) and the expected accept length E(S, K, N) of every grid
   shape, teacher-forced on calibration sequences (the prompts and their greedy continuations
   by the target): the drafter's real ``propose`` at each position, walked against the target's
   greedy tokens (:class:`jspec.train.acceptance.TeacherForced`). With ``forced_accept`` (the
   benchmark mode) E is min(forced, S + 1).
3. **Model**: tokens/s(S, K, N) = batch * E / (scale (t_V(N) + S step(K)) + overhead) (S
   drafter forwards per iteration: S - 1 tree-loop steps and the extend).
4. **Confirm**: the ``confirm`` best predicted shapes (and the default) are timed end to end,
   interleaved with plain decoding; the fastest *measured* one is the pick. ``exhaustive``
   times every grid shape instead, which measures the model's error and how close the pick is
   to the best shape found.

The pick is stored beside the drafter checkpoint (``jspec_tuning.json``, keyed by device kind
and batch; written whole to a temporary file, then renamed: :mod:`jspec.tune_store`), and
``generate(spec="auto")`` reads it. A drafter with a calibration model (``python -m jspec.train
calibrate``) is tuned over both node-selection policies: every tree shape also runs as ``S,K,N/cal``
(:mod:`jspec.tree.calibration`), and the pick records its policy. The E model here is the
teacher-forced measurement of each shape.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable, Sequence

import numpy as np

from jspec.spec_config import (CALIBRATED_SUFFIX, SpecConfig, SpecConfigError,  # noqa: F401
                                parse_spec as parse_shape, spec_label as shape)
from jspec.timing import round_robin, wall_s
# The cost model is this module's API too (jspec.tune.Costs, ...).
from jspec.tune_costs import (COST_NODES, COST_TOPK, Costs, fit_overhead,  # noqa: F401
                              measure_costs, overhead_from_run)
from jspec.tune_store import device_kind

log = logging.getLogger("jspec")


def default_grid(max_depth: int = 7, selections: Sequence[str] = ("eagle2",)) -> list[SpecConfig]:
    """Chains of depth 1..``max_depth`` and EAGLE-2 trees (S in 3..6, K in 2, 4, 8, N in 8,
    16, 32, 64) that the knobs allow, no wider than about two levels of K: 39 shapes. Trees
    come once per node-selection policy in ``selections`` (a chain drafts the same nodes
    under any)."""
    grid = [SpecConfig.chain(S) for S in range(1, max_depth + 1)]
    trees = []
    for S in (3, 4, 5, 6):
        for K in (2, 4, 8):
            for N in (8, 16, 32, 64):
                try:
                    sp = SpecConfig(S, K, N)
                except SpecConfigError:
                    continue
                if S <= max_depth and N <= 1 + S * K * 2:   # no tree wider than ~2 levels of K
                    trees.append(sp)
    return grid + [sp.with_selection(sel) for sel in selections for sp in trees]


def selections_for(drafter) -> tuple[str, ...]:
    """The node-selection policies a drafter can run: calibrated too when it carries a
    calibration model (``python -m jspec.train calibrate``)."""
    from jspec.tree.calibration import model_of
    return ("eagle2", "calibrated") if model_of(drafter) is not None else ("eagle2",)


def calibration_sequences(target, prompts, new_tokens: int) -> tuple[list[np.ndarray], list[int]]:
    """The prompts (token ids) followed by the target's greedy continuation of each, and the
    prompt lengths (where drafting starts)."""
    import jspec
    res = jspec.generate(target, prompts, max_new_tokens=new_tokens, temperature=0.0,
                         stop_ids=[])
    ids = [list(p) for p in _prompt_ids(target, prompts)]
    return [np.asarray(p + t, np.int32) for p, t in zip(ids, res.tokens)], [len(p) for p in ids]


def _prompt_ids(target, prompts) -> list[list[int]]:
    from jspec.plan import prompt_ids
    return prompt_ids(target, prompts)[0]


PROFILE_SPEC = SpecConfig(6, 8, 64)     # the calibration run behind the acceptance profile


def predict_accept(target, drafter, grid: Sequence[SpecConfig], seqs, *, starts=None,
                   stride: int = 1, forced_accept: float = 0.0,
                   profile: dict | None = None) -> dict[str, float]:
    """Expected accept length per grid shape: teacher-forced on ``seqs`` from ``starts`` on
    (see the module docstring), or min(forced, S + 1) in the forced benchmark mode. A dict
    passed as ``profile`` receives the acceptance profile (:func:`acceptance_profile`)."""
    if forced_accept:
        return {shape(sp): min(float(forced_accept), sp.num_steps + 1.0) for sp in grid}
    from jspec.train.acceptance import TeacherForced, aux_layers_of
    aux = aux_layers_of(drafter.module)
    depth = max([sp.num_steps for sp in grid] + [PROFILE_SPEC.num_steps])
    tf = TeacherForced(target, seqs, aux_layers=aux, stride=stride, starts=starts, max_depth=depth)
    if profile is not None:
        profile.update(acceptance_profile(tf.records(drafter, PROFILE_SPEC),
                                          PROFILE_SPEC.num_steps, PROFILE_SPEC.topk))
    return {shape(sp): tf.accept(drafter, sp) for sp in grid}


def acceptance_profile(rec: dict, depths: int, ranks: int) -> dict:
    """Per tree depth and sibling rank: how often a drafted node whose parent is on the
    target's greedy path is the target's greedy token (``rate[d][r]``, None where no parent
    was on the path), and how many such nodes were seen (``count``)."""
    D, R = depths, ranks
    rate, count = [], []
    for d in range(D):
        rate.append([]), count.append([])
        for r in range(R):
            sel = (rec["step"] == d) & (rec["rank"] == r)
            count[-1].append(int(sel.sum()))
            rate[-1].append(float(rec["hit"][sel].mean()) if sel.any() else None)
    return {"rate": rate, "count": count}


def format_profile(profile: dict) -> str:
    """The profile as a table: depth down, sibling rank across."""
    R = len(profile["rate"][0])
    lines = ["| depth | " + " | ".join(f"rank {r}" for r in range(R)) + " |",
             "|---|" + "--:|" * R]
    for d, row in enumerate(profile["rate"]):
        lines.append(f"| {d + 1} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in row)
                     + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- tuning
@dataclasses.dataclass
class TuneResult:
    pick: SpecConfig
    costs: Costs
    rows: list[dict]                 # one per grid shape: predicted (and measured) E, tokens/s
    plain_tokens_per_s: float
    device: str
    batch: int
    confirm_pick: dict | None = None  # exhaustive runs: the shortlist pick and its share of best
    profile: dict | None = None       # acceptance per depth and rank (acceptance_profile)

    def table(self) -> str:
        cols = ["S,K,N", "E pred", "E meas", "tok/s pred", "tok/s meas", "speedup meas"]
        out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        for r in self.rows:
            vals = [r["S,K,N"], r["E pred"], r.get("E meas"), r["tok/s pred"],
                    r.get("tok/s meas"), r.get("speedup meas")]
            out.append("| " + " | ".join("-" if v is None else
                                         (f"{v:.3g}" if isinstance(v, float) else str(v))
                                         for v in vals) + " |")
        return "\n".join(out)

    def shortlist_pick(self, confirm: int, default: SpecConfig | None) -> dict | None:
        """From an exhaustive run's timings: what the default tuner (the ``confirm`` best
        predicted shapes and ``default``, timed) would have picked, and its share of the
        best measured tokens/s."""
        timed = [r for r in self.rows if r.get("tok/s meas")]
        if len(timed) < len(self.rows):
            return None
        ranked = sorted(self.rows, key=lambda r: -r["tok/s pred"])
        short = ranked[:confirm] + [r for r in ranked if r["spec"] == default]
        quick = max(short, key=lambda r: r["tok/s meas"])
        best = max(timed, key=lambda r: r["tok/s meas"])
        return {"S,K,N": quick["S,K,N"], "tokens/s": quick["tok/s meas"],
                "of best": quick["tok/s meas"] / best["tok/s meas"]}

    @classmethod
    def from_dict(cls, d: dict) -> "TuneResult":
        """Inverse of :meth:`as_dict` (e.g. a ``--json`` file)."""
        rows = [{**r, "spec": parse_shape(r["S,K,N"])} for r in d["rows"]]
        return cls(parse_shape(d["pick"]), Costs.from_dict(d["costs"]), rows,
                   d["plain tokens/s"], d["device"], d["batch"], d.get("confirm pick"),
                   d.get("acceptance profile"))

    def as_dict(self) -> dict:
        rows = [{k: v for k, v in r.items() if k != "spec"} for r in self.rows]
        return {"pick": shape(self.pick), "device": self.device, "batch": self.batch,
                "plain tokens/s": self.plain_tokens_per_s, "costs": self.costs.as_dict(),
                "errors": self.errors(), "confirm pick": self.confirm_pick,
                "acceptance profile": self.profile, "rows": rows}

    def errors(self) -> dict:
        """Mean absolute relative error of the predicted E and tokens/s over the timed rows."""
        timed = [r for r in self.rows if r.get("tok/s meas")]
        rel = lambda a, b: abs(a - b) / b
        if not timed:
            return {}
        return {"timed shapes": len(timed),
                "E error": float(np.mean([rel(r["E pred"], r["E meas"]) for r in timed])),
                "tok/s error": float(np.mean([rel(r["tok/s pred"], r["tok/s meas"])
                                              for r in timed]))}


def tune_grid(drafter, grid, num_prompts: int, batch: int) -> tuple[list, SpecConfig | None]:
    """The shapes to consider (the default grid unless given, with the drafter's default
    added) and that default; refuses a drafter without a candidate pool or too few prompts."""
    if not drafter.module.has_pool:
        raise ValueError(f"tune picks EAGLE-2 trees and chains for drafters that draft a "
                         f"candidate pool; a {drafter.kind} drafter does not")
    if num_prompts < batch:
        raise ValueError(f"tune needs at least batch={batch} prompts, got {num_prompts}")
    grid = list(grid or default_grid(selections=selections_for(drafter)))
    default = drafter.default_spec
    if default is not None and shape(default) not in {shape(g) for g in grid}:
        grid.append(default)
    return grid, default


def shortlist(rows: list[dict], confirm: int, exhaustive: bool, default) -> list[dict]:
    """The rows to time end to end: all (``exhaustive``), else the ``confirm`` best predicted
    and the drafter's default shape."""
    timed = rows if exhaustive else rows[:confirm]
    if not exhaustive and default is not None and all(r["spec"] != default for r in timed):
        timed = timed + [next(r for r in rows if r["spec"] == default)]
    return timed


def time_end_to_end(timed: list[dict], gen, drafter, repeats: int, made: int) -> float:
    """Plain decoding and each row's shape timed round-robin (:func:`jspec.timing.round_robin`);
    each row gets its measured tokens/s, speedup and accept length. Returns plain tokens/s."""
    results = round_robin([gen()] + [gen(drafter=drafter, spec=r["spec"]) for r in timed],
                          repeats, seconds=wall_s)
    plain_tps = made / results[0].median
    for r, t in zip(timed, results[1:]):
        r["tok/s meas"] = made / t.median
        r["speedup meas"] = r["tok/s meas"] / plain_tps
        h = np.sum([s["accept_hist"] for s in t.result.stats], axis=0)
        r["E meas"] = float((h * np.arange(len(h))).sum() / max(1, h.sum()))
    return plain_tps


def tune(target, drafter, prompts, *, batch: int = 1, new_tokens: int = 64,
         grid: Sequence[SpecConfig] | None = None, confirm: int = 3, exhaustive: bool = False,
         repeats: int = 2, cost_repeats: int = 10, calib_tokens: int | None = None,
         stride: int = 2,
         forced_accept: float = 0.0, cost_nodes: Sequence[int] = COST_NODES,
         cost_topk: Sequence[int] = COST_TOPK,
         progress: Callable[[str], None] = print) -> TuneResult:
    """Measure, predict and confirm (see the module docstring); returns the pick and the
    grid's rows. ``prompts``: at least ``batch`` prompts (strings or token ids); the timed
    runs use the first ``batch`` of them, the calibration all of them."""
    from jspec.bench.spec import generate_in_turn

    grid, default = tune_grid(drafter, grid, len(prompts), batch)
    t0 = time.perf_counter()
    ids = _prompt_ids(target, prompts)
    context = max(len(p) for p in ids) + new_tokens
    progress(f"costs: t_1, t_V(N) for N in {tuple(cost_nodes)}, step(K) for K in "
             f"{tuple(cost_topk)} (batch {batch}, context {context}) ...")
    costs = measure_costs(target, drafter, context, batch, cost_repeats, cost_nodes, cost_topk)
    progress(f"acceptance: {len(grid)} shapes" + (" (forced)" if forced_accept else
                                                   ", teacher forced ..."))
    seqs, starts = ([], None) if forced_accept else calibration_sequences(
        target, prompts, calib_tokens or new_tokens)
    profile: dict = {}
    E = predict_accept(target, drafter, grid, seqs, starts=starts, stride=stride,
                       forced_accept=forced_accept, profile=profile)

    # A timed run generates for every prompt, ``batch`` rows at a time (the last chunk is
    # filled up with the first prompts), so E and tokens/s are measured on what calibrated.
    chunks = [(ids + ids)[i:i + batch] for i in range(0, len(ids), batch)]

    def gen(**kw):
        sp = kw.get("spec")
        if forced_accept and sp is not None:   # a shallow shape cannot accept more than S + 1
            kw["forced_accept"] = min(float(forced_accept), sp.num_steps + 1.0)
        return lambda: generate_in_turn(target, chunks, max_new_tokens=new_tokens,
                                        stop_ids=[], **kw)

    # The overhead: one timed run of the reference shape against its modelled parts.
    ref = default if default is not None else grid[0]
    costs = overhead_from_run(costs, ref, gen(drafter=drafter, spec=ref), batch)

    rows = []
    for sp in grid:
        e = E[shape(sp)]
        rows.append({"S,K,N": shape(sp), "spec": sp, "E pred": e,
                     "tok/s pred": 1000.0 * batch * e / costs.iteration_ms(sp)})
    rows.sort(key=lambda r: -r["tok/s pred"])
    timed = shortlist(rows, confirm, exhaustive, default)
    progress(f"timing {len(timed)} shapes end to end (and plain decoding), interleaved ...")
    plain_tps = time_end_to_end(timed, gen, drafter, repeats, len(chunks) * batch * new_tokens)
    best = max(timed, key=lambda r: r["tok/s meas"])
    progress(f"tuned in {time.perf_counter() - t0:.0f} s: pick ({best['S,K,N']}), "
             f"{best['tok/s meas']:.1f} tok/s, {best['speedup meas']:.2f}x plain")
    result = TuneResult(best["spec"], costs, rows, plain_tps, device_kind(), batch,
                        profile=profile or None)
    if exhaustive:
        result.confirm_pick = result.shortlist_pick(confirm, default)
    return result


def plot(result: TuneResult, path: str | os.PathLike) -> None:
    """Predicted against measured tokens/s for every timed shape, chains and trees apart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    timed = [r for r in result.rows if r.get("tok/s meas")]
    fig, ax = plt.subplots(figsize=(6, 5))
    for chain, marker in ((True, "o"), (False, "s")):
        rs = [r for r in timed if r["spec"].is_chain == chain]
        ax.scatter([r["tok/s pred"] for r in rs], [r["tok/s meas"] for r in rs], marker=marker,
                   label="chains" if chain else "trees")
        for r in rs:
            ax.annotate(r["S,K,N"], (r["tok/s pred"], r["tok/s meas"]), fontsize=6)
    lo = min(min(r["tok/s pred"], r["tok/s meas"]) for r in timed)
    hi = max(max(r["tok/s pred"], r["tok/s meas"]) for r in timed)
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
    ax.axhline(result.plain_tokens_per_s, color="gray", lw=0.8, label="plain decoding")
    ax.set_xlabel("predicted tokens/s")
    ax.set_ylabel("measured tokens/s")
    ax.set_title(f"jspec tune: pick ({shape(result.pick)}), {result.device}, "
                 f"batch {result.batch}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
