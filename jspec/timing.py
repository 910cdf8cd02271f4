"""The one timing harness every measurement in jspec uses (``jspec tune``, the serving
engine's per-occupancy pick, the benchmarks): each call runs ``warmup`` times first (the
first run compiles), then the calls are timed round-robin, one of each per round, so load
from other processes on the machine hits every variant alike and the ratios between them
stay meaningful. Each variant reports its cold first call, every timed call, the best and
the median, and its last result."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax


@dataclasses.dataclass
class Timing:
    first: float                  # seconds of the first call (cold: compilation included)
    times: list[float]            # seconds of each timed call, in order
    result: Any = None            # the last call's result

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return float(statistics.median(self.times))


def block(x):
    """``jax.block_until_ready`` that tolerates non-array leaves (ints, strings, None)."""
    return jax.tree.map(lambda a: a.block_until_ready() if isinstance(a, jax.Array) else a, x)


def round_robin(calls: Sequence[Callable[[], Any]] | Mapping[Any, Callable[[], Any]],
                repeats: int, *, warmup: int = 1,
                seconds: Callable[[Any, float], float] | None = None):
    """Time zero-argument ``calls`` (a sequence, or a mapping name -> call): ``warmup`` rounds
    untimed (the first call of each counts as ``first``), then ``repeats`` (at least 1) timed
    rounds. Each round starts one call later than the one before (for three calls: abc, bca,
    cab, ...), so no call always runs right after the same other one: a call that leaves the
    caches cold or the allocator busy would otherwise slow one fixed neighbour in every
    round. ``seconds(result, elapsed)`` says what a call
    took when it times itself (a ``generate`` result's ``wall_s``); by default the wall time
    until every array it returned is ready. Returns a :class:`Timing` per call, in a list or
    a dict like ``calls``."""
    named = isinstance(calls, Mapping)
    keys = list(calls) if named else list(range(len(calls)))
    fns = [calls[k] for k in keys]
    seconds = seconds or (lambda result, elapsed: elapsed)

    def run(fn):
        t0 = time.perf_counter()
        out = block(fn())
        return seconds(out, time.perf_counter() - t0), out

    out = []
    for fn in fns:
        first, res = run(fn)
        out.append(Timing(first, [], res))
    n = len(fns)
    for r in range(max(0, warmup - 1) + max(1, repeats)):
        for i in range(n):
            t, fn = out[(r + i) % n], fns[(r + i) % n]
            dt, t.result = run(fn)
            if r >= warmup - 1:
                t.times.append(dt)
    return dict(zip(keys, out)) if named else out


def wall_s(result, elapsed: float) -> float:
    """``seconds=`` for calls returning a ``generate`` result: the time it measured itself."""
    return result.wall_s


def own_seconds(result: float, elapsed: float) -> float:
    """``seconds=`` for calls that return the seconds they measured themselves."""
    return result
