"""``python -m jspec.bench load``: host memory of loading a checkpoint onto a mesh, read whole
and then placed vs read slice-wise into the shardings (``load_target(path, mesh=...)``).

Each mode runs in a fresh child process on ``DATA x MODEL`` simulated CPU devices; a thread
samples the process's anonymous resident memory (``RssAnon``: what the load allocates; the
checkpoint's file pages are mapped and reclaimable) every 2 ms. On CPU devices the device
arrays live in host memory too, so the table reports the peak *above* them: the host-side
transient of the load. ``--random-config NAME`` writes a random HF checkpoint of that shape to
a temporary directory first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

from jspec.args import parse_mesh
from jspec.bench import common
from jspec.bench.registry import Command, run_module

CHILD = textwrap.dedent("""
    import json, os, sys, threading, time
    import jax
    from jspec import sharding
    from jspec.target import shard_target
    from jspec.checkpoint import load_target
    path, mode, data, model = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    mesh = sharding.make_mesh(data, model)
    jax.block_until_ready(jax.device_put(0.0, jax.devices()[0]))
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    peak, base = [0.0], anon()
    def sample():
        while True:
            peak[0] = max(peak[0], anon()); time.sleep(0.002)
    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    t = (shard_target(load_target(path), mesh) if mode == "whole"
         else load_target(path, mesh=mesh))
    jax.block_until_ready(t.params)
    secs = time.perf_counter() - t0
    time.sleep(0.02)
    leaves = jax.tree.leaves(t.params)
    dev = sum(s.data.nbytes for x in leaves for s in x.addressable_shards) / 2**20
    print(json.dumps({"mode": mode, "checkpoint MB": sum(x.nbytes for x in leaves) / 2**20,
                      "device arrays MB": dev, "peak anon MB": peak[0] - base,
                      "host transient MB": peak[0] - base - dev, "seconds": secs}))
""")


def add_args(s) -> None:
    s.add_argument("--checkpoint", default=None, help="HF or Orbax directory")
    s.add_argument("--random-config", default="100m",
                   help="without --checkpoint: write a random HF checkpoint of this shape")
    s.add_argument("--mesh", default="2x4", help="DATAxMODEL")
    s.add_argument("--json", metavar="OUT")


def main(args) -> dict:
    data, model = parse_mesh(args.mesh)
    path, tmp = args.checkpoint, None
    if path is None:
        import jax

        from jspec.bench import configs
        from jspec.checkpoint import save_hf
        from jspec.llama import init_params
        from jspec.target import Target
        cfg = configs.random_config(args.random_config)
        tmp = tempfile.TemporaryDirectory(prefix="jspec-load-")
        path = os.path.join(tmp.name, "hf")
        save_hf(Target(cfg, init_params(cfg, jax.random.key(0))), path)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={data * model}")
    rows = []
    for mode in ("whole", "sharded"):
        out = subprocess.run([sys.executable, "-c", CHILD, path, mode, str(data), str(model)],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"# loading {path} onto a {data}x{model} mesh of CPU devices")
    print(common.format_table(rows, ["mode", "checkpoint MB", "device arrays MB", "peak anon MB",
                                     "host transient MB", "seconds"]))
    if tmp is not None:
        tmp.cleanup()
    if args.json:
        common.write_json(args.json, {"rows": rows})
    return {"rows": rows}


COMMAND = Command("load", "host memory of loading a checkpoint onto a mesh: whole then placed vs "
                          "slice-wise into the shardings", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
