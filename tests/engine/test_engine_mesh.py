"""The engine on a (1, 4) mesh of simulated CPU devices (tensor parallelism: the target's
pools and weights over KV heads) gives the unsharded engine's tokens, plain and with an
EAGLE-3 tree; a mesh with data > 1 is refused. XLA_FLAGS must be set before jax starts, so
this runs in a fresh interpreter."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from jspec import sharding
    from jspec.target import shard_target
    from jspec.checkpoint import load_target
    from jspec.drafters import random_drafter
    from jspec.engine import Engine, Request

    target = load_target(sys.argv[1])
    cases = json.load(open(sys.argv[1] + "/reference_greedy.json"))["cases"]
    reqs = [Request(c["prompt_token_ids"], n, stop_ids=[]) for c, n in zip(cases, [9, 20, 14, 5])]
    d = random_drafter("eagle3", target.config, jax.random.key(1))
    mesh = sharding.make_mesh(data=1, model=4)
    placed = shard_target(target, mesh)
    out = {}
    for name, dr in (("plain", None), ("eagle3", d)):
        ref = Engine(target, dr, slots=2, max_new_tokens=24).generate(reqs)
        eng = Engine(placed, dr, slots=2, max_new_tokens=24, mesh=mesh)
        got = eng.generate(reqs)
        pool = eng.state.core.cache.k_pages
        out[name] = {"same": [c.tokens for c in got] == [c.tokens for c in ref],
                     "pool_spec": str(pool.sharding.spec), "pool_devices": len(pool.devices())}
    try:
        Engine(placed, None, mesh=sharding.make_mesh(data=2, model=2))
        out["refused"] = False
    except ValueError as e:
        out["refused"] = "(1, model) mesh" in str(e)
    print(json.dumps(out))
""")


@pytest.mark.slow       # about 60 s: -m slow, for CI time (meshes stay in tests/sharding/)
def test_engine_on_a_model_mesh_equals_unsharded(stories_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                         "--xla_force_host_platform_device_count=4".strip())
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(stories_dir)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("plain", "eagle3"):
        assert out[name]["same"], out
        assert out[name]["pool_devices"] == 4 and "model" in out[name]["pool_spec"], out
    assert out["refused"]
