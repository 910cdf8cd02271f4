"""Sharded decoding on 8 simulated CPU devices gives the unsharded tokens: plain decoding on
three meshes, speculative decoding (EAGLE-3 tree, MTP chain, sampled tree) at batch 8 on
(1, 8), (2, 4), (4, 2) and (8, 1), where every data shard runs its own loop over its own
KV page pool (jspec.sharding.per_data_shard).

XLA_FLAGS must be set before jax initialises, so this runs in a fresh interpreter.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import jspec
    from jspec import sharding
    from jspec.checkpoint import load_target

    assert jax.device_count() == 8, jax.devices()
    target = load_target(sys.argv[1])
    cases = json.load(open(sys.argv[1] + "/reference_greedy.json"))["cases"][:4]
    prompts = [c["prompt_token_ids"] for c in cases]
    out = {}
    for data, model in [(2, 4), (4, 2), (1, 8)]:
        mesh = sharding.make_mesh(data=data, model=model)
        sharded = sharding.shard_target(target, mesh)
        spec = sharded.params["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec
        g = jspec.generate(sharded, prompts, max_new_tokens=40, stop_ids=[], mesh=mesh)
        s = jspec.generate(sharded, prompts, max_new_tokens=20, stop_ids=[], mesh=mesh,
                           temperature=1.0, seed=3)
        out[f"{data}x{model}"] = {"greedy": g.tokens, "sampled": s.tokens, "q_spec": str(spec)}
    out["plain"] = {"greedy": jspec.generate(target, prompts, max_new_tokens=40, stop_ids=[]).tokens,
                    "sampled": jspec.generate(target, prompts, max_new_tokens=20, stop_ids=[],
                                              temperature=1.0, seed=3).tokens}
    out["golden"] = [c["continuation_token_ids"][:40] for c in cases]
    # Speculative decoding at batch 8 on every 8-device mesh: an EAGLE-3 tree and an MTP
    # chain (greedy) and the EAGLE-3 tree sampled, against the unsharded runs.
    from jspec.drafters import random_drafter
    from jspec.spec_config import SpecConfig
    e3, mtp = random_drafter("eagle3", target.config), random_drafter("mtp", target.config)
    rows8 = (prompts * 2)[:8]
    sampled = dict(max_new_tokens=16, stop_ids=[], temperature=1.0, seed=5)
    out["spec"] = {"plain": jspec.generate(target, rows8, max_new_tokens=24, stop_ids=[]).tokens,
                   "sampled": jspec.generate(target, rows8, drafter=e3, **sampled).tokens}
    for data, model in [(1, 8), (2, 4), (4, 2), (8, 1)]:
        mesh = sharding.make_mesh(data=data, model=model)
        t = sharding.shard_target(target, mesh)
        out["spec"][f"{data}x{model}"] = {
            "eagle3": jspec.generate(t, rows8, max_new_tokens=24, stop_ids=[], mesh=mesh,
                                     drafter=e3).tokens,
            "mtp": jspec.generate(t, rows8, max_new_tokens=24, stop_ids=[], mesh=mesh, drafter=mtp,
                                  spec=SpecConfig.chain(3)).tokens,
            "sampled": jspec.generate(t, rows8, drafter=e3, mesh=mesh, **sampled).tokens}
    print(json.dumps(out))
""")


def test_sharded_decoding_matches_unsharded(stories_dir):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip(),
               JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(stories_dir)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plain"]["greedy"] == out["golden"]
    spec = out["spec"]
    for mesh in ("1x8", "2x4", "4x2", "8x1"):
        assert spec[mesh]["eagle3"] == spec["plain"], mesh
        assert spec[mesh]["mtp"] == spec["plain"], mesh
        assert spec[mesh]["sampled"] == spec["sampled"], mesh
    for mesh in ("2x4", "4x2", "1x8"):
        assert out[mesh]["greedy"] == out["plain"]["greedy"], mesh
        assert out[mesh]["sampled"] == out["plain"]["sampled"], mesh
        assert "model" in out[mesh]["q_spec"], out[mesh]["q_spec"]  # really tensor-parallel
