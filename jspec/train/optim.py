"""Generic training utilities: AdamW schedule and an exactly-resumable train state.

Used by :mod:`jspec.train.lm` (the default target) and meant to be reused for drafters:
nothing here knows what the parameters are.

A checkpoint is one ``.npz`` holding every leaf of :class:`TrainState` (parameters,
optimizer state, step, PRNG key, data-iterator position) bit for bit, plus the leaf
paths so a mismatch with the template names the leaf. It is written to a temporary
sibling, fsynced, and renamed into place, so a crash never leaves a torn checkpoint.
Restoring needs a template state of the same structure (e.g. a freshly initialised one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jspec import atomic


def make_schedule(lr: float, warmup: int, total_steps: int, end_factor: float = 0.1):
    """Linear warmup 0 -> ``lr`` over ``warmup`` steps, then cosine to ``lr * end_factor``."""
    warmup = max(0, min(int(warmup), int(total_steps) - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup,
        decay_steps=max(int(total_steps), warmup + 1), end_value=lr * end_factor)


def decay_mask(params):
    """Weight decay on matrices only (not norms' scales or other vectors)."""
    return jax.tree_util.tree_map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(lr: float, warmup: int, total_steps: int, weight_decay: float = 0.1,
                   clip: float = 1.0, b1: float = 0.9, b2: float = 0.95,
                   end_factor: float = 0.1) -> optax.GradientTransformation:
    """Global-norm clipping (``clip <= 0`` disables it) then AdamW with warmup + cosine."""
    parts = [optax.clip_by_global_norm(clip)] if clip and clip > 0 else []
    parts.append(optax.adamw(make_schedule(lr, warmup, total_steps, end_factor), b1=b1, b2=b2,
                             weight_decay=weight_decay, mask=decay_mask))
    return optax.chain(*parts)


@struct.dataclass
class TrainState:
    """Everything a run needs to continue exactly where it stopped."""

    step: jax.Array            # int32 scalar: optimizer steps taken
    params: Any
    opt_state: Any
    key: jax.Array             # PRNG key (raw uint32 or typed)
    data_pos: jax.Array        # int64/int32 scalar: batches consumed by the data iterator

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation, key, data_pos: int = 0):
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                   key=key, data_pos=jnp.asarray(data_pos, jnp.int32))

    def apply_gradients(self, grads, tx: optax.GradientTransformation) -> "TrainState":
        updates, opt_state = tx.update(grads, self.opt_state, self.params)
        return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                            opt_state=opt_state, data_pos=self.data_pos + 1)


def _is_typed_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _leaves(state) -> tuple[list[str], list[Any]]:
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return [jax.tree_util.keystr(p) for p, _ in flat], [leaf for _, leaf in flat]


def save_train_state(state, path: str | os.PathLike, meta: dict | None = None) -> None:
    """Write ``state`` (any pytree; usually a :class:`TrainState`) to ``path`` atomically.

    ``meta`` (JSON-serialisable) is stored alongside, e.g. the run's hyperparameters.
    """
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    names, leaves = _leaves(state)
    arrays = {}
    for i, leaf in enumerate(leaves):
        if _is_typed_key(leaf):
            arrays[f"leaf_{i}"] = np.asarray(jax.random.key_data(leaf))
        else:
            arrays[f"leaf_{i}"] = np.asarray(leaf)
    header = {"names": names, "meta": meta or {}}
    with atomic.atomic_open(dst, "wb") as f:
        np.savez(f, __header__=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)


def load_train_state(path: str | os.PathLike, template):
    """Restore a state saved by :func:`save_train_state` into ``template``'s structure.

    Returns ``(state, meta)``. Shapes, dtypes and leaf paths must match the template.
    """
    names, leaves = _leaves(template)
    treedef = jax.tree_util.tree_structure(template)
    with np.load(path, allow_pickle=False) as z:
        header = json.loads(z["__header__"].tobytes().decode())
        if header["names"] != names:
            missing = sorted(set(names) ^ set(header["names"]))
            raise ValueError(f"{path}: train state structure differs from the template "
                             f"(e.g. {missing[:3]})")
        out = []
        for i, (name, ref) in enumerate(zip(names, leaves)):
            arr = z[f"leaf_{i}"]
            if _is_typed_key(ref):
                impl = jax.random.key_impl(ref)
                out.append(jax.random.wrap_key_data(jnp.asarray(arr), impl=impl))
                continue
            ref_shape, ref_dtype = np.shape(ref), np.asarray(ref).dtype if not hasattr(ref, "dtype") else ref.dtype
            if tuple(arr.shape) != tuple(ref_shape) or arr.dtype != np.dtype(ref_dtype):
                raise ValueError(f"{path}: leaf {name} is {arr.dtype}{list(arr.shape)}, "
                                 f"expected {np.dtype(ref_dtype)}{list(ref_shape)}")
            out.append(jnp.asarray(arr) if isinstance(ref, jax.Array) else arr)
    return jax.tree_util.tree_unflatten(treedef, out), header["meta"]
