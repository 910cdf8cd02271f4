"""The one timing harness every measurement in jspec uses (``jspec tune``, the serving
engine's per-occupancy pick, the benchmarks): each call runs ``warmup`` times first (the
first run compiles), then the calls are timed round-robin, one of each per round, so load
from other processes on the machine hits every variant alike and the ratios between them
stay meaningful. Each variant reports its cold first call, every timed call, the best and
the median, and its last result. :func:`interleaved` does the same for calls made of parts
(an engine serving one round of requests after another), the calls taking turns part by
part."""

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
    timed = interleaved([[calls[k]] for k in keys], repeats, warmup=warmup, seconds=seconds)
    for t in timed:
        t.result = t.result[0]
    return dict(zip(keys, timed)) if named else timed


def interleaved(calls: Sequence[Sequence[Callable[[], Any]]]
                | Mapping[Any, Sequence[Callable[[], Any]]],
                repeats: int, *, warmup: int = 1,
                seconds: Callable[[Any, float], float] | None = None):
    """:func:`round_robin` for calls made of ``U`` parts each (an engine serving rounds of
    requests one after another): in a timed round, part j of every call runs before part
    j + 1 of any, the calls' order rotating at every part, and a call's time for the round
    is the sum of its parts'. A call's parts are then spread over the whole round, so a
    slow spell of the machine (this VM's speed moves by 10% within seconds) hits every call
    alike instead of the one whose turn it was. The warm-up round runs each call's parts in
    turn. ``Timing.result``: the last round's results of the parts, a list."""
    named = isinstance(calls, Mapping)
    keys = list(calls) if named else list(range(len(calls)))
    parts = [list(calls[k]) for k in keys]
    if not parts:
        return {} if named else []
    U = len(parts[0])
    if U < 1 or any(len(p) != U for p in parts):
        raise ValueError(f"every call needs the same number (>= 1) of parts, got "
                         f"{[len(p) for p in parts]}")
    seconds = seconds or (lambda result, elapsed: elapsed)

    def run(fn):
        t0 = time.perf_counter()
        out = block(fn())
        return seconds(out, time.perf_counter() - t0), out

    out = []
    for call in parts:
        runs = [run(fn) for fn in call]
        out.append(Timing(sum(dt for dt, _ in runs), [], [r for _, r in runs]))
    n = len(parts)
    for r in range(max(0, warmup - 1) + max(1, repeats)):
        total, results = [0.0] * n, [[None] * U for _ in range(n)]
        for j in range(U):
            for i in range(n):
                c = (r * U + j + i) % n
                dt, results[c][j] = run(parts[c][j])
                total[c] += dt
        for c, t in enumerate(out):
            t.result = results[c]
            if r >= warmup - 1:
                t.times.append(total[c])
    return dict(zip(keys, out)) if named else out


def wall_s(result, elapsed: float) -> float:
    """``seconds=`` for calls returning a ``generate`` result: the time it measured itself."""
    return result.wall_s


def own_seconds(result: float, elapsed: float) -> float:
    """``seconds=`` for calls that return the seconds they measured themselves."""
    return result
