"""Greedy verification (the jnp reference for the Pallas verify-walk kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.tree.build import DraftTree


def greedy_walk(tree: DraftTree, target_argmax: jax.Array, max_depth: int):
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
