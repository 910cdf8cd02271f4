"""The Pallas kernels under a (data, model) mesh (8 simulated CPU devices, interpret mode):
each kernel call runs inside a ``shard_map`` over ``model`` on its device's KV heads
(:func:`jspec.kernels.per_device`), and plain, tree and sampled generation equal the unsharded
runs with the references (chains run the same kernels as trees; tests/sharding/test_sharding.py
checks them on meshes with the references).

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
    from jspec import kernels, llama, sharding
    from jspec.config import LlamaConfig
    from jspec.drafters import random_drafter
    from jspec.spec_config import SpecConfig
    from jspec.target import Target, shard_target

    assert jax.device_count() == 8, jax.devices()
    # Lane-wide heads (128): the shape where the TPU attention kernel reads grouped queries
    # and the KV write kernel runs (with the accelerators' forward forced below).
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=128)
    target = Target(cfg, llama.init_params(cfg, jax.random.key(3)))
    prompts = [[1, 5, 9, 13, 17, 21, 2], [3, 4, 100, 7], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8],
               [11], [12, 13], [40, 41, 42], [7, 7, 7, 7]]
    d = random_drafter("eagle1", cfg, jax.random.key(5))
    gen = lambda t, **kw: jspec.generate(t, prompts, stop_ids=[], **kw).tokens
    out = {"want": gen(target, max_new_tokens=12, kernels="reference"),
           "want_sampled": gen(target, max_new_tokens=8, drafter=d, temperature=1.0, seed=5,
                               kernels="reference")}
    calls = []
    real = kernels.per_device
    kernels.per_device = lambda fn, *a: calls.append(
        [fn.__name__, sorted(sharding.partitioned_axes())]) or real(fn, *a)
    llama._rotates_whole_block = lambda: sys.argv[1] == "tpu_layout"
    mesh = sharding.make_mesh(data=4, model=2)
    t = shard_target(target, mesh)
    kw = dict(mesh=mesh, kernels="pallas_interpret")
    out["plain"] = gen(t, max_new_tokens=12, **kw)
    out["tree"] = gen(t, max_new_tokens=12, drafter=d, spec=SpecConfig(5, 4, 8), **kw)
    out["sampled"] = gen(t, max_new_tokens=8, drafter=d, temperature=1.0, seed=5, **kw)
    out["calls"] = calls
    print(json.dumps(out))
""")


# Both layouts run the attention, KV write and walk kernels; the TPU layout also hands the
# attention kernel the grouped q/k/v block. Both -m slow, for CI time (about 90 s each; the
# default run keeps sharded decoding in tests/sharding/test_sharding.py).
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cpu_layout", "tpu_layout"])
def test_kernels_under_a_mesh_equal_unsharded_references(layout):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, layout], env=env, cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("plain", "tree"):
        assert out[name] == out["want"], name
    assert out["sampled"] == out["want_sampled"]
    # The attention, KV write and walk kernels traced in the decoders ran over the mesh's
    # model axis ([] are the static checks resolve() traces off the mesh). The TPU layout
    # also feeds the attention kernel the grouped q/k/v block the write reads from.
    assert all(axes in ([], ["model"]) for _, axes in out["calls"]), out["calls"]
    on_mesh = {name for name, axes in out["calls"] if axes == ["model"]}
    assert on_mesh == {"attend", "write", "<lambda>"}, out["calls"]   # <lambda>: the walks
