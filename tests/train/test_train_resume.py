"""Training survives preemption: `python -m jspec.train train --data FILE.jsonl` (online,
the grain pipeline) killed with SIGKILL mid-run, or stopped by SIGTERM, and rerun with
--resume ends with the parameters of an uninterrupted run, bit for bit (the data
pipeline's position is restored from the checkpoint: otherwise the batches, and so the
parameters, would differ)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "checkpoints" / "default"
STEPS = 30


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    from jspec.train.regen import STORY_OPENINGS
    rng = np.random.default_rng(0)
    lines = []
    for i in range(40):
        a, b = rng.choice(len(STORY_OPENINGS), 2, replace=False)
        if i % 3:
            lines.append({"text": f"{STORY_OPENINGS[a]} {STORY_OPENINGS[b]}."})
        else:
            lines.append({"messages": [{"role": "user", "content": STORY_OPENINGS[a]},
                                       {"role": "assistant", "content": STORY_OPENINGS[b]}]})
    p = tmp_path_factory.mktemp("data") / "train.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in lines) + "\n{bad json\n")
    return p


def _cmd(data, out, *extra):
    return [sys.executable, "-m", "jspec.train", "train", "--target", str(MODEL), "--data",
            str(data), "--kind", "eagle3", "--draft-vocab", "256", "--steps", str(STEPS),
            "--batch-size", "4", "--seq-len", "32", "--ckpt-every", "2", "--log-every", "5",
            "--no-progress", "--out", str(out), *extra]


def _steps(out: Path) -> list[int]:
    d = out / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def _interrupt(data, out, sig) -> subprocess.CompletedProcess:
    p = subprocess.Popen(_cmd(data, out), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not _steps(out) and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.02)
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
    return p.returncode, err


def _params(out: Path) -> list:
    import jax
    from jspec.checkpoint import load_target
    from jspec.drafters import load_drafter
    d = load_drafter(out / "drafter", load_target(MODEL).config)
    return [np.asarray(x) for x in jax.tree.leaves(d.params)]


@pytest.fixture(scope="module")
def uninterrupted(jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    full = subprocess.run(_cmd(jsonl, out), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    return _params(out)


@pytest.mark.parametrize("sig", [signal.SIGKILL,
                                 pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["sigkill", "sigterm"])
def test_killed_and_resumed_equals_uninterrupted(jsonl, uninterrupted, tmp_path, sig):
    rc, err = _interrupt(jsonl, tmp_path / "cut", sig)
    saved = _steps(tmp_path / "cut")
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL, err[-2000:]
    else:                          # finishes the step, saves it, exits cleanly
        assert rc == 0, err[-2000:]
        assert "SIGTERM" in (tmp_path / "cut" / "train.log").read_text()
    assert saved and saved[-1] < STEPS, saved           # stopped mid-run
    resumed = subprocess.run(_cmd(jsonl, tmp_path / "cut", "--resume"), cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in (tmp_path / "cut" / "train.log").read_text()
    for a, b in zip(uninterrupted, _params(tmp_path / "cut")):
        np.testing.assert_array_equal(a, b)
