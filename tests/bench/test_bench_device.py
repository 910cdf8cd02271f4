"""``python -m jspec.bench device``: the prepared accelerator script, run with ``--smoke``
(tiny shapes) on CPU; and its section isolation (a section over its cap is recorded as a
timeout while the others run)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import device

ROOT = Path(__file__).resolve().parents[2]


def _numbers(x, path=""):
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.mark.slow
def test_smoke_run_writes_every_section(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "jspec.bench", "device", "--smoke"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "section" in proc.stdout and "status" in proc.stdout      # the summary table
    payload = json.loads((tmp_path / device.RESULT_NAME).read_text())
    secs = payload["sections"]
    assert list(secs) == list(device.SECTIONS)
    for name, r in secs.items():
        want = ("ok", "skipped") if name == "hf" else ("ok",)   # hf: no torch/CUDA here
        assert r["status"] in want, (name, r.get("error"), r.get("log tail"))
        if r["status"] == "skipped":
            assert r["reason"]
            continue
        for path, v in _numbers(r):
            if "returncode" not in path:
                assert math.isfinite(v), (name, path, v)
    assert payload["device"]["backend"] == "cpu"
    assert secs["copy"]["GB/s"] > 0
    for row in secs["plain_decode"]["rows"]:
        assert row["ms/step"] > 0 and row["GB/s"] > 0 and row["floor ms"] > 0
        assert row["kernels"] == "reference"
    assert [r["batch"] for r in secs["plain_decode"]["rows"]] == [1, 2]
    v = secs["verify"]["rows"]
    assert [r["N"] for r in v] == [1, 8] and v[0]["t_V/t_1"] == 1.0
    assert all(r["ms"] > 0 and r["t_V/t_1"] > 0 for r in v)
    assert secs["draft"]["c"] > 0 and secs["draft"]["draft vocab"] == 128
    e = secs["e2e"]["rows"]
    assert all(r["tokens/s"] > 0 and r["speedup"] > 0 for r in e)
    assert e[1]["accept len"] == pytest.approx(e[1]["E"], abs=0.5)
    assert e[1]["ideal"] > 0                                  # verify N=8 and draft both ran
    assert all(r["ok"] for r in secs["kernels"]["rows"])
    assert secs["kernels"]["auto"]["mode"] == "reference"
    assert secs["pytest"]["counts"].get("passed", 0) >= 1 and not secs["pytest"]["failed"]


def test_a_section_over_its_cap_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
    monkeypatch.setitem(device.SMOKE_CAPS, "copy", 0.2)    # cannot even start a process
    payload = device.run_all(True, 300, only=["copy", "hf"], out_dir=str(tmp_path),
                             log=lambda m: None)
    on_disk = json.loads((tmp_path / device.RESULT_NAME).read_text())
    assert list(on_disk["sections"]) == ["copy", "hf"]
    assert on_disk["sections"]["copy"]["status"] == "timeout"
    assert on_disk["sections"]["hf"]["status"] in ("ok", "skipped")
    assert "section" in device.render(payload)
    spent = device.run_all(True, 5, only=["copy"], out_dir=str(tmp_path), log=lambda m: None)
    assert spent["sections"]["copy"]["status"] == "skipped"


def test_pytest_outcomes_read_plain_and_xdist_output():
    """The pytest section counts outcomes from ``pytest -v`` with and without xdist (the
    project's addopts run xdist, whose lines put the outcome first)."""
    text = ("tests/a.py::x PASSED [ 50%]\n"
            "[gw1] [ 50%] PASSED tests/k.py::test_one \n"
            "[gw0] [100%] FAILED tests/k.py::test_two[4-bf16] \n"
            "tests/a.py::y SKIPPED (no torch)\n")
    assert device.pytest_outcomes(text) == [
        ("tests/a.py::x", "PASSED"), ("tests/k.py::test_one", "PASSED"),
        ("tests/k.py::test_two[4-bf16]", "FAILED"), ("tests/a.py::y", "SKIPPED")]
