"""Abstract devices of named accelerators, for compiling on a host that has none.

``jax.jit(f).trace(*args).lower().compile()`` over ``ShapeDtypeStruct`` arguments placed on
one of these devices runs the target's whole compiler here (Mosaic and XLA:TPU; Triton and
XLA:GPU), see ``../shared/DESIGN.md`` section 6. Targets:

| name   | platform | topology        | compiler (extra)                                       |
| ------ | -------- | --------------- | ------------------------------------------------------ |
| v5e    | tpu      | ``v5e:2x2``     | libtpu (``tpu-aot``)                                   |
| v6e    | tpu      | ``v6e:2x2``     | libtpu (``tpu-aot``)                                   |
| v5p    | tpu      | ``v5p:2x2x1``   | libtpu (``tpu-aot``)                                   |
| h200   | gpu      | ``1x1x1``       | jax's CUDA 13 plugin + nvcc/nvvm wheels (``gpu-aot``)  |

The H200's ``GpuTargetConfigProto`` is test data (``tests/data/aot/h200_target_config.pbtxt``,
with where its numbers come from); ``JSPEC_GPU_TARGET_CONFIG`` names another file.

Nothing here starts a compiler until :func:`device` is called (:func:`missing` only looks
for the packages), so plain CPU runs never build a TPU topology, which initialises libtpu
and prints its host warnings, nor start a CUDA backend. The CUDA
plugin is best kept out of the main environment (with it installed every ``import jax``
tries to start a CUDA backend): ``JSPEC_GPU_AOT_PYTHON`` names an interpreter that has it,
and callers run their GPU compiles there (:func:`gpu_python`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import jax

GPU_PYTHON_ENV = "JSPEC_GPU_AOT_PYTHON"
GPU_CONFIG_ENV = "JSPEC_GPU_TARGET_CONFIG"
H200_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "aot" / "h200_target_config.pbtxt"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str            # "tpu" or "gpu" (the kernels' backend names)
    topology: str


TARGETS = {t.name: t for t in (Target("v5e", "tpu", "v5e:2x2"), Target("v6e", "tpu", "v6e:2x2"),
                               Target("v5p", "tpu", "v5p:2x2x1"), Target("h200", "gpu", "1x1x1"))}
INSTALL = {"tpu": "pip install -e '.[tpu-aot]'",
           "gpu": "pip install -e '.[gpu-aot]' (best in its own virtualenv, named by "
                  f"{GPU_PYTHON_ENV}; see docs/accelerators.md)"}


# HBM per chip, by ``device_kind`` (published capacities; XLA:TPU's own limit for v5p read
# 95.74 GiB in an out-of-memory message here), to set compiled programs' memory against.
HBM_BYTES = {"TPU v5 lite": 16 * 2**30, "TPU v6 lite": 32 * 2**30, "TPU v5": 95 * 2**30,
             "NVIDIA H200": 141e9}


def hbm_bytes(dev) -> float | None:
    """HBM of an (abstract) device's chip, or None for a kind not in :data:`HBM_BYTES`."""
    return HBM_BYTES.get(getattr(dev, "device_kind", None))


class CompilerMissing(RuntimeError):
    """The target's compiler is not installed in this interpreter."""


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown AOT target {name!r}: choose one of {sorted(TARGETS)}")
    return TARGETS[name]


def missing(name: str) -> str | None:
    """Why ``name`` cannot be compiled for in this interpreter (None: it can). Looks for the
    packages only; imports nothing."""
    t = target(name)
    if t.platform == "tpu":
        return None if importlib.util.find_spec("libtpu") else \
            f"no TPU compiler (libtpu) in {sys.executable}: {INSTALL['tpu']}"
    if importlib.util.find_spec("jax_plugins") is None or \
            importlib.util.find_spec("jax_plugins.xla_cuda13") is None:
        return f"no GPU compiler (jax-cuda13-plugin) in {sys.executable}: {INSTALL['gpu']}"
    return None


def gpu_python() -> str | None:
    """An interpreter that can compile for the GPU targets: ``$JSPEC_GPU_AOT_PYTHON`` if set,
    else this one when it has the CUDA plugin, else None."""
    return os.environ.get(GPU_PYTHON_ENV) or (None if missing("h200") else sys.executable)


def gpu_target_config(path: str | os.PathLike | None = None) -> str:
    """The H200 ``GpuTargetConfigProto`` text (or the file ``path`` / ``$JSPEC_GPU_TARGET_CONFIG``)."""
    p = Path(path or os.environ.get(GPU_CONFIG_ENV) or H200_CONFIG)
    if not p.is_file():
        raise FileNotFoundError(f"GPU target config {p} not found (set {GPU_CONFIG_ENV})")
    return p.read_text()


def topology_devices(platform: str, topology: str, gpu_name: str = "h200") -> list:
    """All abstract devices of a TPU topology (e.g. ``v5e:2x4``) or of a GPU topology
    (``1x1x1``, described by :func:`gpu_target_config`). Raises :class:`CompilerMissing`
    when the compiler is absent or refuses to start."""
    from jax.experimental import topologies
    try:
        if platform == "tpu":
            return list(topologies.get_topology_desc(topology, platform="tpu").devices)
        if platform == "gpu":
            os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
            return list(topologies.get_topology_desc(gpu_name, "cuda", target_config=gpu_target_config(),
                                                     topology=topology).devices)
    except Exception as e:
        raise CompilerMissing(f"{platform} topology {topology}: no compiler here "
                              f"({type(e).__name__}: {str(e).strip()[:300]}); "
                              f"{INSTALL[platform]}") from None
    raise ValueError(f"platform {platform!r}: 'tpu' or 'gpu'")


def device(name: str):
    """The first abstract device of target ``name`` (see the module table)."""
    t = target(name)
    why = missing(name)
    if why:
        raise CompilerMissing(f"{name}: {why}")
    return topology_devices(t.platform, t.topology, t.name)[0]


def with_shardings(tree, shardings):
    """``tree`` of arrays / ShapeDtypeStructs as ShapeDtypeStructs with ``shardings`` (a tree
    of the same structure)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)


def used_bytes(memory) -> int:
    """Device memory a compiled program holds at its peak, from its ``memory_analysis()``:
    arguments and outputs (an output aliased to a donated argument counted once) and
    temporaries."""
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def placed(tree, dev):
    """``tree`` of arrays / ShapeDtypeStructs as ShapeDtypeStructs on ``dev``."""
    sh = jax.sharding.SingleDeviceSharding(dev)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree)
