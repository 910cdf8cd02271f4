"""A two-process run (jax.distributed on localhost, CPU, 4 devices each, gloo collectives)
gives the same tokens as one process: every process runs the same `python -m jspec generate`
command, takes its half of the prompts onto the data shards of its own devices, and process 0
writes every row (jspec.distributed)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import jspec
from jspec.checkpoint import load_target
from jspec.drafters import random_drafter

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow       # two processes, about 70 s: -m slow, for CI time
def test_two_processes_equal_one(stories_dir, tmp_path):
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    prompts = ([c["prompt_token_ids"] for c in cases] * 2)[:8]
    port, out = _free_port(), tmp_path / "out.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                         "--xla_force_host_platform_device_count=4".strip())
    cmd = [sys.executable, "-m", "jspec", "generate", "--model", str(stories_dir),
           "--max-new-tokens", "24", "--drafter", "random:eagle3", "--mesh", "2x4",
           "--coordinator", f"localhost:{port}", "--num-processes", "2", "--output", str(out),
           "--kernels", "reference"]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    got = json.loads(out.read_text())
    assert got["processes"] == 2
    target = load_target(stories_dir)
    one = jspec.generate(target, prompts, max_new_tokens=24,
                         drafter=random_drafter("eagle3", target.config))
    assert got["tokens"] == one.tokens
