"""Drafter training on a (data, model) mesh equals one device: on 8 simulated CPU devices,
20 online EAGLE-3 steps (draft vocabulary, TTT) on the shipped default model give the same
losses and parameters on meshes (2, 4) (drafter replicated) and (4, 2) (drafter and Adam
state FSDP-sharded over data) as on one device; a two-process run (jax.distributed on
localhost, 4 devices each, every process running the same `python -m jspec.train train`)
gives the one-process result.

XLA_FLAGS must be set before jax initialises, so these run in fresh interpreters.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow       # three 8-device trainings and a two-process run: ~6 min

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "checkpoints" / "default"
STEPS = 20

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import jspec
    from jspec import sharding
    from jspec.train import drafter as D, features as F, trainer as T
    from jspec.train.sources import token_data

    assert jax.device_count() == 8, jax.devices()
    target = jspec.load_target(sys.argv[1])
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, target.config.vocab_size, n) for n in rng.integers(20, 64, 24)]
    data = token_data(seqs, length=64)
    aux = F.aux_layers_for(target.config.num_layers)
    d = D.build_drafter("eagle3", target.config, target.params, jax.random.key(1), aux_layers=aux,
                        draft_vocab=512, freqs=F.token_frequencies(data["tokens"], data["lens"],
                                                                    target.config.vocab_size))
    tc = T.TrainConfig(steps=%(steps)d, batch_size=8, lr=3e-3, warmup=2, log_every=1, online=True)
    out = {}
    for name, shape, fsdp in [("one", None, False), ("2x4", (2, 4), False), ("4x2", (4, 2), True)]:
        mesh = None if shape is None else sharding.make_mesh(*shape)
        mpath = f"{sys.argv[2]}/{name}.jsonl"
        trained, _ = T.train(d, target, data, T.TrainConfig(**{**tc.__dict__, "fsdp": fsdp}),
                             mesh=mesh, metrics_path=mpath, progress=False, log=lambda m: None)
        leaves = jax.tree.leaves(trained.params)
        np.savez(f"{sys.argv[2]}/{name}.npz", *[np.asarray(x) for x in leaves])
        out[name] = [r["loss"] for r in T.read_metrics(mpath)]
    json.dump(out, open(f"{sys.argv[2]}/losses.json", "w"))
""") % {"steps": STEPS}


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                          f"--xla_force_host_platform_device_count={devices}".strip())


def _params(path) -> list:
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


@pytest.fixture
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(MODEL), str(out)], cwd=ROOT,
                       env=_env(8), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads((out / "losses.json").read_text())


def test_sharded_training_equals_one_device(runs):
    out, losses = runs
    assert len(losses["one"]) == STEPS and losses["one"][-1] < losses["one"][0]
    for mesh in ("2x4", "4x2"):
        np.testing.assert_allclose(losses[mesh], losses["one"], rtol=2e-4, err_msg=mesh)
        for a, b in zip(_params(out / f"{mesh}.npz"), _params(out / "one.npz")):
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5, err_msg=mesh)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
    """The same CLI command on two processes (mesh 2x4 over 2 x 4 devices, FSDP) and on one
    process with 8 devices: the same losses and the same trained drafter."""
    rng = np.random.default_rng(1)
    seqs = [rng.integers(2, 2048, n) for n in rng.integers(20, 64, 16)]
    from jspec.train import regen
    regen.save_sequences(tmp_path / "seqs.npz", seqs)
    base = [sys.executable, "-m", "jspec.train", "train", "--target", str(MODEL), "--seqs",
            str(tmp_path / "seqs.npz"), "--kind", "eagle3", "--draft-vocab", "512", "--steps", "6",
            "--batch-size", "8", "--seq-len", "64", "--log-every", "1", "--mesh", "2x4", "--fsdp",
            "--no-progress"]
    one = subprocess.run(base + ["--out", str(tmp_path / "one")], cwd=ROOT, env=_env(8),
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    port = _free_port()
    cmd = base + ["--out", str(tmp_path / "two"), "--coordinator", f"localhost:{port}",
                  "--num-processes", "2"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], cwd=ROOT, env=_env(4),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    from jspec.train.trainer import read_metrics
    l1 = [r["loss"] for r in read_metrics(tmp_path / "one" / "metrics.jsonl")]
    l2 = [r["loss"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl")]
    assert len(l1) == 6
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    from jspec.drafters import load_drafter
    from jspec.checkpoint import load_target
    cfg = load_target(MODEL).config
    a, b = (load_drafter(tmp_path / n / "drafter", cfg) for n in ("one", "two"))
    import jax
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
