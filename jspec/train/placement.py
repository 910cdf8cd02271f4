"""Where a drafter's training lives on a ``(data, model)`` mesh.

The target is placed as for inference (:func:`jspec.target.shard_target`: heads, MLP width
and vocabulary over ``model``). Batch rows go over ``data``, so the partitioner reduces the
drafter's gradients over ``data``. The drafter's parameters and optimizer state are
replicated, or with ``fsdp`` each array is split over ``data`` along its largest axis that
``data`` divides (ZeRO-3 / FSDP style: the partitioner all-gathers a weight where it is used
and reduce-scatters its gradient), so each chip holds 1/data of the head's fp32 weights and Adam
state (12 bytes a parameter: about 5 GB for an 8B EAGLE-3 head with a 32k draft vocabulary).

Arrays are made from host values with :func:`jax.make_array_from_callback`, so the same
code runs in one process or several (each process builds only its own devices' blocks).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def fsdp_spec(shape, size: int) -> P:
    """Split the largest axis that ``size`` divides; replicate a leaf with none."""
    axes = [a for a in np.argsort([-n for n in shape], kind="stable") if shape[a] % size == 0
            and shape[a] >= size]
    if not axes or size == 1:
        return P()
    spec = [None] * len(shape)
    spec[axes[0]] = "data"
    return P(*spec)


def state_shardings(tree, mesh: Mesh, fsdp: bool = False):
    """A NamedSharding per leaf: replicated, or split over ``data`` (:func:`fsdp_spec`)."""
    d = mesh.shape["data"]
    return jax.tree.map(lambda x: NamedSharding(
        mesh, fsdp_spec(np.shape(x), d) if fsdp and np.ndim(x) else P()), tree)


def place(tree, shardings):
    """Host values (the same on every process) -> global arrays with ``shardings``."""
    def one(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
    return jax.tree.map(one, tree, shardings)


def batch_shardings(batch: dict, mesh: Mesh):
    """Row-carrying leaves over ``data``; ``rng`` (the loss's seed pair) replicated."""
    return {k: NamedSharding(mesh, P() if k == "rng" else P("data", *([None] * (np.ndim(v) - 1))))
            for k, v in batch.items()}
