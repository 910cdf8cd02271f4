"""Multi-host runs: JAX's multi-controller runtime, one process per host.

Every process runs the same program. :func:`initialize` joins them (``jax.distributed``; on
TPU pods and Slurm/Open MPI launches the coordinator is found automatically). Each process
then calls :func:`jspec.generate` with a mesh over *all* processes' devices and **its own
prompts**, the same number on every process: its rows go to the data shards on its own
devices (:func:`jax.make_array_from_process_local_data`) and it gets its own rows back. The
static shapes (prompt bucket, output width, pages per shard) are agreed across processes
first, and row ``r`` of process ``p`` samples with the key of global row ``p * B + r``, so
the tokens equal a one-process run over all processes' prompts in process order.

Requirements checked before anything compiles: every data shard's devices belong to one
process (the model axis stays inside a host; :func:`jspec.sharding.make_mesh` over
``jax.devices()`` orders them so), and every process brings the same number of rows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger("jspec")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join the processes of a multi-host run (a no-op when already joined). With no
    arguments JAX detects the cluster (TPU pod slices, Slurm, Open MPI); CPU runs use gloo
    for their cross-process collectives."""
    if jax.distributed.is_initialized():
        return
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:                 # an older jax without the option: CPU runs stay local
        pass
    jax.distributed.initialize(coordinator, num_processes, process_id)
    log.info("jspec: process %d of %d, %d local devices of %d", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())


def join(args) -> bool:
    """Join the multi-host run the command's flags ask for (``--distributed`` or
    ``--coordinator``; :func:`jspec.args.add_process_args`), before anything starts a
    backend. Returns whether they asked for one."""
    multi = bool(args.distributed or args.coordinator is not None)
    if multi:
        initialize(args.coordinator, args.num_processes, args.process_id)
    return multi


def is_multiprocess(mesh) -> bool:
    return mesh is not None and jax.process_count() > 1


def check_mesh(mesh) -> int:
    """The number of data shards on this process's devices; refuses a mesh whose data shards
    span processes."""
    devs = np.asarray(mesh.devices)
    procs = np.vectorize(lambda d: d.process_index)(devs)
    split = [d for d in range(devs.shape[0]) if len(set(procs[d])) > 1]
    if split:
        raise ValueError(f"data shard {split[0]} of the mesh spans processes "
                         f"{sorted(set(procs[split[0]]))}: the model axis must stay inside a "
                         "host (make_mesh over jax.devices() orders devices so)")
    mine = int(np.sum(procs[:, 0] == jax.process_index()))
    if mine == 0:
        raise ValueError(f"process {jax.process_index()} holds no data shard of the mesh")
    return mine


def allgather(x) -> np.ndarray:
    """``[process_count, *x.shape]``: every process's ``x``."""
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(np.asarray(x)))


def agree(batch: int, sizes) -> tuple[int, ...]:
    """One gather over the processes: refuses unequal row counts and returns the maxima of
    ``sizes`` (longest prompt, most new tokens, ...), so every process compiles one shape."""
    got = allgather(np.array([batch, *sizes], np.int64))
    if len(set(got[:, 0].tolist())) != 1:
        raise ValueError(f"every process must bring the same number of prompts; got "
                         f"{got[:, 0].tolist()} per process")
    return tuple(int(v) for v in got[:, 1:].max(0))


def global_rows(mesh, local: np.ndarray):
    """This process's rows of a global ``[B_total, ...]`` array split over ``data``."""
    from jspec.sharding import batch_sharding
    return jax.make_array_from_process_local_data(batch_sharding(mesh, local.ndim), local)


def local_rows(mesh, x) -> np.ndarray:
    """This process's rows of a global row-sharded array, as numpy."""
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P
    return np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, P("data")))


def write_combined(path, result) -> None:
    """Process 0 writes every process's rows (in global row order) as JSON; every process
    must call this (it gathers)."""
    toks = result.tokens
    width = int(allgather(np.int32(max(map(len, toks), default=0))).max())
    pad = np.full((len(toks), width), -1, np.int32)
    for r, t in enumerate(toks):
        pad[r, :len(t)] = t
    everyone = allgather(pad).reshape(-1, width)
    if jax.process_index() == 0:
        rows = [[int(t) for t in row if t >= 0] for row in everyone]
        Path(path).write_text(json.dumps({"processes": jax.process_count(), "tokens": rows}))
