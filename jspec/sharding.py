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
and pages are allocated per shard (:func:`jspec.admission.admit`). Per-device KV memory is
the whole pool / (data x model) where the KV heads divide ``model``; nothing about a row
crosses the ``data`` axis, and each shard's loop stops when its own rows are done.
"""

from __future__ import annotations


import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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


def logical_spec(names, shape, mesh: Mesh) -> P:
    """The PartitionSpec of an array with logical axis ``names`` under :data:`LOGICAL_RULES`
    (an axis the mesh axis does not divide is replicated)."""
    rules = dict(LOGICAL_RULES)
    axes = []
    for name, size in zip(names, shape):
        ax = rules.get(name)
        axes.append(ax if ax is not None and size % mesh.shape[ax] == 0 else None)
    return P(*axes)


def boxed_shardings(boxed, params, mesh: Mesh, *, out_major: bool = False):
    """NamedShardings for ``params`` from an abstract tree of the same layout whose leaves
    may carry logical axes (``nn.LogicallyPartitioned``, as ``init`` makes them): boxed
    leaves are placed by :func:`logical_spec`, the rest (maps and tables without axes)
    replicated. ``out_major``: 2-D ``kernel`` leaves are stored ``[out, in]`` (a serving
    layout), the reverse of their declared axes."""
    specs = {}
    for path, b in jax.tree_util.tree_leaves_with_path(
            boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)):
        if isinstance(b, nn.LogicallyPartitioned):
            names, shape = tuple(b.names), b.value.shape
            if out_major and getattr(path[-1], "key", None) == "kernel" and len(shape) == 2:
                names, shape = names[::-1], shape[::-1]
            specs[jax.tree_util.keystr(path)] = logical_spec(names, shape, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, specs.get(jax.tree_util.keystr(path), P())),
        nn.unbox(params))


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


# ----------------------------------------------------------- Pallas calls under a mesh
def partitioned_axes():
    """``{axis: size}`` of the mesh axes that XLA's partitioner owns where this is traced
    (inside the decoders' ``per_data_shard``: ``model``, of any size: interpret mode's
    callbacks need every axis manual); empty off a mesh."""
    m = jax.sharding.get_abstract_mesh()
    if m.empty:
        return {}
    manual = set(getattr(m, "manual_axes", ()))
    return {a: n for a, n in m.shape.items() if a not in manual}


def model_split() -> int:
    """How many ways the partitioner splits ``model`` here (1 off a mesh)."""
    return partitioned_axes().get("model", 1)


def heads_axis(num_kv_heads: int):
    """The spec entry of a KV-head axis for :func:`per_device` (None where ``model`` does not
    split); an error when the heads do not divide over it (``jspec.kernels.resolve`` refuses that first)."""
    m = model_split()
    if m == 1:
        return None
    if num_kv_heads % m:
        raise ValueError(f"{num_kv_heads} KV heads do not split over a 'model' axis of {m}: the "
                         f"Pallas kernels cannot run here (kernels='auto' picks the reference)")
    return "model"


def per_device(fn, args: tuple, in_specs: tuple, out_specs):
    """``fn(*args)``, a Pallas kernel call. Off a mesh: directly. Under one, inside a
    ``shard_map`` over the partitioner's axes (``model``), so each device runs the kernel on
    its own block: ``in_specs`` / ``out_specs`` name the axes ``model`` splits (KV heads),
    everything else is replicated."""
    axes = partitioned_axes()
    if not axes:
        return fn(*args)
    if any(n > 1 for a, n in axes.items() if a != "model"):
        raise ValueError(f"the Pallas kernels run under a (data, model) mesh; this one also "
                         f"partitions {sorted(set(axes) - {'model'})}")
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes),
                         check_vma=False)(*args)
