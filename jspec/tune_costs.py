"""``jspec tune``'s cost model: milliseconds of a verify of N nodes and of a drafter step of K
frontier nodes, measured in isolation (:func:`jspec.bench.spec_simulate.micro_costs`) and
fitted to one end-to-end run (:func:`fit_overhead`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jspec.spec_config import SpecConfig, spec_label as shape
from jspec.timing import round_robin, wall_s

COST_NODES = (2, 4, 8, 16, 32, 64)      # t_V(N) is measured here, linearly interpolated between
COST_TOPK = (1, 2, 4, 8)                # step(K) is measured for these K


@dataclasses.dataclass
class Costs:
    """Milliseconds at ``batch`` rows: ``t1``; ``tv[N]``; ``step[K]``; ``overhead`` per
    iteration (fitted, see :func:`fit_overhead`)."""
    batch: int
    t1: float
    tv: dict[int, float]
    step: dict[int, float]
    overhead: float = 0.0
    scale: float = 1.0       # in-loop time / isolated micro-benchmark time (see fit_overhead)

    def t_verify(self, N: int) -> float:
        ns = sorted(self.tv)
        return float(np.interp(N, ns, [self.tv[n] for n in ns]))

    def t_step(self, K: int) -> float:
        ks = sorted(self.step)
        return float(np.interp(K, ks, [self.step[k] for k in ks]))

    def steps_ms(self, spec: SpecConfig) -> float:
        """The modelled steps of one iteration, unscaled: a verify and S drafter steps."""
        return self.t_verify(spec.num_draft_tokens) + spec.num_steps * self.t_step(spec.topk)

    def iteration_ms(self, spec: SpecConfig) -> float:
        return self.scale * self.steps_ms(spec) + self.overhead

    def as_dict(self) -> dict:
        return {"batch": self.batch, "t_1 ms": self.t1,
                "t_V/t_1": {n: v / self.t1 for n, v in sorted(self.tv.items())},
                "c(K)": {k: v / self.t1 for k, v in sorted(self.step.items())},
                "overhead/t_1": self.overhead / self.t1, "scale": self.scale}

    @classmethod
    def from_dict(cls, c: dict) -> "Costs":
        """Inverse of :meth:`as_dict` (JSON turns the N and K keys into strings)."""
        t1 = c["t_1 ms"]
        return cls(c["batch"], t1, {int(n): v * t1 for n, v in c["t_V/t_1"].items()},
                   {int(k): v * t1 for k, v in c["c(K)"].items()}, c["overhead/t_1"] * t1,
                   c.get("scale", 1.0))


def measure_costs(target, drafter, context: int, batch: int = 1, repeats: int = 10,
                  nodes: Sequence[int] = COST_NODES, topk: Sequence[int] = COST_TOPK) -> Costs:
    """Time ``t_1``, ``t_V(N)`` and ``step(K)`` against a cache of ``context`` positions (see
    :func:`jspec.bench.spec_simulate.micro_costs`: random cache contents, every variant timed in
    turn, call by call). t_V(N) comes from chains of N nodes, step(K) from 3-step trees."""
    from jspec.bench.spec_simulate import micro_costs
    probes = [SpecConfig.chain(n - 1) for n in nodes]
    probes += [SpecConfig(3, k, 2 * k + 1) for k in topk if k > 1]
    m = micro_costs(target, context, repeats, specs=probes, drafter=drafter, batch=batch)
    tv, steps = {}, {}
    for sp in probes:
        r = m["specs"][shape(sp)]
        if sp.is_chain:
            tv[sp.num_draft_tokens] = r["t_V ms"]
        steps.setdefault(sp.topk, []).append(r["draft step ms"])
    return Costs(batch, m["t_1 ms"], tv, {k: float(np.median(v)) for k, v in steps.items()})


def fit_overhead(costs: Costs, spec: SpecConfig, wall_ms_per_iteration: float) -> Costs:
    """Fit the model to one measured run: the time spent outside the modelled verify and
    draft steps becomes ``overhead``; a run faster than the model (the steps cost less inside
    the compiled loop than timed alone: 0.6x on this CPU) scales the steps instead."""
    model = costs.steps_ms(spec)
    if wall_ms_per_iteration >= model:
        return dataclasses.replace(costs, overhead=wall_ms_per_iteration - model, scale=1.0)
    return dataclasses.replace(costs, overhead=0.0, scale=wall_ms_per_iteration / model)


# --------------------------------------------------------------------------- acceptance


def overhead_from_run(costs: Costs, spec: SpecConfig, run, batch: int) -> Costs:
    """:func:`fit_overhead` to one timed call of ``run`` (a zero-argument ``generate`` of
    ``spec`` over chunks of ``batch`` rows): a chunk's loop runs until its slowest row is
    done."""
    t, = round_robin([run], 1, seconds=wall_s)
    stats = t.result.stats
    iters = sum(max(s["iterations"] for s in stats[i:i + batch])
                for i in range(0, len(stats), batch))
    return fit_overhead(costs, spec, 1000.0 * t.median / iters)
