"""What every drafter loss reads: the target's cached top-k as soft labels, the soft
cross-entropy against them, and a training KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec import kv_cache as kvc
from jspec.train.packing import is_packed, same_segment


def soft_targets(vals, ids, t2d=None):
    """Top-k logits -> (probs [.., k] renormalised over the kept ids, draft ids [.., k])."""
    p = jax.nn.softmax(vals.astype(jnp.float32), -1)
    if t2d is not None:
        ids = t2d[ids]
        p = jnp.where(ids >= 0, p, 0.0)
        p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-20)
        ids = jnp.maximum(ids, 0)
    return p, ids


def soft_ce(logits, probs, ids):
    """``-sum_k p_k log softmax(logits)[ids_k]`` per position, and top-1 agreement."""
    logp = jax.nn.log_softmax(logits, -1)
    ce = -jnp.sum(probs * jnp.take_along_axis(logp, ids, -1), -1)
    best = jnp.take_along_axis(ids, jnp.argmax(probs, -1)[..., None], -1)[..., 0]
    acc = (jnp.argmax(logits, -1) == best).astype(jnp.float32)
    return ce, acc


def train_cache(module, batch: int, slots: int, page_size: int = 16) -> kvc.PagedKVCache:
    c = module.layer
    pages = kvc.pages_needed(slots, page_size)
    table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    return kvc.init_cache(module.cache_layers, c.num_kv_heads, c.head_dim, table, batch * pages,
                          page_size, c.dtype)


def label_mask(batch, at):
    """Whether the token at ``at`` (an int offset from each position ``[B, T]``'s own, or
    positions ``[B, ...]``) is a label: inside the sequence, in the same record as the
    position it is trained at (packed rows: :mod:`jspec.train.packing`; offsets only) and,
    where the batch has a ``loss_mask`` (chat data: the assistant's turns), marked in it."""
    lens, T = batch["lens"], batch["tokens"].shape[1]
    packed_ok = None
    if isinstance(at, int):
        at = jnp.arange(T, dtype=jnp.int32)[None] + at
        if is_packed(batch):
            packed_ok = same_segment(batch["segments"], at)
    elif is_packed(batch):
        raise ValueError("label_mask over packed rows takes an offset, not positions")
    ok = at < lens.reshape((-1,) + (1,) * (at.ndim - 1))
    if packed_ok is not None:
        ok = ok & packed_ok
    if "loss_mask" in batch:
        rows = jnp.arange(at.shape[0]).reshape((-1,) + (1,) * (at.ndim - 1))
        ok = ok & batch["loss_mask"][rows, jnp.clip(at, 0, T - 1)].astype(bool)
    return ok
