"""The pure-jnp walks, and references with the kernels' signatures.

:func:`greedy_walk` and :func:`tree_sample_walk` read a tree's ``tokens``, ``parents`` and
``depths`` (any object with those ``[B, N]`` fields: jspec's ``DraftTree``, or :class:`Tree`);
jspec's driver runs them (``jspec.verify`` re-exports them). :func:`greedy_walk_ref` and
:func:`sample_walk_ref` take the kernels' arguments: ``parents`` is recovered from the
first-child / next-sibling lists, so kernel and reference see exactly the same tree. Like
the kernels, this module needs nothing but jax.

The sampling rule (for deterministic top-K children): at the current node with target
distribution p, try its children in order; child token x is accepted with probability
r(x) / sum(r), where r starts as p and loses the mass of every rejected sibling; accepting
moves to the child (r <- its p); when every child is rejected, the bonus is drawn from r
renormalised (SpecInfer / EAGLE's recursive rule, exact for any tree).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Tree(NamedTuple):
    tokens: jax.Array           # [B, N], root first, topological order
    parents: jax.Array          # [B, N], -1 for the root (and orphans)
    depths: jax.Array           # [B, N]


def greedy_walk(tree, target_argmax: jax.Array, max_depth: int):
    """Descend from the root to the child whose token is the target's argmax at the
    parent, until no child matches.

    ``target_argmax [B, N]``: the target's greedy token after each node.
    Returns ``(accept_index [B, S+1] (-1 padded), accept_len [B] (>= 1, root included),
    bonus [B])``; the bonus is the target's token after the last accepted node. When
    several siblings carry the matching token the first in node order wins.
    """
    B, N = tree.tokens.shape
    rows = jnp.arange(B)
    cur = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    path = [cur]
    for _ in range(max_depth):
        want = target_argmax[rows, cur]
        match = (tree.parents == cur[:, None]) & (tree.tokens == want[:, None])
        found = alive & jnp.any(match, axis=1)
        nxt = jnp.argmax(match, axis=1).astype(jnp.int32)
        cur = jnp.where(found, nxt, cur)
        path.append(jnp.where(found, nxt, -1))
        alive = found
    accept_index = jnp.stack(path, axis=1)
    accept_len = jnp.sum(accept_index >= 0, axis=1).astype(jnp.int32)
    return accept_index, accept_len, target_argmax[rows, cur].astype(jnp.int32)


def _residual(r: jax.Array, x: jax.Array) -> jax.Array:
    """Remove a rejected deterministic draft's mass: (r - onehot(x))+ up to scale."""
    return r.at[jnp.arange(r.shape[0]), x].set(0.0)


def categorical_from_uniform(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw from unnormalised ``probs [B, V]`` with ``u [B]`` in [0, 1)."""
    c = jnp.cumsum(probs, axis=-1)
    target = jnp.minimum(u * c[:, -1], jnp.nextafter(c[:, -1], 0.0))
    idx = jnp.sum(c <= target[:, None], axis=-1)
    return jnp.minimum(idx, probs.shape[-1] - 1).astype(jnp.int32)


def _path_from_accepts(accepted_at: jax.Array, max_depth: int):
    """``accepted_at [B, N]`` bool, nodes along one root path -> (index [B, S+1], len)."""
    B, N = accepted_at.shape
    order = jnp.where(accepted_at, jnp.arange(N), N)
    order = jnp.sort(order, axis=1)[:, :max_depth]
    path = jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                            jnp.where(order < N, order, -1).astype(jnp.int32)], axis=1)
    return path, jnp.sum(path >= 0, axis=1).astype(jnp.int32)


def tree_sample_walk(tree, probs: jax.Array, u_accept: jax.Array, u_bonus: jax.Array,
                     max_depth: int):
    """``probs [B, N, V]``: target distribution after each node; ``u_accept [B, N]`` one
    uniform per node (node j's acceptance test); ``u_bonus [B]``.
    Returns ``(accept_index [B, S+1], accept_len [B], bonus [B])`` like the greedy walk."""
    B, N, V = probs.shape
    rows = jnp.arange(B)

    def step(j, carry):
        cur, r, accepted = carry
        x = tree.tokens[:, j]
        is_child = (tree.parents[:, j] == cur) & (tree.depths[:, j] <= max_depth)
        ok = u_accept[:, j] * jnp.sum(r, axis=-1) < r[rows, x]
        take = is_child & ok
        reject = is_child & ~ok
        r = jnp.where(take[:, None], probs[:, j], jnp.where(reject[:, None], _residual(r, x), r))
        return (jnp.where(take, j, cur), r, accepted.at[:, j].set(take))

    init = (jnp.zeros((B,), jnp.int32), probs[:, 0].astype(jnp.float32), jnp.zeros((B, N), bool))
    cur, r, accepted = jax.lax.fori_loop(1, N, step, init)
    index, length = _path_from_accepts(accepted, max_depth)
    return index, length, categorical_from_uniform(r, u_bonus)


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


def _tree(tokens, first_child, next_sibling) -> Tree:
    return Tree(tokens=tokens, parents=parents_from_lists(first_child, next_sibling),
                depths=jnp.zeros(tokens.shape, jnp.int32))


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
