"""Running a ``python -m jspec.bench`` command that compiles for an abstract H200, in the
gpu-aot extra's Python (``JSPEC_GPU_AOT_PYTHON``; the test is skipped without one)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_python_or_skip() -> str:
    from jspec import aot
    python = aot.gpu_python()
    if python is None:
        pytest.skip(f"no GPU compiler: set {aot.GPU_PYTHON_ENV} to a Python with the gpu-aot "
                    "extra (docs/accelerators.md)")
    return python


def h200_bench_json(args: list[str], out: Path, timeout: int = 900) -> dict:
    """``python -m jspec.bench ARGS --json OUT`` in the gpu-aot Python, with the H200's own
    layer layout (unrolled: JSPEC_STACKED_LAYERS unset); its JSON."""
    python = gpu_python_or_skip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    env.pop("JSPEC_STACKED_LAYERS", None)
    r = subprocess.run([python, "-m", "jspec.bench", *args, "--json", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(Path(out).read_text())
