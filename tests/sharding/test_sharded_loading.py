"""Loading straight into a mesh's shardings (HF safetensors slice by slice, Orbax's sharded
restore) gives the same parameters, placed as jspec.target.param_shardings says, on 8
simulated CPU devices (a fresh interpreter: XLA_FLAGS is read at start-up)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, sys
    import flax.linen as nn
    import jax, numpy as np
    import jspec
    from jspec import sharding
    from jspec.bench import configs
    from jspec.checkpoint import CheckpointError, load_target, save_hf, save_orbax
    from jspec.llama import init_params
    from jspec.target import Target, param_shardings

    out = sys.argv[1]
    cfg = configs.random_config("tiny")
    ref = Target(cfg, init_params(cfg, jax.random.key(5)))
    save_hf(ref, out + "/hf")
    save_orbax(ref, out + "/orbax")
    mesh = sharding.make_mesh(2, 4)
    want = param_shardings(cfg, mesh)
    res = {}
    for fmt in ("hf", "orbax"):
        t = load_target(out + "/" + fmt, mesh=mesh)
        same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                            t.params, ref.params)
        placed = jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), t.params, want)
        tokens = jspec.generate(t, [[1, 5, 9]] * 2, max_new_tokens=8, mesh=mesh, stop_ids=[]).tokens
        res[fmt] = {"same": all(jax.tree.leaves(same)), "placed": all(jax.tree.leaves(placed)),
                    "tokens": tokens}
    res["plain"] = jspec.generate(ref, [[1, 5, 9]] * 2, max_new_tokens=8, stop_ids=[]).tokens
    # A drafter restored straight into its shardings (its layers by the logical rules).
    from jspec.drafters import load_drafter, random_drafter, save_drafter, save_hf_drafter
    d = random_drafter("eagle3", cfg, jax.random.key(2))
    save_drafter(d, out + "/drafter")
    save_hf_drafter(d, out + "/hf_drafter")
    ds = load_drafter(out + "/drafter", cfg, mesh=mesh)
    dh = load_drafter(out + "/hf_drafter", cfg, mesh=mesh)     # EAGLE-3's HF layout, by slice
    res["hf_drafter_same"] = all(jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), dh.params, ds.params)))
    res["hf_drafter_placed"] = all(jax.tree.leaves(jax.tree.map(
        lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim), dh.params, ds.params)))
    want_d = ds.shardings(cfg, mesh)
    res["drafter"] = {
        "same": all(jax.tree.leaves(jax.tree.map(
            lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), ds.params,
            jax.tree.map(np.asarray, nn.unbox(d.params))))),
        "placed": all(jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(
            s, a.ndim), ds.params, want_d))),
        "head_sharded": "model" in str(ds.params["net"]["lm_head"]["kernel"].sharding.spec),
        "tokens": jspec.generate(load_target(out + "/orbax", mesh=mesh), [[1, 5, 9]] * 2,
                                 max_new_tokens=8, mesh=mesh, stop_ids=[], drafter=ds).tokens}
    bad = out + "/hf/config.json"
    c = json.load(open(bad)); c["hidden_size"] = 32; json.dump(c, open(bad, "w"))
    try:
        load_target(out + "/hf", mesh=mesh)
    except CheckpointError as e:
        res["error"] = str(e)
    print(json.dumps(res))
""")


def test_sharded_loading_equals_whole_loading(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                         "--xla_force_host_platform_device_count=8".strip())
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env,
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for fmt in ("hf", "orbax"):
        assert res[fmt]["same"] and res[fmt]["placed"], fmt
        assert res[fmt]["tokens"] == res["plain"], fmt
    assert "model.embed_tokens.weight" in res["error"]        # names the tensor
    assert res["drafter"]["same"] and res["drafter"]["placed"] and res["drafter"]["head_sharded"]
    assert res["drafter"]["tokens"] == res["plain"]
    assert res["hf_drafter_same"] and res["hf_drafter_placed"]
