"""Measuring the engine's modes per occupancy, for :mod:`jspec.engine.policy`."""

from __future__ import annotations

import functools
from typing import Sequence

from jspec.engine.engine import Engine, Request
from jspec.engine.policy import buckets_for, mode_label, uniform
from jspec.sampling import SamplingConfig
from jspec.timing import interleaved

#: At least this many distinct prompts are timed per bucket. Acceptance varies by prompt far
#: more than cost does: one prompt at one live slot measured 1.06x plain for the drafter's
#: best mode where 8 prompts in turn gave 1.60x (the shipped EAGLE-3, 64 new tokens each).
MIN_PROMPTS = 8


def full_rounds(prompts: Sequence, bucket: int, new_tokens: int,
                min_prompts: int = MIN_PROMPTS, min_rounds: int = 1) -> list[list[Request]]:
    """Batches of ``bucket`` requests that keep every slot of the bucket live (no stop ids:
    each runs ``new_tokens``), as many as it takes to cover ``min_prompts`` successive prompts
    of ``prompts`` (cycled), so a small bucket is not timed on one prompt's acceptance, and
    at least ``min_rounds``."""
    rounds = max(min_rounds, -(-min(min_prompts, len(prompts)) // bucket))
    return [[Request(prompts[(r * bucket + i) % len(prompts)], new_tokens, stop_ids=[])
             for i in range(bucket)] for r in range(rounds)]


def serve_round(engine: Engine, requests: list[Request]) -> int:
    """Serve one round of requests; the tokens made."""
    return sum(len(c.tokens) for c in engine.generate(requests))


def best_rates(engines: dict, rounds: list[list[Request]], repeats: int) -> dict:
    """Tokens/s of each engine on ``rounds`` (:func:`jspec.timing.interleaved`: one untimed
    pass to compile, then ``repeats`` passes in which the engines take turns round by
    round, the best pass counting)."""
    return {k: sum(t.result) / t.best for k, t in timed_rounds(engines, rounds, repeats).items()}


def timed_rounds(engines: dict, rounds: list[list[Request]], repeats: int) -> dict:
    """:class:`jspec.timing.Timing` of each engine serving ``rounds``, the engines taking
    turns round by round (:func:`jspec.timing.interleaved`); ``result``: tokens per round."""
    return interleaved({k: [functools.partial(serve_round, e, r) for r in rounds]
                        for k, e in engines.items()}, repeats)


def measure(target, drafter, prompts: Sequence, candidates: Sequence, *, slots: int,
            new_tokens: int = 64, repeats: int = 2, sampling=None, max_new_cap: int | None = None,
            **engine_kw) -> dict:
    """Tokens/s of each candidate mode at each bucket, with every row of the bucket live:
    ``{bucket: {label: tokens/s}}``, from :func:`best_rates` over :func:`full_rounds`.
    ``max_new_cap``: the engines' ``max_new_tokens`` (it sizes each row's KV, which the
    reference attention reads whole), as the engine being tuned has it."""
    sampling = sampling or SamplingConfig()
    # Plain decoding as the engine runs it with this drafter loaded (the drafter left alone;
    # the rounds never switch modes, so no catch-up is timed).
    engines = {mode_label(m): Engine(target, drafter, slots=slots, sampling=sampling,
                                     policy=uniform(m, slots),
                                     max_new_tokens=max(new_tokens, max_new_cap or 0),
                                     **engine_kw)
               for m in candidates}
    return {b: best_rates(engines, full_rounds(prompts, b, new_tokens), repeats)
            for b in buckets_for(slots)}
