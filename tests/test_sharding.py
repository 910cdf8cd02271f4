"""Sharded decoding on 8 simulated CPU devices gives the unsharded tokens.

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
    from jspec.drafters import random_drafter
    mesh = sharding.make_mesh(data=2, model=4)
    d = random_drafter("eagle1", target.config)
    out["spec_2x4"] = jspec.generate(sharding.shard_target(target, mesh), prompts, max_new_tokens=40,
                                     stop_ids=[], mesh=mesh, drafter=d).tokens
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
    assert out["spec_2x4"] == out["golden"]                # speculative decoding, sharded
    for mesh in ("2x4", "4x2", "1x8"):
        assert out[mesh]["greedy"] == out["plain"]["greedy"], mesh
        assert out[mesh]["sampled"] == out["plain"]["sampled"], mesh
        assert "model" in out[mesh]["q_spec"], out[mesh]["q_spec"]  # really tensor-parallel
