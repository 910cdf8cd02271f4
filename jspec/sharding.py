"""Device meshes and parameter placement.

A mesh has two axes: ``data`` (batch rows) and ``model`` (tensor parallelism over
attention heads, KV heads, MLP width and vocabulary). Parameters carry logical
axis names (see :mod:`jspec.llama`); :data:`LOGICAL_RULES` maps them onto the mesh,
and XLA's SPMD partitioner inserts the collectives. A logical axis whose size the
mesh axis does not divide is replicated instead, so any mesh gives correct results.

Rows are independent, so the decode loops run **once per data shard**
(:func:`per_data_shard`: a ``shard_map`` that is manual over ``data`` and leaves ``model`` to
the partitioner). Each shard owns its rows and a KV page pool of its own: pages are sharded
over ``data`` as well as KV heads, a row's page table holds ids local to its shard's pool,
and pages are allocated per shard (:func:`jspec.plan.admit`). Per-device KV memory is
the whole pool / (data x model) where the KV heads divide ``model``; nothing about a row
crosses the ``data`` axis, and each shard's loop stops when its own rows are done.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.llama import abstract_params
from jspec.serving_layout import PACKED_AXES, is_packed, pack_params
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


def drafter_shardings(drafter, target_cfg, mesh: Mesh):
    """NamedShardings for a drafter's params (checkpoint or serving layout), from the logical
    axes its layers declare, under the target's :data:`LOGICAL_RULES` (its LM head over the
    vocabulary, attention over heads, MLP over ``model``); maps and tables without axes
    (``d2t``, a calibration model) are replicated."""
    module = drafter.module
    boxed = jax.eval_shape(lambda k: module.init_params(k, target_cfg), jax.random.key(0))
    flip = getattr(module, "out_major", False)
    specs = {}
    for path, b in jax.tree_util.tree_leaves_with_path(
            boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)):
        if isinstance(b, nn.LogicallyPartitioned):
            names, shape = tuple(b.names), b.value.shape
            if flip and getattr(path[-1], "key", None) == "kernel" and len(shape) == 2:
                names, shape = names[::-1], shape[::-1]          # serving: [out, in]
            specs[jax.tree_util.keystr(path)] = _spec(names, shape, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, specs.get(jax.tree_util.keystr(path), P())),
        nn.unbox(drafter.params))


def shard_drafter(drafter, target_cfg, mesh: Mesh):
    """The drafter with its params placed on ``mesh`` (:func:`drafter_shardings`)."""
    from jspec.drafters import Drafter
    params = jax.device_put(nn.unbox(drafter.params), drafter_shardings(drafter, target_cfg, mesh))
    return Drafter(drafter.module, params, source=drafter.source)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def packed_param_shardings(mesh: Mesh, packed_shapes):
    """NamedShardings for the packed layout (:data:`jspec.serving_layout.PACKED_AXES`)."""
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


def kv_pages_spec(cfg, mesh: Mesh, *, inside: bool = False) -> P:
    """``[L, KVH, P, page_size, D]``: KV heads over ``model`` when they divide evenly, pages
    over ``data`` (``inside`` a :func:`per_data_shard` region ``data`` is manual: omitted)."""
    heads = "model" if cfg.num_kv_heads % mesh.shape["model"] == 0 else None
    return P(None, heads) if inside else P(None, heads, "data")


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))


def constrain_kv(cache, cfg, mesh: Mesh | None):
    """Pin a KV cache's page pools to the mesh (KV heads over ``model``) inside jit; inside a
    :func:`per_data_shard` region the pool is the shard's own."""
    if mesh is None:
        return cache
    inside = "data" in getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    spec = kv_pages_spec(cfg, mesh, inside=inside)
    s = spec if inside else NamedSharding(mesh, spec)
    return cache.replace(k_pages=jax.lax.with_sharding_constraint(cache.k_pages, s),
                         v_pages=jax.lax.with_sharding_constraint(cache.v_pages, s))


POOL_FIELDS = ("k_pages", "v_pages")


def per_data_shard(mesh: Mesh, fn, num_replicated: int):
    """``fn(*replicated, *rows)`` run once per ``data`` shard of ``mesh`` (inside jit).

    The first ``num_replicated`` arguments (parameters) are the same on every data shard
    (their ``model`` sharding is kept); the rest are per-row arrays split over ``data`` on
    their first axis. In the outputs, leaves with the shard's row count first are rows
    (joined over ``data``), KV page pools (fields :data:`POOL_FIELDS`) are joined over their
    page axis, and anything else (a step counter) is taken from one shard.
    """
    d = mesh.shape["data"]

    def run(*args):
        rep, rows = args[:num_replicated], args[num_replicated:]
        n = jax.tree.leaves(rows)[0].shape[0]
        if n % d:
            raise ValueError(f"{n} rows do not split over the mesh's data axis of size {d}")
        local = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // d,) + x.shape[1:],
                                                            x.dtype), rows)
        shapes = jax.eval_shape(fn, *rep, *local)

        def out_spec(path, leaf):
            if getattr(path[-1], "name", None) in POOL_FIELDS:
                return P(None, None, "data")
            return P("data") if leaf.ndim and leaf.shape[0] == n // d else P()
        specs = jax.tree_util.tree_map_with_path(out_spec, shapes)
        in_specs = (P(),) * num_replicated + (P("data"),) * len(rows)
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=specs,
                             axis_names={"data"}, check_vma=False)(*args)
    return run
