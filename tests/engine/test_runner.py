"""``python -m jspec run``: killed (SIGKILL at a random moment, then SIGTERM) and rerun, it ends
with every id exactly once and the results of an uninterrupted run; two processes give the
results of one; bad records are reported and the run goes on."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STABLE = ("id", "line", "text", "token_ids", "new_tokens", "mean_accept_len", "iterations",
          "stop_reason", "error")


@pytest.fixture(scope="module")
def dataset(stories_dir, tmp_path_factory):
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("run") / "in.jsonl"
    lines = []
    for i in range(36):
        rec = {"id": f"q{i}", "prompt_ids": prompts[i % len(prompts)][: 2 + i % 7],
               "max_new_tokens": rng.choice([6, 20, 40, 64])}
        if i % 3 == 0:                     # sampled, with its own seed (or the default one)
            rec.update(temperature=0.9, **({"seed": i} if i % 2 else {}))
        lines.append(json.dumps(rec))
    lines[5] = '{"id": "broken", "prompt_ids": [1, 2'            # bad JSON
    lines[9] = json.dumps({"id": "q9", "prompt_ids": [1, 99999]})  # outside the vocabulary
    path.write_text("\n".join(lines) + "\n")
    return path


def command(stories_dir, dataset, out, *extra):
    return [sys.executable, "-m", "jspec", "run", "--model", str(stories_dir), "--drafter",
            "random:eagle3", "--input", str(dataset), "--output", str(out), "--slots", "2",
            "--chunk", "1", "--kernels", "reference", "--no-progress", *extra]


def run(cmd, **kw):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)


def results(path: Path) -> dict:
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(map(json.dumps, ids))), "an id was written twice"
    return {json.dumps(r["id"]): {k: r.get(k) for k in STABLE} for r in recs}


def lines_in(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def interrupt(cmd, out: Path, after_lines: int, sig) -> int:
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.time() + 300
    while p.poll() is None and lines_in(out) < after_lines and time.time() < deadline:
        time.sleep(0.02)
    if p.poll() is None:
        p.send_signal(sig)
    p.communicate(timeout=300)
    return p.returncode


@pytest.fixture(scope="module")
def uninterrupted(stories_dir, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    r = run(command(stories_dir, dataset, out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "line 6, id None: bad JSON" in r.stderr
    assert "line 10, id 'q9'" in r.stderr and "outside the vocabulary" in r.stderr
    return results(out)


def test_resume_after_sigkill_and_sigterm(stories_dir, dataset, uninterrupted, tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = command(stories_dir, dataset, out)
    kill_at = random.Random(os.getpid()).randint(3, 20)
    interrupt(cmd, out, kill_at, signal.SIGKILL)
    with open(out, "a") as f:                      # as if the kill cut the last line short
        f.write('{"id": "q3", "line": 4, "te')
    rc = interrupt(cmd, out, lines_in(out) + 3, signal.SIGTERM)
    assert rc == 0                                 # SIGTERM: the chunk finishes, exit 0
    assert out.read_text().endswith("\n")          # only whole lines
    r = run(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    got = results(out)
    assert got == uninterrupted
    assert len(got) == 36
    assert sum(v["error"] is not None for v in got.values()) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one(stories_dir, dataset, uninterrupted, tmp_path):
    out, port = tmp_path / "out.jsonl", _free_port()
    base = command(stories_dir, dataset, out, "--coordinator", f"localhost:{port}",
                   "--num-processes", "2")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(base + ["--process-id", str(i)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    assert (tmp_path / "out.jsonl.part-0-of-2").is_file()
    assert results(out) == uninterrupted
