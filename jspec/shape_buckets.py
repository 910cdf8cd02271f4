"""The static shapes of a ``generate`` call, rounded up to buckets, so that calls differing
only in their sizes share one compiled program (``jspec.generate``'s default; the engine
buckets its own: :mod:`jspec.engine.buckets`).

- rows: a power of two (1, 2, 4, 8, ...); the padding rows ask for 0 new tokens, so they are
  done before the loop's first step (their prefill is the cost);
- the prompt block: the prompt bucket (16) times a power of two (16, 32, 64, ...), which also
  keeps a session of varied prompt lengths to a few programs (multiples of 16 would make 25
  below 400 tokens);
- the KV length of a row: a power of two, at least 256, holding the padded prompt, the most
  new tokens asked and the speculative overshoot; the output buffer takes what is left, so
  ``max_new_tokens`` is a per-row runtime bound and changing it within the bucket compiles
  nothing;
- (the stop-id table's width is a multiple of 8 already: :func:`jspec.plan.stop_table`).

Sampling settings are runtime values too (:class:`jspec.sampling.RowSampling`): one program
serves every temperature, top-k and top-p (a greedy call compiles an argmax only).
docs/performance.md has what the padding costs.
"""

from __future__ import annotations

import numpy as np

MIN_KV = 256


def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def rows(batch: int) -> int:
    return pow2_at_least(batch)


def prompt(longest: int, base: int) -> int:
    """The padded prompt block for a longest prompt of ``longest`` tokens."""
    return base * pow2_at_least(-(-int(longest) // base))


def kv(need: int, max_positions: int | None = None) -> int:
    """Slots per row for a row needing ``need`` (padded prompt + new tokens + overshoot),
    no more than ``max_positions`` (the model's) unless ``need`` itself is more."""
    out = max(MIN_KV, pow2_at_least(need))
    return out if max_positions is None else min(out, max(need, max_positions))


def pad_rows(batch: int, lens, limits, stops):
    """``lens``, ``limits`` and the stop table with padding rows up to ``batch``: a 1-token
    prompt asking for nothing, no stop ids."""
    pad = batch - len(lens)
    if pad <= 0:
        return lens, limits, stops
    return (np.concatenate([lens, np.ones(pad, np.int32)]),
            np.concatenate([limits, np.zeros(pad, np.int32)]),
            np.concatenate([stops, np.full((pad, stops.shape[1]), -1, np.int32)]))
