"""``python -m jspec.bench prefill``: a long prompt's prefill, whole against chunked.

For each prompt length and prefill chunk (0: the whole prompt in one block), one fresh
process loads the target (``--model``, or random weights of ``--random-config``), compiles
the plain decoder's prefill for one prompt of that length through the plan seam (its KV
pool a donated argument, as the engine's insert holds it), and reports XLA's temporaries
for the program, the process's peak RSS and the prefill's tokens/s (best of ``--repeats``
warm runs, a fresh pool each, its allocation included). A process per variant keeps each
peak its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import jax
import numpy as np

from jspec.bench import common
from jspec.bench.configs import random_config
from jspec.bench.registry import Command, run_module
from jspec.timing import round_robin

COLUMNS = ["model", "prompt", "chunk", "compile s", "temp MB", "peak RSS MB", "prefill s",
           "tok/s"]


def load(args):
    import jspec
    if args.model:
        return jspec.load_target(args.model)
    cfg = random_config(args.random_config, args.dtype)
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, args.one + 16))
    return jspec.Target(cfg, common.random_params(cfg, 0))


def measure_one(args) -> dict:
    """The variant ``args.one`` tokens, ``args.chunk`` in this process."""
    import time

    from jspec import kv_cache as kvc
    from jspec.plan import KVConfig, plan

    target = load(args)
    c = target.config
    ids = np.random.default_rng(0).integers(3, c.vocab_size, args.one).tolist()
    p = plan(target, [ids], max_new_tokens=1,
             kv=KVConfig(prefill_chunk=args.chunk or args.one + 16), kernels="reference")
    dec = p.decoder
    params = target.serving_params
    prompt, lens, table = p.args[:3]

    # The KV pool is an argument, donated, as the engine's insert holds it: the temporaries
    # are then the prefill's own, not the pool it fills.
    new_cache = lambda: kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim, table.copy(),
                                       dec.num_pages, dec.page_size, c.dtype)
    t0 = time.perf_counter()
    compiled = jax.jit(dec.prefill, donate_argnums=(3,)).lower(
        params, prompt, lens, jax.eval_shape(new_cache)).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    timed = round_robin([lambda: jax.block_until_ready(compiled(params, prompt, lens,
                                                                new_cache()))], args.repeats)[0]
    return {"model": args.model or args.random_config, "prompt": args.one,
            "chunk": args.chunk or "whole", "compile s": compile_s,
            "temp MB": mem.temp_size_in_bytes / 2**20,
            "peak RSS MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "prefill s": timed.best, "tok/s": args.one / timed.best}


def run_variants(args) -> list[dict]:
    rows = []
    for n in args.lengths:
        for chunk in args.chunks:
            cmd = [sys.executable, "-m", "benchmarks.prefill", "--one", str(n), "--chunk",
                   str(chunk), "--repeats", str(args.repeats), "--dtype", args.dtype]
            cmd += ["--model", args.model] if args.model else ["--random-config",
                                                              args.random_config]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"  {n} tokens, chunk {chunk or 'whole'}: {rows[-1]['tok/s']:.0f} tok/s, "
                  f"{rows[-1]['temp MB']:.0f} MB temporaries", file=sys.stderr, flush=True)
    return rows


def add_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model", default=None, help="a target checkpoint (default: random weights)")
    s.add_argument("--random-config", default="100m")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    s.add_argument("--chunks", type=int, nargs="+", default=[0, 512],
                   help="prefill chunks to compare (0: the whole prompt in one block)")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--json", default=None)
    s.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    s.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)


def main(args) -> list[dict]:
    if args.one is not None:
        print(json.dumps(measure_one(args)))
        return []
    rows = run_variants(args)
    print()
    print(common.format_table(rows, COLUMNS))
    if args.json:
        common.write_json(args.json, rows)
    return rows


COMMAND = Command("prefill", "a long prompt's prefill, whole vs chunked: temporaries, peak RSS, "
                  "tokens/s", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
