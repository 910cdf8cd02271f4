"""Commit the accepted path: its KV to the front of the verified block, its hidden states
gathered for the drafter, and the tokens the user sees."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import kv_cache as kvc
from jspec.tree.build import DraftTree


def commit_accepted(cache: kvc.PagedKVCache, hidden: jax.Array, accept_index: jax.Array,
                    accept_len: jax.Array, contiguous: bool = False):
    """``hidden [B, N, ...]`` per tree node -> ``(cache, hidden [B, S+1, ...])``.

    The verify pass wrote node i's KV at ``lengths + i``; the accepted nodes move to
    ``lengths + 0 .. accept_len-1`` and ``lengths`` advances. Rejected slots become
    overshoot that later writes overwrite. ``contiguous`` (static): the accepted nodes are
    always ``0 .. accept_len-1`` (a chain), so their KV is already in place and nothing moves.
    """
    keep = jnp.maximum(accept_index, 0)
    if contiguous:
        cache = kvc.advance(cache, accept_len)
    else:
        cache = kvc.commit(cache, keep, accept_len)
    picked = jnp.take_along_axis(hidden, keep.reshape(keep.shape + (1,) * (hidden.ndim - 2)), axis=1)
    return cache, picked


def emitted_tokens(tree: DraftTree, accept_index: jax.Array, accept_len: jax.Array,
                   bonus: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Tokens emitted by one verify step: the accepted drafts (root excluded) then the
    bonus. Returns ``(tokens [B, S+1] (0 padded), count [B] = accept_len)``."""
    B, A = accept_index.shape
    drafts = jnp.take_along_axis(tree.tokens, jnp.maximum(accept_index, 0), axis=1)[:, 1:]
    k = jnp.arange(A)[None]
    toks = jnp.concatenate([drafts, jnp.zeros((B, 1), drafts.dtype)], axis=1)
    toks = jnp.where(k == (accept_len - 1)[:, None], bonus[:, None], toks)
    return jnp.where(k < accept_len[:, None], toks, 0), accept_len
