"""The environment for a subprocess that runs a real model: the suite's compile-time
shortcuts (``tests/conftest.py``: LLVM's optimisations off, right for the tiny models) left
out, since they make a 135M model's step about 13x slower."""

from __future__ import annotations

import os

SUITE_ONLY_FLAGS = ("--xla_backend_optimization_level", "--xla_llvm_disable_expensive_passes",
                    "--xla_cpu_use_fusion_emitters")


def full_optimisation() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith(SUITE_ONLY_FLAGS))
    return env
