"""Measuring the engine's modes per occupancy, for :mod:`jspec.engine.policy`."""

from __future__ import annotations

import time
from typing import Sequence

from jspec.engine.engine import Engine, Request
from jspec.engine.policy import buckets_for, mode_label, uniform
from jspec.sampling import SamplingConfig


def measure(target, drafter, prompts: Sequence, candidates: Sequence, *, slots: int,
            new_tokens: int = 64, repeats: int = 2, sampling=None, max_new_cap: int | None = None,
            **engine_kw) -> dict:
    """Tokens/s of each candidate mode at each bucket, with every row of the bucket live:
    ``{bucket: {label: tokens/s}}``. Each (bucket, candidate) runs the engine on
    ``bucket`` prompts of ``prompts`` (cycled) for ``new_tokens`` each, once to compile, then
    ``repeats`` times round-robin over the candidates (so slow drift hits them alike); the
    best time counts. ``max_new_cap``: the engines' ``max_new_tokens`` (it sizes each row's
    KV, which the reference attention reads whole), as the engine being tuned has it."""
    sampling = sampling or SamplingConfig()
    # Plain decoding as the engine runs it with this drafter loaded (its state kept current).
    engines = {mode_label(m): Engine(target, drafter, slots=slots, sampling=sampling,
                                     policy=uniform(m, slots),
                                     max_new_tokens=max(new_tokens, max_new_cap or 0),
                                     **engine_kw)
               for m in candidates}
    out = {}
    for b in buckets_for(slots):
        # No stop ids: every row runs its new_tokens, so all b rows stay live (bucket b).
        reqs = [Request(prompts[i % len(prompts)], new_tokens, stop_ids=[]) for i in range(b)]
        best = {k: float("inf") for k in engines}
        toks = {}
        for rep in range(repeats + 1):
            for k, eng in engines.items():
                t = time.perf_counter()
                res = eng.generate(reqs)
                dt = time.perf_counter() - t
                toks[k] = sum(len(c.tokens) for c in res)
                if rep:
                    best[k] = min(best[k], dt)
        out[b] = {k: toks[k] / best[k] for k in engines}
    return out


