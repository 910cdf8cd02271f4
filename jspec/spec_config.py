"""Speculation knobs, validated up front the way serving engines refuse at start-up."""

from __future__ import annotations

import dataclasses


class SpecConfigError(ValueError):
    """An impossible or unsupported combination of speculation knobs."""


SELECTIONS = ("eagle2", "calibrated")  # see jspec.tree.calibration
MAX_TREE_NODES = 64  # the bit-packed tree mask holds one row in at most 64 bits


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """``num_steps`` S (tree depth), ``topk`` K (branching), ``num_draft_tokens`` N (tree nodes,
    root included). A chain is K = 1, N = S + 1.

    Widths that follow: tree-node arrays are N wide; accepted-path arrays are S + 1 wide
    (max depth + 1, never N); the EAGLE-2 candidate pool is K + (S - 1) K^2.

    ``selection``: how a dynamic tree ranks its candidates. ``"eagle2"`` (default): the
    drafter's cumulative log-probability. ``"calibrated"``: the calibrated probability that
    the path is accepted (:mod:`jspec.tree.calibration`; needs the drafter's model). Static
    trees (Medusa) and chains (K = 1) draft the same nodes under either.
    """

    num_steps: int = 5
    topk: int = 4
    num_draft_tokens: int = 8
    selection: str = "eagle2"

    def __post_init__(self):
        S, K, N = self.num_steps, self.topk, self.num_draft_tokens
        if S < 1:
            raise SpecConfigError(f"num_steps must be >= 1, got {S}")
        if K < 1:
            raise SpecConfigError(f"topk must be >= 1, got {K}")
        if N < 2:
            raise SpecConfigError(f"num_draft_tokens must be >= 2 (root + one draft), got {N}")
        if N > MAX_TREE_NODES:
            raise SpecConfigError(
                f"num_draft_tokens={N} > {MAX_TREE_NODES}: the tree mask packs a row in 64 bits")
        if K == 1 and N != S + 1:
            raise SpecConfigError(
                f"topk=1 is a chain, which has exactly num_steps + 1 = {S + 1} nodes; "
                f"got num_draft_tokens={N}")
        if self.selection not in SELECTIONS:
            raise SpecConfigError(f"unknown selection {self.selection!r}; choose from {SELECTIONS}")
        if N - 1 > self.pool_size:
            raise SpecConfigError(
                f"num_draft_tokens={N} needs {N - 1} drafts but num_steps={S}, topk={K} score "
                f"only K + (S-1)*K*K = {self.pool_size} candidates")

    @property
    def pool_size(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def accept_width(self) -> int:
        return self.num_steps + 1

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @classmethod
    def chain(cls, num_steps: int) -> "SpecConfig":
        return cls(num_steps, 1, num_steps + 1)

    def with_selection(self, selection: str) -> "SpecConfig":
        return dataclasses.replace(self, selection=selection)


CALIBRATED_SUFFIX = "/cal"


def spec_label(spec: SpecConfig) -> str:
    """``"S,K,N"``, with ``/cal`` for a tree under calibrated selection."""
    text = f"{spec.num_steps},{spec.topk},{spec.num_draft_tokens}"
    return text + CALIBRATED_SUFFIX if spec.selection == "calibrated" else text


def parse_spec(text: str) -> SpecConfig:
    """Inverse of :func:`spec_label`."""
    cal = text.endswith(CALIBRATED_SUFFIX)
    try:
        S, K, N = (int(x) for x in text.removesuffix(CALIBRATED_SUFFIX).split(","))
    except ValueError:
        raise SpecConfigError(f"expected S,K,N[{CALIBRATED_SUFFIX}], got {text!r}") from None
    return SpecConfig(S, K, N, "calibrated" if cal else "eagle2")
