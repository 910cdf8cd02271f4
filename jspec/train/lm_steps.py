"""The default target's training step and evaluation (:mod:`jspec.train.lm`): next-token
cross-entropy through the inference forward itself (:class:`jspec.llama.Llama`), so the
trained function is exactly the one generation runs."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jspec import kv_cache as kvc
from jspec.config import LlamaConfig
from jspec.llama import Llama
from jspec.train import data as D
from jspec.train.optim import TrainState, make_optimizer


def forward_logits(cfg: LlamaConfig, params, tokens: jax.Array) -> jax.Array:
    """Causal full-sequence forward ``tokens [B, T] -> fp32 logits [B, T, V]``.

    A fresh cache per call: row ``b`` owns page ``b`` of ``T`` slots, lengths are 0, and
    ``block_mask=None`` is causal, so this is the prefill computation without sampling.
    """
    B, T = tokens.shape
    model = Llama(cfg)
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                           jnp.arange(B, dtype=jnp.int32)[:, None], B, T, cfg.dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _, _ = model.apply({"params": params}, tokens, positions, cache, block_mask=None)
    return model.apply({"params": params}, hidden, method=Llama.logits)


def row_losses(cfg: LlamaConfig, params, batch: jax.Array, masked: bool = False) -> jax.Array:
    """Per-row mean next-token cross-entropy (nats) of ``batch [B, T+1]`` -> ``[B]``.

    ``masked``: rows are padded with ``D.PAD_ID`` (``--seqs``); a row's mean is over its real
    targets only (padding is after them, so causal attention never lets it reach them).
    """
    inputs, tgt = batch[:, :-1], batch[:, 1:]
    if masked:
        valid = tgt != D.PAD_ID
        inputs, tgt = jnp.maximum(inputs, 0), jnp.maximum(tgt, 0)
    logits = forward_logits(cfg, params, inputs)
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
    if not masked:
        return jnp.mean(logz - gold, axis=-1)
    return (jnp.sum(jnp.where(valid, logz - gold, 0.0), axis=-1)
            / jnp.maximum(jnp.sum(valid, axis=-1), 1))


def loss_fn(cfg: LlamaConfig, params, batch: jax.Array, masked: bool = False) -> jax.Array:
    """Mean loss per target token of the batch."""
    if not masked:
        return jnp.mean(row_losses(cfg, params, batch))
    n = jnp.sum(batch[:, 1:] != D.PAD_ID, axis=-1)
    return jnp.sum(row_losses(cfg, params, batch, True) * n) / jnp.maximum(jnp.sum(n), 1)


@functools.lru_cache(maxsize=8)
def compiled_steps(cfg: LlamaConfig, lr: float, warmup: int, steps: int, weight_decay: float,
                   clip: float, masked: bool = False):
    """``(tx, train_step, eval_step)``, cached so equal settings reuse the compiled programs."""
    tx = make_optimizer(lr, warmup, steps, weight_decay, clip)
    return (tx, *make_steps(cfg, tx, masked))


def make_steps(cfg: LlamaConfig, tx, masked: bool = False):
    @jax.jit
    def train_step(state: TrainState, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, batch, masked))(state.params)
        key, _ = jax.random.split(state.key)  # no dropout; kept so the key advances like a real run
        gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        return state.apply_gradients(grads, tx).replace(key=key), loss, gnorm

    @jax.jit
    def eval_step(params, batch):
        return row_losses(cfg, params, batch, masked)

    return train_step, eval_step


def evaluate(eval_step, params, seqs: np.ndarray, batch: int, max_batches: int | None = None):
    """Mean held-out loss per target token over ``seqs`` (the last batch padded by repeating
    rows, which are ignored; ``D.PAD_ID`` targets are not counted)."""
    nb = math.ceil(len(seqs) / batch)
    if max_batches is not None:
        nb = min(nb, max_batches)
    total, count = 0.0, 0
    for i in range(nb):
        rows = seqs[i * batch:(i + 1) * batch]
        k = len(rows)
        if k < batch:  # one compiled shape: pad by repetition, count only the real rows
            rows = np.concatenate([rows, np.repeat(rows[:1], batch - k, axis=0)])
        losses = np.asarray(eval_step(params, jnp.asarray(rows, jnp.int32)))
        n = np.sum(rows[:k, 1:] != D.PAD_ID, axis=1)
        total += float(np.sum(losses[:k] * n, dtype=np.float64))
        count += int(np.sum(n))
    return total / max(count, 1)


def param_count(params) -> int:
    return int(sum(np.prod(np.shape(p)) for p in jax.tree_util.tree_leaves(params)))


# ----------------------------------------------------------------------------- training
