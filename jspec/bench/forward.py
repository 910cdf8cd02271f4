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

from jspec import kv_cache as kvc
from jspec.bench import common
from jspec.bench.configs import random_config
from jspec.config import LlamaConfig
from jspec.llama import forward, logits as lm_logits
from jspec.serving_layout import pack_for_serving, pack_params
from jspec.timing import own_seconds, round_robin

COLUMNS = ["forward", "batch", "context", "tokens", "compile s", "ms", "ms/token", "x decode"]


def _step_fn(cfg: LlamaConfig, block_mask=None):
    """A jitted target forward + logits over packed params (pass them packed: packing
    inside would copy the weights on every call)."""
    def step(params, tokens, positions, cache):
        params = pack_params(cfg, params)
        mask = None if block_mask is None else jnp.broadcast_to(
            block_mask, (tokens.shape[0],) + block_mask.shape[1:])
        hidden, _, cache = forward(cfg, params, tokens, positions, cache, block_mask=mask)
        return lm_logits(cfg, params, hidden), cache          # [B, T, V]
    return jax.jit(step, donate_argnums=(3,))


def make_cache(cfg: LlamaConfig, batch: int, context: int, block: int, page_size: int = 16,
               seed: int = 0) -> kvc.PagedKVCache:
    """A cache holding ``context`` committed positions per row (random contents) and room
    for ``block`` more."""
    max_len = context + block
    max_pages = kvc.pages_needed(max_len, page_size)
    num_pages = batch * max_pages
    table = kvc.allocate_page_table([max_len] * batch, page_size, num_pages, max_pages)
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, table, num_pages,
                           page_size, cfg.dtype)
    kk, kv = jax.random.split(jax.random.key(seed))
    shape, dt = cache.k_pages.shape, cache.k_pages.dtype
    return cache.replace(k_pages=jax.random.normal(kk, shape, dt),
                         v_pages=jax.random.normal(kv, shape, dt),
                         lengths=jnp.full((batch,), context, jnp.int32))


def _prepare(cfg: LlamaConfig, params, batch: int, context: int, tokens: int, block: int,
             page_size: int, seed: int) -> dict:
    """Compile one forward of ``tokens`` new tokens per row; the cache is sized for ``block``
    new tokens either way, so every variant reads the same addressable KV."""
    fn = _step_fn(cfg)
    cache = make_cache(cfg, batch, context, block, page_size, seed)
    rng = np.random.default_rng(seed)
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, tokens)), jnp.int32)
    pos = jnp.asarray(context + np.arange(tokens)[None].repeat(batch, 0), jnp.int32)
    t0 = time.perf_counter()
    compiled = fn.lower(params, tok, pos, cache).compile()
    return {"compiled": compiled, "tok": tok, "pos": pos, "cache": cache,
            "compile s": time.perf_counter() - t0, "times": [], "tokens": tokens}


def _call(v: dict, params) -> float:
    t0 = time.perf_counter()
    logits, v["cache"] = v["compiled"](params, v["tok"], v["pos"], v["cache"])
    jax.block_until_ready((logits, v["cache"]))
    v["logits_shape"] = logits.shape
    return time.perf_counter() - t0


def run_forward(cfg: LlamaConfig, params=None, context: int = 1024, block: int = 8,
                batch: int = 1, repeats: int = 20, page_size: int = 16, seed: int = 0) -> list[dict]:
    """Rows ``decode`` (1 token) and ``block`` (``block`` tokens); ``x decode`` is the ratio
    of each row's median time to the decode step's. The two are timed alternately, call by
    call, so background load on the machine affects both alike."""
    if params is None:
        params = common.random_params(cfg, seed)
    params = pack_for_serving(cfg, params)
    variants = [_prepare(cfg, params, batch, context, t, block, page_size, seed) for t in (1, block)]
    timed = round_robin([functools.partial(_call, v, params) for v in variants], repeats,
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


def main(args) -> list[dict]:
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
