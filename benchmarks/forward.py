"""``python -m jspec.bench forward``: cost of a 1-token decode step vs a ``block``-token
forward (causal block) against a ``context``-token KV cache.

Both are one jitted ``Llama.apply`` on a paged cache whose ``lengths`` = ``context`` (random
KV contents: only the timing matters), writing the new block's KV and projecting logits for
every one of the T positions, as speculative verification must. The cache is donated and
threaded back in, as the decode loop does, so no call pays for a cache copy.

The ratio ``block ms / decode ms`` bounds speculative decoding on this machine: a
verification step of ``block`` tokens costs that many decode steps, so even with every
draft accepted and a free drafter the speed-up is at most ``block / ratio``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench import common
from jspec.bench.configs import random_config
from jspec.bench.registry import Command, run_module
from jspec.config import LlamaConfig
from jspec.serving_layout import pack_for_serving
from jspec.timing import own_seconds, round_robin

COLUMNS = ["forward", "batch", "context", "tokens", "compile s", "ms", "ms/token", "x decode"]


def _prepare(cfg: LlamaConfig, params, batch: int, context: int, tokens: int, block: int,
             page_size: int, seed: int) -> dict:
    """Compile one forward of ``tokens`` new tokens per row; the cache is sized for ``block``
    new tokens either way, so every variant reads the same addressable KV."""
    fn = common.step_fn(cfg)
    cache = common.make_cache(cfg, batch, context, block, page_size, seed)
    rng = np.random.default_rng(seed)
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, tokens)), jnp.int32)
    pos = jnp.asarray(context + np.arange(tokens)[None].repeat(batch, 0), jnp.int32)
    t0 = time.perf_counter()
    compiled = fn.lower(params, tok, pos, cache).compile()
    return {"compiled": compiled, "tok": tok, "pos": pos, "cache": cache,
            "compile s": time.perf_counter() - t0, "times": [], "tokens": tokens}


def run_forward(cfg: LlamaConfig, params=None, context: int = 1024, block: int = 8,
                batch: int = 1, repeats: int = 20, page_size: int = 16, seed: int = 0) -> list[dict]:
    """Rows ``decode`` (1 token) and ``block`` (``block`` tokens); ``x decode`` is the ratio
    of each row's median time to the decode step's. The two are timed alternately, call by
    call, so background load on the machine affects both alike."""
    if params is None:
        params = common.random_params(cfg, seed)
    params = pack_for_serving(cfg, params)
    variants = [_prepare(cfg, params, batch, context, t, block, page_size, seed) for t in (1, block)]
    timed = round_robin([functools.partial(common.timed_call, v, params) for v in variants], repeats,
                        warmup=2, seconds=own_seconds)
    for v, t in zip(variants, timed):
        v["times"] = t.times
    rows = []
    for v, name in zip(variants, ("decode", f"block of {block}")):
        assert v["logits_shape"] == (batch, v["tokens"], cfg.vocab_size)
        ms = 1000.0 * statistics.median(v["times"])
        rows.append({"forward": name, "batch": batch, "context": context, "tokens": v["tokens"],
                     "compile s": v["compile s"], "ms": ms, "ms/token": ms / v["tokens"],
                     "ms min": 1000.0 * min(v["times"])})
    for r in rows:
        r["x decode"] = r["ms"] / rows[0]["ms"]
    return rows


def add_args(s) -> None:
    common.add_common_args(s, [1], 20)
    s.add_argument("--context", type=int, default=1024)
    s.add_argument("--block", type=int, default=8)
    s.add_argument("--page-size", type=int, default=16)


def main(args) -> list[dict]:
    if args.random_config is None:
        args.random_config = "100m"
    cfg = random_config(args.random_config, args.dtype)
    params = common.random_params(cfg, args.seed)
    n = common.param_count(params)
    print(f"random config {args.random_config!r}: {n:,} parameters ({n / 1e6:.1f}M), "
          f"L={cfg.num_layers} H={cfg.hidden_size} I={cfg.intermediate_size} "
          f"heads={cfg.num_heads}/{cfg.num_kv_heads} head_dim={cfg.head_dim} V={cfg.vocab_size} "
          f"tied={cfg.tie_word_embeddings} rope={cfg.rope.rope_type} dtype={cfg.dtype}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs, "
          f"load avg {common.load_avg()})")
    rows = run_forward(cfg, params, args.context, args.block, args.batch[0], args.repeats,
                       args.page_size, args.seed)
    print()
    print(common.format_table(rows, COLUMNS))
    r = rows[1]["x decode"]
    print(f"\n(median of {args.repeats} calls; logits for every position; reference attention.)"
          f"\nA forward of {args.block} tokens costs {r:.2f} decode steps: speculative decoding "
          f"verifying {args.block} tokens at a time can gain at most {args.block / r:.2f}x here "
          f"(every draft accepted, free drafter).")
    if args.json:
        common.write_json(args.json, {"benchmark": "forward", "config": args.random_config,
                                      "params": n, "columns": COLUMNS, "rows": rows})
    return rows


COMMAND = Command("forward", "1-token decode step vs a block forward on a long cache", add_args,
                  main)

if __name__ == "__main__":
    run_module(COMMAND)
