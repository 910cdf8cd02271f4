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

# The tree walk lives beside its Pallas kernel (the reference it is tested against).
from pallas_kernels.verify_walk.reference import (  # noqa: F401 (re-exported)
    categorical_from_uniform, tree_sample_walk)


def _chain_residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """Where to draw from after rejecting a draft sampled from q: (p - q)+."""
    return jnp.maximum(p - q, 0.0)


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
