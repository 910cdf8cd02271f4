"""``python -m jspec.bench plan --train``: one online drafter training step (the trainer's own
``make_train_step``) compiled from abstract inputs on simulated CPU devices, with and without
FSDP (benchmarks.train_plan). The plan runs in a child process (the device count is set
there)."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_abstract_drafter_is_what_build_drafter_builds():
    """The plan's abstract drafter has build_drafter's tree, shapes and dtypes (the real one
    reads the target's head and token counts on the host, so the plan cannot trace it)."""
    from benchmarks.train_plan import abstract_train_drafter, drafter_arch
    from jspec import llama
    from jspec.bench import configs
    from jspec.train.drafter import build_drafter
    cfg = configs.random_config("tiny")
    arch = drafter_arch("eagle3", cfg)
    assert set(arch) == {"aux_layers"}      # as `python -m jspec.train train` passes them
    real = build_drafter("eagle3", cfg, llama.init_params(cfg, jax.random.key(0)),
                         jax.random.key(1), draft_vocab=128, freqs=np.arange(cfg.vocab_size),
                         **arch)
    module, abstract = abstract_train_drafter("eagle3", cfg, 128, **arch)
    assert module == real.module
    assert jax.tree.structure(abstract) == jax.tree.structure(real.params)
    shape = lambda t: jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype).name), t)
    assert shape(abstract) == shape(real.params)


def _plan(tmp_path, fsdp: str) -> dict:
    out = tmp_path / f"train{fsdp}.json"
    proc = subprocess.run([sys.executable, "-m", "jspec.bench", "plan", "--train", "--config",
                           "tiny", "--mesh", "2x2", "--seq-len", "32", "--batch", "4",
                           "--draft-vocab", "128", fsdp, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "per chip, XLA memory analysis" in proc.stdout
    plan = json.loads(out.read_text())
    plan["mem"] = {r["what"].split(" (")[0]: r for r in plan["memory"]}
    return plan


@pytest.mark.slow        # two plan subprocesses: ~30 s
def test_train_plan_fsdp_splits_the_drafter_state_over_data(tmp_path):
    sharded, repl = _plan(tmp_path, "--fsdp"), _plan(tmp_path, "--no-fsdp")
    data = 2
    for p, fsdp in ((sharded, True), (repl, False)):
        info, mem = p["info"], p["mem"]
        assert info["fsdp"] is fsdp and info["mesh"] == "2x2" and info["fits"] == "n/a"
        params, opt = mem["eagle3 params"], mem["optimizer state"]
        # AdamW holds two moments shaped like the trained parameters (plus scalars).
        assert 0 <= opt["bytes_total"] - 2 * params["bytes_total"] < 64
        # The target is split over model (2) like inference; only its norms stay whole.
        t = mem["target params"]
        assert t["bytes_per_device"] == (t["bytes_total"] - t["bytes_replicated"]) // 2 \
            + t["bytes_replicated"]
        assert t["bytes_replicated"] < 0.01 * t["bytes_total"]
        # XLA's arguments are one device's shards of what the shardings say (less the
        # frozen d2t map, which the step never reads, so jit drops it).
        shards = sum(r["bytes_per_device"] for r in p["memory"])
        assert abs(p["xla"]["arguments"] - shards) < 0.01 * shards, (p["xla"], shards)
        assert p["xla"]["temporaries (activations)"] > 0
        # The HLO's matmuls, each loop body once, are most of XLA's own count (which adds
        # the elementwise work). Weighting by loop trips cannot lower it; tiny's 2 layers
        # with aux layers (1, 1, 0) run inline (jspec.llama.forward), so there is no layer
        # loop to weight here: the v5e test below checks the weighting on 16 layers.
        st = p["step"]
        assert 0.5 * st["flops"] < st["matmul_flops_once"] <= st["flops"], st
        assert st["matmul_flops_weighted"] >= st["matmul_flops_once"], st
        assert p["step"]["tokens"] == 4 * 32
    for what in ("eagle3 params", "optimizer state"):
        s, r = sharded["mem"][what], repl["mem"][what]
        assert r["bytes_per_device"] == r["bytes_total"] == r["bytes_replicated"]
        # FSDP: every leaf but the optimizer's step counters is split over data.
        assert s["bytes_replicated"] < 64
        assert s["bytes_per_device"] == (s["bytes_total"] - s["bytes_replicated"]) // data \
            + s["bytes_replicated"]
    saved = (repl["mem"]["optimizer state"]["bytes_per_device"]
             + repl["mem"]["eagle3 params"]["bytes_per_device"]) / data
    assert repl["xla"]["arguments"] - sharded["xla"]["arguments"] == pytest.approx(saved, rel=0.02)


@pytest.mark.slow
@pytest.mark.tpu_aot
def test_train_plan_compiles_for_a_v5e_slice():
    """The tiny target (16 layers here: aux layers (2, 8, 13) leave loops of 2-6 layers; with
    4 layers the compiled step weighted its matmuls no more than once, no loop left) with an
    EAGLE-3 step on a v5e 2x2 as a (2, 2) mesh, FSDP on: it fits a 16 GiB chip, the chip's
    memory analysis holds the shardings' arguments, and the matmul flops read from XLA:TPU's
    HLO (convolutions there) agree with its cost analysis."""
    from jspec import aot
    why = aot.missing("v5e")
    if why:
        pytest.skip(why)
    from benchmarks.train_plan import train_plan
    from jspec.bench import configs
    from jspec.platform import building_for
    from jspec.sharding import make_mesh
    mesh = make_mesh(2, 2, aot.topology_devices("tpu", "v5e:2x2"))
    with building_for("tpu"):
        p = train_plan(configs.random_config("tiny", "bfloat16").replace(num_layers=16), "eagle3",
                       mesh, seq_len=128, draft_vocab=128).as_dict()
    assert p["info"]["fits"] == "yes" and p["info"]["fsdp"], p["info"]
    assert p["info"]["chip"] == "TPU v5 lite"
    # XLA:TPU pads the tiny arrays to its (8, 128) tiles: at least the shards' bytes.
    shards = sum(r["bytes_per_device"] for r in p["memory"])
    assert shards <= p["xla"]["arguments"] < 4 * shards, (p["xla"], shards)
    st = p["step"]
    assert 0.5 * st["flops"] < st["matmul_flops_once"] <= st["flops"], st
    assert st["matmul_flops_weighted"] > st["matmul_flops_once"], st     # the layer loop


@pytest.mark.slow
@pytest.mark.gpu_aot
def test_train_plan_compiles_for_an_h200(tmp_path):
    from helpers.gpu_aot import h200_bench_json
    p = h200_bench_json(["plan", "--train", "--topology", "h200", "--mesh", "1x1", "--config",
                         "tiny", "--dtype", "bfloat16", "--seq-len", "128", "--draft-vocab",
                         "128"], tmp_path / "plan.json")
    assert p["info"]["chip"] == "NVIDIA H200" and p["info"]["fits"] == "yes", p["info"]
    assert p["xla"]["temporaries (activations)"] > 0 and p["step"]["matmul_flops_weighted"] > 0
    assert p["step"]["flops"] is None or p["step"]["flops"] > 0     # XLA:GPU deviceless: none
