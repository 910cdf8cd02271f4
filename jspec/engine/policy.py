"""Which spec the engine runs at each occupancy.

The engine gathers its live slots into the smallest bucket (1, 2, 4, ..., slots) that holds
them and runs that bucket's decode program, so a bucket's cost per iteration is what its
batch costs. Whether speculation pays there is a measured question: a verify of N nodes per
row costs more at a large batch, where the step is no longer bound by reading the weights,
while the accept length stays the same (vLLM #26504 saw acceptance flat from batch 1 to 32
while the right choice flipped). So the choice is made from throughput measured on this
machine, per bucket: :func:`jspec.engine.tuning.measure` times each candidate (plain
decoding among them) in the engine's own decode program with every row of the bucket live,
and :func:`pick` keeps the fastest in a :class:`Policy` (plain on a near-tie:
:data:`PLAIN_MARGIN`). ``python -m jspec tune --occupancy``
stores it beside the drafter (``jspec_tuning.json``, one entry per device kind and bucket)
for ``Engine(policy="auto")``. The costs depend on the engine's row length (``max_len``: the
reference attention reads a row's whole allocation), so tune with the serving cap
(``--max-new-cap``).

Switching never changes output: the engine samples by position keys
(:mod:`jspec.engine.programs`), and greedy output is the target's whatever the spec.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from jspec.engine.buckets import buckets_for  # noqa: F401  (re-exported)
from jspec.engine.programs import PLAIN
from jspec.plan import resolve_drafting
from jspec.spec_config import parse_spec, spec_label
from jspec import tune_store

log = logging.getLogger("jspec")


def mode_label(mode) -> str:
    """``"plain"``, ``"default"`` (the drafter's spec) or ``"S,K,N[/cal]"``."""
    if mode == PLAIN:
        return PLAIN
    return "default" if mode is None else spec_label(mode)


def parse_mode(text: str):
    """Inverse of :func:`mode_label`."""
    if text == PLAIN:
        return PLAIN
    return None if text == "default" else parse_spec(text)


@dataclasses.dataclass(frozen=True)
class Policy:
    """``picks``: bucket -> a SpecConfig, None (the drafter's default) or ``"plain"``."""

    picks: dict

    def __getitem__(self, bucket: int):
        return self.picks[bucket]

    def specs(self) -> list:
        """The speculative modes it runs (plain excluded), each once."""
        out = []
        for m in self.picks.values():
            if m != PLAIN and m not in out:
                out.append(m)
        return out

    def check_buckets(self, buckets: Sequence[int]) -> None:
        missing = [b for b in buckets if b not in self.picks]
        if missing:
            raise ValueError(f"the policy has no pick for bucket(s) {missing} of {list(buckets)}")

    def describe(self) -> str:
        return ", ".join(f"{b}: {mode_label(m)}" for b, m in sorted(self.picks.items()))

    @classmethod
    def stored(cls, drafter, buckets: Sequence[int], device: str | None = None) -> "Policy":
        """The picks ``jspec tune --occupancy`` stored for this drafter and device; a bucket
        without one runs the drafter's default spec (with a warning)."""
        picks, missing = {}, []
        for b in buckets:
            m = tune_store.stored_mode(drafter, b, device)
            if m is tune_store.MISSING:
                missing.append(b)
                m = None
            picks[b] = parse_mode(m) if isinstance(m, str) else m
        if missing:
            log.warning("policy='auto': no stored occupancy pick for bucket(s) %s on %s; they run "
                        "the drafter's default spec. Run `python -m jspec tune --occupancy` to "
                        "measure them.", missing, tune_store.device_kind())
        return cls(picks)


def uniform(mode, slots: int) -> Policy:
    """One mode at every bucket."""
    return Policy({b: mode for b in buckets_for(slots)})


#: A spec is picked over plain decoding only when it measured at least this much faster.
#: Back-to-back timings of the same engine on a shared 2-core CPU moved by up to 10%, and a
#: wrong speculative pick costs up to ~0.8x plain at full slots, while a wrong plain pick
#: forgoes at most this margin; so near-ties go to plain, which needs no drafter work.
PLAIN_MARGIN = 1.05


def pick(rates: dict, candidates: Sequence, margin: float = PLAIN_MARGIN) -> Policy:
    """Per bucket of :func:`measure`'s rates, the fastest candidate; plain decoding (when it
    was measured) unless the fastest spec beats it by ``margin``."""
    by_label = {mode_label(m): m for m in candidates}
    picks = {}
    for b, r in rates.items():
        best = max(r, key=r.get)
        if PLAIN in r and best != PLAIN and r[best] < margin * r[PLAIN]:
            best = PLAIN
        picks[b] = by_label[best]
    return Policy(picks)


def resolve_policy(target, drafter, policy, spec, buckets, slots: int):
    """The engine's policy for ``buckets`` of ``slots``: ``(policy with every spec resolved,
    deepest S, most nodes N, overshoot)``."""
    if drafter is not None and getattr(drafter.module, "per_row_params", False):
        raise ValueError(f"a {drafter.kind} drafter's parameters have one row per batch "
                         f"row; it serves generate's static batches, not engine slots")
    if drafter is None:
        if policy is not None or spec is not None:
            raise ValueError("spec and policy choose how a drafter speculates; no drafter "
                             "was given")
        policy = Policy({b: PLAIN for b in buckets})
    elif isinstance(policy, str):
        if policy != "auto":
            raise ValueError(f"policy={policy!r}: pass a Policy, 'auto' or None")
        policy = Policy.stored(drafter, buckets)
    elif policy is None:
        policy = Policy({b: spec for b in buckets})
    policy.check_buckets(buckets)
    S = N = 0
    overshoot, resolved = 1, {}
    for s in policy.specs():
        d = resolve_drafting(target, drafter, s, slots)
        resolved[s] = d.spec
        S, N = max(S, d.S), max(N, d.N)
        overshoot = max(overshoot, d.overshoot)
    # None (the drafter's default) becomes the spec it stands for.
    policy = Policy({b: m if m == PLAIN else resolved[m] for b, m in policy.picks.items()})
    return policy, S, N, overshoot
