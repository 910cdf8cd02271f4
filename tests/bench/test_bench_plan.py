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


def test_plan_quantize_int8_quarters_the_layer_weights(tmp_path):
    """``--quantize int8``: the target's layer weights are int8 values (a quarter of fp32's
    bytes) plus per-channel scales; the parts add up to the target's total; the mode shows."""
    import jax
    import numpy as np

    from benchmarks.anatomy import abstract_target_params
    from benchmarks.plan import LAYER_WEIGHTS
    from jspec.bench import configs

    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "jspec.bench", "plan", "--config", "tiny",
                           "--mesh", "1x1", "--batch", "2", "--context", "32", "--max-new", "16",
                           "--quantize", "int8", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# plan: tiny int8" in proc.stdout and "quantize=int8" in proc.stdout
    plan = json.loads(out.read_text())
    assert plan["info"]["quantize"] == "int8" and plan["info"]["fits"]
    mem = {r["what"]: r for r in plan["memory"]}
    values, scales = mem["target: layer weights"], mem["target: layer scales"]
    rest = mem["target: embed, head, norms"]
    assert values["dtype"] == "int8" and scales["dtype"] == rest["dtype"] == "float32"
    total = mem["target params"]["MB total"]
    assert abs(values["MB total"] + scales["MB total"] + rest["MB total"] - total) < 1e-9

    # The float32 target's layer weights, from the same abstract params (nothing compiled).
    f32 = abstract_target_params(configs.random_config("tiny"))
    f32_mb = sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                 for k in LAYER_WEIGHTS for x in jax.tree.leaves(f32["layers"][k])) / 2**20
    assert abs(f32_mb / values["MB total"] - 4.0) < 1e-9          # int8 values: exactly 1/4
    # With their per-output-channel scales (one fp32 per 64 or 128 inputs), still ~4x.
    assert 3.5 < f32_mb / (values["MB total"] + scales["MB total"]) < 4.0


@pytest.mark.parametrize("command", ["plan", "anatomy", "serve-plan"])
def test_quantize_mode_is_checked_before_anything_compiles(command, capsys):
    from jspec.bench.__main__ import main

    extra = ["--topology", "v5e:2x2"] if command == "serve-plan" else []
    with pytest.raises(SystemExit) as e:
        main([command, *extra, "--quantize", "int4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--quantize: invalid choice: 'int4'" in err and "int8" in err and "fp8" in err
