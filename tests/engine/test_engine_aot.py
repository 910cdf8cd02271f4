"""The engine's programs (decode for a full bucket, plain and speculative; the drafter's
catch-up; insert) compiled for
real chips without them: a v5e 2x4 slice as a (1, 8) mesh with the Mosaic kernels, and one
H200 with the Triton kernels (``python -m jspec.bench serve-plan``). Marked ``tpu_aot`` /
``gpu_aot`` and ``slow``; each skips with the reason when its compiler is absent."""

import pytest
from helpers.gpu_aot import h200_bench_json

from jspec import aot
from jspec.config import LlamaConfig


@pytest.mark.slow
@pytest.mark.tpu_aot
def test_engine_programs_compile_for_a_v5e_slice():
    why = aot.missing("v5e")
    if why:
        pytest.skip(why)
    from benchmarks.serve_plan import serve_plan
    from jspec.platform import building_for
    from jspec.sharding import make_mesh

    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2,
                      num_heads=8, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    mesh = make_mesh(1, 8, aot.topology_devices("tpu", "v5e:2x4"))
    with building_for("tpu"):
        out = serve_plan(cfg, "eagle3", mesh, slots=8, context=512, max_new=64, prompt=64,
                         log=lambda s: None)
    rows = out["programs"]
    assert len(rows) == 4 and all(r["fits"] for r in rows.values()), rows
    for name, r in rows.items():
        if name.startswith(("decode", "sync")):
            # The slots' state is donated: the KV pools are updated in place, not copied.
            assert r["alias"] >= out["info"]["target_KV_GB_per_chip"] * 0.99, (name, r)


@pytest.mark.slow
@pytest.mark.gpu_aot
def test_engine_programs_compile_for_an_h200(tmp_path):
    plan = h200_bench_json(["serve-plan", "--topology", "h200", "--config", "100m", "--slots",
                            "8", "--context", "2048", "--prompt", "1024", "--max-new", "64",
                            "--draft-vocab", "0"], tmp_path / "plan.json")
    rows, pools = plan["programs"], plan["info"]["target_KV_GB_per_chip"]
    assert len(rows) == 4 and all(r["fits"] for r in rows.values()), rows
    # A 1024-token prompt is two 512-token chunks: XLA:GPU unrolls the one-trip chunk scan,
    # and without the barrier between chunks (jspec.prefill.run) it copied the pools.
    for name, r in rows.items():
        assert r["temp"] < 0.5 * pools, (name, r, pools)
