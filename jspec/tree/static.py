"""Static (Medusa-style) trees: a fixed topology of top-k ranks per draft head.

A tree is a list of paths; path ``(r0, r1, ..., rd)`` is the node reached by taking
head 0's rank-r0 token, then head 1's rank-r1 token, and so on. The layout (parents,
the head and rank each node reads) is computed once on the host; at run time
:func:`static_tree_tokens` fills in the tokens and the result is the same
:class:`~jspec.tree.build.DraftTree` an EAGLE tree produces.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.spec_config import MAX_TREE_NODES
from jspec.tree.build import DraftTree, build_tree

# Medusa's default 63-path tree for Vicuna-7B (FasterDecoding/Medusa, medusa_choices.py).
MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0),
    (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """Host-side layout; nodes sorted by (depth, path) so siblings are in rank order."""

    paths: tuple[tuple[int, ...], ...]    # node i >= 1 is paths[i - 1]
    parents: tuple[int, ...]              # [N], root -1
    heads: tuple[int, ...]                # [N], the head a node's token comes from (root: -1)
    ranks: tuple[int, ...]                # [N], its top-k rank (root: -1)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def topk(self) -> int:
        return max(max(p) for p in self.paths) + 1

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "StaticTree":
        paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError("a static tree needs non-empty paths of non-negative ranks")
        index = {p: i + 1 for i, p in enumerate(paths)}
        missing = [p for p in paths if len(p) > 1 and p[:-1] not in index]
        if missing:
            raise ValueError(f"static tree path {missing[0]} has no parent path {missing[0][:-1]}")
        if len(paths) + 1 > MAX_TREE_NODES:
            raise ValueError(f"static tree has {len(paths) + 1} nodes; at most {MAX_TREE_NODES}")
        parents = [-1] + [index.get(p[:-1], 0) for p in paths]
        return cls(tuple(paths), tuple(parents), (-1,) + tuple(len(p) - 1 for p in paths),
                   (-1,) + tuple(p[-1] for p in paths))

    @classmethod
    def cartesian(cls, topks: Sequence[int]) -> "StaticTree":
        """Every path of per-head ranks ``< topks[h]`` for depths 1..len(topks)."""
        paths = []
        for d in range(1, len(topks) + 1):
            paths += itertools.product(*(range(k) for k in topks[:d]))
        return cls.from_paths(paths)

    @classmethod
    def for_spec(cls, spec, depth: int) -> "StaticTree":
        """The tree a per-position drafter (one top-k list per depth, ``depth`` of them)
        drafts for ``spec``: a chain of top-1 tokens when ``spec.topk == 1``, else the
        ``N - 1`` paths of the per-depth top-K product with the smallest rank sums (a
        deterministic stand-in for a calibrated tree). Made once per (spec, depth)."""
        if spec.num_steps > depth:
            raise ValueError(f"a tree of depth num_steps={spec.num_steps} needs {spec.num_steps} "
                             f"drafted positions; this drafter has {depth}")
        return _per_position_tree(spec.num_steps, spec.topk, spec.num_draft_tokens)


@functools.lru_cache(maxsize=None)
def _per_position_tree(S: int, K: int, N: int) -> StaticTree:
    # Paths by rank sum: those of sum <= s, for the smallest s that gives N - 1 of them
    # (the full product is K^S paths, 10^6 for S = 6, K = 10).
    def paths(limit, prefix=()):
        if prefix:
            yield prefix
        if len(prefix) < S:
            for r in range(min(K, limit - sum(prefix) + 1)):
                yield from paths(limit, prefix + (r,))

    for limit in range(S * (K - 1) + 1):
        found = sorted(paths(limit), key=lambda p: (sum(p), len(p), p))
        if len(found) >= N - 1:
            break
    return StaticTree.from_paths(found[:N - 1])


def static_tree_tokens(tree: StaticTree, root_token: jax.Array, head_topk: jax.Array) -> DraftTree:
    """``head_topk [B, heads, k]`` (each head's tokens, best first) -> :class:`DraftTree`."""
    B = root_token.shape[0]
    heads = np.maximum(np.array(tree.heads), 0)
    ranks = np.maximum(np.array(tree.ranks), 0)
    if head_topk.shape[1] < tree.depth or head_topk.shape[2] < tree.topk:
        raise ValueError(f"tree needs {tree.depth} heads x top-{tree.topk}, "
                         f"got head_topk of shape {head_topk.shape}")
    toks = head_topk[:, heads, ranks]
    toks = toks.at[:, 0].set(root_token)
    parents = jnp.broadcast_to(jnp.asarray(tree.parents, jnp.int32), (B, tree.num_nodes))
    return build_tree(toks, parents, tree.depth)
