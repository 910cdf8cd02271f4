"""Device meshes and parameter placement.

A mesh has two axes: ``data`` (batch rows) and ``model`` (tensor parallelism over
attention heads, KV heads, MLP width and vocabulary). Parameters carry logical
axis names (see :mod:`jspec.llama`); :data:`LOGICAL_RULES` maps them onto the mesh,
and XLA's SPMD partitioner inserts the collectives. A logical axis whose size the
mesh axis does not divide is replicated instead, so any mesh gives correct results.

The KV page pool is sharded over KV heads and replicated over ``data``: every data
shard can address every page. That keeps page tables global and simple; a per-shard
pool is the next step for pods, where the pool dominates memory.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.llama import PACKED_AXES, abstract_params, is_packed, pack_params
from jspec.target import Target

LOGICAL_RULES = (
    ("batch", "data"),
    ("vocab", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("embed", None),
    ("norm", None),
    ("layers", None),
)


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A ``('data', 'model')`` mesh; ``data`` defaults to all remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    if data is None:
        if len(devices) % model:
            raise ValueError(f"model={model} does not divide the {len(devices)} devices")
        data = len(devices) // model
    if data * model > len(devices):
        raise ValueError(f"mesh {data}x{model} needs {data * model} devices, have {len(devices)}")
    return Mesh(np.array(devices[:data * model]).reshape(data, model), ("data", "model"))


def _spec(names, shape, mesh: Mesh) -> P:
    rules = dict(LOGICAL_RULES)
    axes = []
    for name, size in zip(names, shape):
        ax = rules.get(name)
        axes.append(ax if ax is not None and size % mesh.shape[ax] == 0 else None)
    return P(*axes)


def param_shardings(cfg, mesh: Mesh):
    """A NamedSharding for every parameter, from its logical axis names."""
    boxed = abstract_params(cfg)
    return jax.tree_util.tree_map(
        lambda b: NamedSharding(mesh, _spec(b.names, b.value.shape, mesh)), boxed,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def packed_param_shardings(mesh: Mesh, packed_shapes):
    """NamedShardings for the packed layout (:data:`jspec.llama.PACKED_AXES`)."""
    axes = {k: v for k, v in PACKED_AXES.items() if k in packed_shapes}
    if isinstance(packed_shapes["layers"], (list, tuple)):       # per-layer weights
        one = {k: v[1:] for k, v in PACKED_AXES["layers"].items()}
        axes["layers"] = tuple(one for _ in packed_shapes["layers"])
    return jax.tree_util.tree_map(lambda names, s: NamedSharding(mesh, _spec(names, s.shape, mesh)),
                                  axes, packed_shapes, is_leaf=_is_axes)


def pack_for_serving(cfg, params):
    """Pack checkpoint-layout params once (jitted); on the same mesh when they are sharded."""
    if is_packed(params):
        return params
    pack = lambda p: pack_params(cfg, p)
    leaf = jax.tree_util.tree_leaves(params)[0]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        shapes = jax.eval_shape(pack, params)
        out = packed_param_shardings(sharding.mesh, shapes)
        return jax.jit(pack, out_shardings=out)(params)
    return jax.jit(pack)(params)


def shard_target(target: Target, mesh: Mesh) -> Target:
    """The same target with parameters placed on ``mesh``."""
    params = jax.device_put(target.params, param_shardings(target.config, mesh))
    return dataclasses.replace(target, params=params)


def kv_pages_spec(cfg, mesh: Mesh) -> P:
    """``[L, KVH, P, page_size, D]``: KV heads over ``model`` when they divide evenly."""
    return P(None, "model" if cfg.num_kv_heads % mesh.shape["model"] == 0 else None)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))


def constrain_kv(cache, cfg, mesh: Mesh | None):
    """Pin a KV cache's page pools to the mesh (KV heads over ``model``) inside jit."""
    if mesh is None:
        return cache
    s = NamedSharding(mesh, kv_pages_spec(cfg, mesh))
    return cache.replace(k_pages=jax.lax.with_sharding_constraint(cache.k_pages, s),
                         v_pages=jax.lax.with_sharding_constraint(cache.v_pages, s))
