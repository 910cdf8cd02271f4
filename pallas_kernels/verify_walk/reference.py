"""Pure-jnp references with the kernels' signatures.

They wrap :func:`jspec.verify.greedy_walk` and :func:`jspec.verify.tree_sample_walk`,
which read ``tokens`` and ``parents``; ``parents`` is recovered here from the
first-child / next-sibling lists (the kernels' inputs), so kernel and reference see
exactly the same tree.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jspec.tree.build import DraftTree
from jspec.verify import greedy_walk, tree_sample_walk


@jax.jit
def parents_from_lists(first_child: jax.Array, next_sibling: jax.Array) -> jax.Array:
    """``[B, N]`` first-child / next-sibling lists -> ``parents [B, N]`` (-1 = root/orphan).

    Node order is topological and sibling lists increase, so one pass in index order
    sees every node's parent before the node hands it on to its next sibling.
    """
    B, N = first_child.shape
    rows = jnp.arange(B)

    def step(j, parents):
        fc, ns = first_child[:, j], next_sibling[:, j]
        parents = parents.at[rows, jnp.where(fc >= 0, fc, N)].set(j, mode="drop")
        return parents.at[rows, jnp.where(ns >= 0, ns, N)].set(parents[:, j], mode="drop")

    return lax.fori_loop(0, N, step, jnp.full((B, N), -1, jnp.int32))


def _tree(tokens, first_child, next_sibling) -> DraftTree:
    B, N = tokens.shape
    z = jnp.zeros((B, N), jnp.int32)
    return DraftTree(tokens=tokens, parents=parents_from_lists(first_child, next_sibling),
                     depths=z, first_child=first_child, next_sibling=next_sibling,
                     mask_bits=jnp.zeros((B, N, 1), jnp.uint32))


@functools.partial(jax.jit, static_argnames=("max_depth",))
def greedy_walk_ref(tokens, first_child, next_sibling, target_argmax, *, max_depth: int):
    """-> ``(accept_index [B, S+1], accept_len [B], bonus [B])``, as :func:`greedy_walk`."""
    return greedy_walk(_tree(tokens, first_child, next_sibling), target_argmax,
                       max_depth)


@functools.partial(jax.jit, static_argnames=("max_depth",))
def sample_walk_ref(tokens, first_child, next_sibling, probs, u_accept, u_bonus, *,
                    max_depth: int):
    """-> ``(accept_index [B, S+1], accept_len [B], bonus [B])``, as :func:`tree_sample_walk`.

    Agrees with the kernels for trees of depth <= ``max_depth`` (``build_tree`` with the
    same ``max_depth``); the jnp reference keeps walking below depth S (truncating only
    the reported path), the kernels stop there.
    """
    return tree_sample_walk(_tree(tokens, first_child, next_sibling), probs,
                            u_accept, u_bonus, max_depth)
