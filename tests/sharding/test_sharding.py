"""Sharded decoding on 8 simulated CPU devices gives the unsharded tokens: plain decoding on
(2, 4) (three meshes with -m slow), speculative decoding (EAGLE-3 tree, MTP chain, DFlash tree, sampled tree) at batch 8 on
(2, 4) (and (8, 1), (1, 8), (4, 2) with -m slow), where every data shard runs its own loop over its own
KV page pool (jspec.sharding.per_data_shard).

XLA_FLAGS must be set before jax initialises, so this runs in a fresh interpreter.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import jspec
    from jspec import sharding
    from jspec.target import shard_target
    from jspec.checkpoint import load_target

    assert jax.device_count() == 8, jax.devices()
    target = load_target(sys.argv[1])
    cases = json.load(open(sys.argv[1] + "/reference_greedy.json"))["cases"][:4]
    prompts = [c["prompt_token_ids"] for c in cases]
    out = {}
    plain = {"plain": [(2, 4)], "plain-all": [(2, 4), (4, 2), (1, 8)]}.get(sys.argv[2], [])
    for data, model in plain:
        mesh = sharding.make_mesh(data=data, model=model)
        sharded = shard_target(target, mesh)
        spec = sharded.params["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec
        g = jspec.generate(sharded, prompts, max_new_tokens=40, stop_ids=[], mesh=mesh)
        s = jspec.generate(sharded, prompts, max_new_tokens=20, stop_ids=[], mesh=mesh,
                           temperature=1.0, seed=3)
        out[f"{data}x{model}"] = {"greedy": g.tokens, "sampled": s.tokens, "q_spec": str(spec)}
    out["plain"] = {} if not plain else {
                    "greedy": jspec.generate(target, prompts, max_new_tokens=40, stop_ids=[]).tokens,
                    "sampled": jspec.generate(target, prompts, max_new_tokens=20, stop_ids=[],
                                              temperature=1.0, seed=3).tokens}
    out["golden"] = [c["continuation_token_ids"][:40] for c in cases]
    # Speculative decoding at batch 8 on every 8-device mesh: an EAGLE-3 tree, an MTP chain
    # and a DFlash tree (greedy) and the EAGLE-3 tree sampled, against the unsharded runs.
    from jspec.drafters import random_drafter
    from jspec.spec_config import SpecConfig
    e3, mtp = random_drafter("eagle3", target.config), random_drafter("mtp", target.config)
    dfl = random_drafter("dflash", target.config, num_layers=2, block_size=8)
    rows8 = (prompts * 2)[:8]
    sampled = dict(max_new_tokens=16, stop_ids=[], temperature=1.0, seed=5)
    out["spec"] = {"plain": jspec.generate(target, rows8, max_new_tokens=24, stop_ids=[]).tokens,
                   "sampled": jspec.generate(target, rows8, drafter=e3, **sampled).tokens}
    for name in sys.argv[3].split(","):
        data, model = map(int, name.split("x"))
        mesh = sharding.make_mesh(data=data, model=model)
        t = shard_target(target, mesh)
        out["spec"][name] = {
            "eagle3": jspec.generate(t, rows8, max_new_tokens=24, stop_ids=[], mesh=mesh,
                                     drafter=e3).tokens,
            "mtp": jspec.generate(t, rows8, max_new_tokens=24, stop_ids=[], mesh=mesh, drafter=mtp,
                                  spec=SpecConfig.chain(3)).tokens,
            "dflash": jspec.generate(t, rows8, max_new_tokens=24, stop_ids=[], mesh=mesh,
                                     drafter=dfl, spec=SpecConfig(7, 2, 12)).tokens,
            "sampled": jspec.generate(t, rows8, drafter=e3, mesh=mesh, **sampled).tokens}
    print(json.dumps(out))
""")


def run_script(stories_dir, part: str, spec_meshes: str) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(stories_dir), part, spec_meshes],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for mesh in spec_meshes.split(","):
        assert out["spec"][mesh]["eagle3"] == out["spec"]["plain"], mesh
        assert out["spec"][mesh]["mtp"] == out["spec"]["plain"], mesh
        assert out["spec"][mesh]["dflash"] == out["spec"]["plain"], mesh
        assert out["spec"][mesh]["sampled"] == out["spec"]["sampled"], mesh
    return out


@pytest.mark.parametrize("meshes", ["plain", pytest.param("plain-all", marks=pytest.mark.slow)])
def test_sharded_decoding_matches_unsharded(stories_dir, meshes):
    """Plain decoding on (2, 4) by default; (4, 2) and (1, 8) too with -m slow."""
    out = run_script(stories_dir, meshes, "2x4")
    assert out["plain"]["greedy"] == out["golden"]
    for mesh in ("2x4",) if meshes == "plain" else ("2x4", "4x2", "1x8"):
        assert out[mesh]["greedy"] == out["plain"]["greedy"], mesh
        assert out[mesh]["sampled"] == out["plain"]["sampled"], mesh
        assert "model" in out[mesh]["q_spec"], out[mesh]["q_spec"]  # really tensor-parallel


# (2, 4) runs in the default run (above); the other three meshes with -m slow.
@pytest.mark.slow
@pytest.mark.parametrize("meshes", ["8x1", "1x8,4x2"])
def test_sharded_speculative_decoding_matches_unsharded(stories_dir, meshes):
    run_script(stories_dir, "spec", meshes)
