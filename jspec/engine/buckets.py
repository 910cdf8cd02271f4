"""The engine's static shapes: the batch buckets its decode programs are compiled for and
the prompt buckets its insert programs are compiled for."""

from __future__ import annotations


def buckets_for(slots: int) -> list[int]:
    """1, 2, 4, ... below ``slots``, then ``slots``."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


def prompt_buckets(base: int, longest: int) -> list[int]:
    """Prompt lengths an insert program is compiled for: ``base`` doubling up to ``longest``
    (the last bucket is ``longest`` itself)."""
    if longest < 1:
        raise ValueError("max_len leaves no room for a prompt")
    out, b = [], base
    while b < longest:
        out.append(b)
        b *= 2
    return out + [longest]


def bucket_of(buckets: list[int], n: int) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``n``."""
    return next(b for b in buckets if b >= n)
