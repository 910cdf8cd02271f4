"""Lossless speculative sampling: the emitted tokens are distributed exactly as the
target's (after temperature / top-k / top-p, see :func:`jspec.sampling.target_probs`).

Randomness comes in as uniforms in [0, 1) so that the reference, the Pallas kernel
and the tests can share them.

Tree rule, for drafts that are deterministic (top-K) children: at the current node
with target distribution p, try its children in order; child token x is accepted
with probability r(x) / sum(r), where r starts as p and loses the mass of every
rejected sibling (r(x) <- 0). Accepting moves to the child (r <- its p); when every
child is rejected (or there are none), the bonus token is drawn from r renormalised.
For one child this is standard rejection sampling with q = one-hot(x); for several it
is the recursive rule of SpecInfer / EAGLE, and it is exact for any tree.

Chain rule, for drafts x_i sampled from draft distributions q_i: accept x_i with
probability min(1, p(x_i) / q_i(x_i)); on rejection draw from (p - q_i)+ renormalised
and stop; if all are accepted, draw the bonus from the last p.

Both walk the nodes once in index order: because nodes are topologically sorted,
every child of the current node comes after it, and nodes in other subtrees are
skipped (their parent is not the current node).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.tree.build import DraftTree


def _residual(r: jax.Array, x: jax.Array) -> jax.Array:
    """Remove a rejected deterministic draft's mass: (r - onehot(x))+ up to scale."""
    return r.at[jnp.arange(r.shape[0]), x].set(0.0)


def _chain_residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """Where to draw from after rejecting a draft sampled from q: (p - q)+."""
    return jnp.maximum(p - q, 0.0)


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


def tree_sample_walk(tree: DraftTree, probs: jax.Array, u_accept: jax.Array, u_bonus: jax.Array,
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


def chain_sample_walk(tokens: jax.Array, probs: jax.Array, draft_probs: jax.Array,
                      u_accept: jax.Array, u_bonus: jax.Array):
    """Chain rejection sampling for drafts sampled from ``q``.

    ``tokens [B, S+1]`` (root first), ``probs [B, S+1, V]`` target distributions after each
    node, ``draft_probs [B, S, V]`` the q each draft ``tokens[:, i+1]`` was drawn from,
    ``u_accept [B, S]``, ``u_bonus [B]``. Returns ``(accept_index, accept_len, bonus)``.
    """
    B, S1, V = probs.shape
    rows = jnp.arange(B)

    def step(i, carry):
        alive, n, r = carry
        x = tokens[:, i + 1]
        p, q = probs[:, i], draft_probs[:, i]
        ok = u_accept[:, i] * q[rows, x] < p[rows, x]   # u < min(1, p/q), division-free
        take = alive & ok
        stop = alive & ~ok
        r = jnp.where(stop[:, None], _chain_residual(p, q), jnp.where(take[:, None], probs[:, i + 1], r))
        return (take, n + take.astype(jnp.int32), r)

    init = (jnp.ones((B,), bool), jnp.ones((B,), jnp.int32), probs[:, 0].astype(jnp.float32))
    alive, n, r = jax.lax.fori_loop(0, S1 - 1, step, init)
    k = jnp.arange(S1, dtype=jnp.int32)[None]
    index = jnp.where(k < n[:, None], k, -1)
    return index, n, categorical_from_uniform(r, u_bonus)
