"""The DFlash training objective, on cached target features.

Per sequence, the context's keys and values are written once for every position (the same
:meth:`~jspec.drafters.dflash.DFlash.context` the drafter runs when serving). Then
``anchors`` positions ``a`` per row are drawn, and each becomes a block
``[x_a, MASK, ...]`` at positions ``a, a + 1, ...`` that sees the context strictly before
``a`` (a cache row over the sequence's pages with length ``a``: what serving sees when the
root ``x_a`` is the last emitted token) and its own block. Block slot ``k >= 1`` is
trained on the target's distribution for the token at ``a + k`` (the cached top-k at
``a + k - 1``), with weight ``exp(-(k - 1) / gamma)`` (the paper's decay; gamma 7 for
blocks of 16, 4 for 8).

Block lengths: each anchor draws its length ``m`` in ``2 .. block_size`` (slots past ``m``
are neither seen nor trained), so one head serves every block length up to
``block_size`` (:mod:`jspec.drafters.dflash`). Anchors and lengths come from
``batch["rng"]`` (``[seed, step]``), so a resumed run draws the same ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import kv_cache as kvc
from jspec.train.packing import is_packed
from jspec.train.targets import label_mask, soft_ce, soft_targets, train_cache


def decay_gamma(block_size: int) -> float:
    """The paper's gamma: 7 for blocks of 16, 5 for 10, 4 for 8 (about block_size / 2)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(block_size / 2.0, 1.0))


def anchor_view(cache: kvc.PagedKVCache, anchors: jax.Array) -> kvc.PagedKVCache:
    """``anchors [B, A]`` -> a ``B * A``-row cache over the same pages, row ``(b, i)``
    committed up to ``anchors[b, i]``."""
    A = anchors.shape[1]
    rep = lambda x: jnp.repeat(x, A, axis=0)
    return cache.replace(page_table=rep(cache.page_table), capacity=rep(cache.capacity),
                         lengths=anchors.reshape(-1).astype(jnp.int32))


def dflash_loss(module, params, target_cfg, target_params, batch, lc, t2d=None):
    if is_packed(batch):
        raise ValueError("DFlash trains on unpacked rows (its anchors read a context cache "
                         "over the whole row): pass --no-pack")
    tokens, lens, feats = batch["tokens"], batch["lens"], batch["feats"]
    B, T = tokens.shape
    bs, A = module.block_size, lc.anchors
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), batch["rng"][0]),
                             batch["rng"][1])
    ka, km = jax.random.split(key)
    # Anchors in 1 .. len - 2: at least one context position and one label.
    span = jnp.maximum(lens - 2, 1)[:, None]
    anchors = 1 + jnp.floor(jax.random.uniform(ka, (B, A)) * span).astype(jnp.int32)
    m = jax.random.randint(km, (B * A,), 2, bs + 1)                     # block lengths
    cache = train_cache(module, B, T)
    cache = module.context(params, cache, feats, lens.astype(jnp.int32))
    first = jnp.take_along_axis(tokens, anchors, 1).reshape(-1)
    j = jnp.arange(bs, dtype=jnp.int32)[None]
    hidden = module.block_hidden(params, target_params, anchor_view(cache, anchors), first, bs,
                                 visible=j < m[:, None])
    logits = module.logits(target_cfg, target_params, hidden[:, 1:])    # [B A, bs - 1, V]
    # Slot k's label: the target's distribution at a + k - 1, for the token at a + k.
    at = (anchors.reshape(-1)[:, None] + j[:, :-1])                     # a + k - 1
    row = jnp.repeat(jnp.arange(B), A)[:, None]
    safe = jnp.minimum(at, T - 1)
    probs, ids = soft_targets(batch["topk_vals"][row, safe], batch["topk_ids"][row, safe], t2d)
    ce, acc = soft_ce(logits, probs, ids)
    k = j[:, 1:]
    valid = (k < m[:, None]) & label_mask(batch, (at + 1).reshape(B, A * (bs - 1))).reshape(
        B * A, bs - 1)
    gamma = lc.gamma or decay_gamma(bs)
    w = jnp.exp(-(k - 1) / gamma) * valid
    total = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-6)
    metrics = {}
    for d in sorted({1, 2, 4, bs // 2, bs - 1}):
        if 1 <= d < bs:
            v = valid[:, d - 1].astype(jnp.float32)
            metrics[f"acc{d}"] = jnp.sum(acc[:, d - 1] * v) / jnp.maximum(jnp.sum(v), 1.0)
    metrics["acc0"] = metrics["acc1"]             # the progress bar's first-draft accuracy
    return total, metrics

