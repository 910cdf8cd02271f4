"""``python -m jspec.bench plan``: the sharded speculative program compiled on simulated CPU
devices from abstract weights. It runs in a child process (the device count is set there)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_plan_kv_scales_with_both_axes_and_no_collective_crosses_data(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "jspec.bench", "plan", "--config", "tiny",
                           "--mesh", "4x2", "--batch", "8", "--context", "64", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    mem = {r["what"]: r for r in plan["memory"]}
    kv = mem["target KV (k+v)"]
    assert kv["spec"] == "P(None, 'model', 'data')"
    assert abs(kv["MB/device"] * 8 - kv["MB total"]) < 1e-6            # 1 / (data x model)
    assert abs(mem["eagle3 KV (k+v)"]["MB/device"] * 4 - mem["eagle3 KV (k+v)"]["MB total"]) < 1e-6
    coll = plan["collectives"]
    # Tensor parallelism's all-reduces are there; every collective stays inside one data
    # shard's model group (2 devices): rows never cross the data axis.
    assert any(c["op"] == "all-reduce" and "dot_general" in c["source"] for c in coll)
    assert all(c["group"] in (None, 2) for c in coll), coll
    assert plan["xla"]["argument"] > 0


@pytest.mark.slow       # CI time: a second plan subprocess (15 s); the first covers the plan
def test_plan_topology_falls_back_to_cpu_devices_and_pallas_needs_one(tmp_path):
    """Without libtpu, --topology compiles on simulated CPU devices (with a note); the Mosaic
    kernels need a topology."""
    import importlib.util
    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed: --topology compiles for the chips here")
    out = tmp_path / "plan.json"
    args = [sys.executable, "-m", "jspec.bench", "plan", "--config", "tiny", "--mesh", "4x2",
            "--batch", "8", "--context", "64"]
    proc = subprocess.run(args + ["--topology", "v5e:2x4", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "falling back to simulated CPU devices" in proc.stdout
    info = json.loads(out.read_text())["info"]
    assert info["kernels"] == "reference" and info["fits"] and info["iteration_io_MB"] > 0
    proc = subprocess.run(args + ["--kernels", "pallas"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and "needs --topology" in proc.stderr + proc.stdout
