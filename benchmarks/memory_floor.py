"""``python -m jspec.bench memory-floor``: how close plain decoding runs to this machine's memory
floor.

A plain decode step of a model far larger than the last-level cache streams every weight from
DRAM once, so its floor is ``weight bytes / DRAM read bandwidth``. This measures both sides:

* **DRAM read bandwidth**, STREAM-like: the sum of a buffer many times the L3 (default 1 GiB
  of float32), best of ``--repeats``, with numpy (one thread) and with XLA (``jnp.sum`` jitted,
  every core XLA:CPU uses). The larger is the floor's bandwidth.
* **Plain decoding's step time** at batch 1, for each ``--dtype``: two warm ``generate`` calls
  of different lengths, timed side by side (best of ``--repeats``), and the step is the slope
  ``(t_long - t_short) / (n_long - n_short)``, so prefill and the fixed costs drop out.
* **Bytes a step reads**: every parameter once (a tied embedding is read whole as the LM head
  and one row as the input, counted once) plus the KV cache at the mean position.

The report: bandwidth, bytes per token, the floor ``bytes / bandwidth``, the measured step and
the fraction ``floor / step`` (1.0 = at the floor).

Why bf16 weights decode slower than fp32 on XLA:CPU: its compiled product of an activation row
with a bf16 weight first converts the whole weight to an f32 copy (a ``convert`` fusion of the
``bf16[K, N]`` parameter) and then runs the f32 dot on the copy, so a weight costs 2 bytes read
+ 4 written + 4 read instead of 4 read. ``bf16_product`` shows it: the LM head's product in
both dtypes, its HLO checked for that convert and both timed side by side.
"""

from __future__ import annotations

import time

import numpy as np

from jspec.bench.registry import Command, run_module

MESSAGE = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def add_args(s) -> None:
    s.add_argument("--model", default="smollm2", help="a fetchable name or a path (default: smollm2)")
    s.add_argument("--dtype", action="append", default=None,
                   help="parameter dtypes to time (repeatable; default: float32 and bfloat16)")
    s.add_argument("--buffer-mib", type=int, default=1024, help="bandwidth buffer (default 1024)")
    s.add_argument("--short", type=int, default=32, help="new tokens of the short call")
    s.add_argument("--long", type=int, default=160, help="new tokens of the long call")
    s.add_argument("--repeats", type=int, default=5)


def read_bandwidth(mib: int, repeats: int) -> dict[str, float]:
    """Bytes per second read by a sum over ``mib`` MiB of float32: numpy and XLA, best of
    ``repeats`` each."""
    import jax
    import jax.numpy as jnp
    n = mib * 2**20 // 4
    host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dev = jax.device_put(host)
    xsum = jax.jit(jnp.sum)
    xsum(dev).block_until_ready()
    out = {}
    for name, fn in (("numpy (1 thread)", lambda: host.sum()),
                     ("XLA jnp.sum", lambda: xsum(dev).block_until_ready())):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = host.nbytes / best
    return out


def bf16_product(K: int, N: int, repeats: int) -> dict:
    """The ``[1, K] x [K, N]`` product with f32 and with bf16 operands (f32 accumulation, as the
    model runs it): best seconds of each (interleaved), and whether XLA converts the bf16
    weight to f32 before the dot."""
    import jax
    import jax.numpy as jnp
    w32 = jnp.asarray(np.random.default_rng(0).standard_normal((K, N), dtype=np.float32))
    f = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    args = {d: (jnp.ones((1, K), d), w32.astype(d)) for d in ("float32", "bfloat16")}
    best = {d: float("inf") for d in args}
    for d, a in args.items():
        f(*a).block_until_ready()
    for _ in range(repeats * 4):
        for d, a in args.items():
            t0 = time.perf_counter()
            f(*a).block_until_ready()
            best[d] = min(best[d], time.perf_counter() - t0)
    hlo = f.lower(*args["bfloat16"]).compile().as_text()
    converts = any(f"f32[{K},{N}]" in line and "convert(" in line for line in hlo.splitlines())
    return {"seconds": best, "converts_weight": converts}


def step_bytes(target, mean_pos: float) -> int:
    import jax
    cfg = target.config
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(target.params))
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * mean_pos   # fp32 cache
    return int(params + kv)


def step_time(target, ids, stop, short: int, long: int, repeats: int) -> float:
    """Seconds a plain step takes: the slope between two warm calls timed side by side."""
    import jspec
    from jspec.timing import round_robin, wall_s
    calls = [lambda n=n: jspec.generate(target, [ids], max_new_tokens=n, stop_ids=[])
             for n in (short, long)]
    ts, tl = round_robin(calls, repeats, seconds=wall_s)
    assert len(tl.result.tokens[0]) == long
    return (tl.best - ts.best) / (long - short)


def main(a) -> None:
    import jspec
    from jspec import messages
    from jspec.fetch import resolve_model
    bw = read_bandwidth(a.buffer_mib, a.repeats)
    floor_bw = max(bw.values())
    print(f"DRAM read bandwidth, a {a.buffer_mib} MiB buffer, best of {a.repeats}:")
    for k, v in bw.items():
        print(f"  {k:<18} {v / 1e9:6.2f} GB/s")
    cfg_k, cfg_n = 576, 49152          # SmolLM2's LM head; the point is the same for any weight
    prod = bf16_product(cfg_k, cfg_n, a.repeats)
    print(f"\n[1, {cfg_k}] x [{cfg_k}, {cfg_n}] product (an LM head), best of {a.repeats * 4}, "
          "interleaved:")
    for d, t in prod["seconds"].items():
        nbytes = cfg_k * cfg_n * (4 if d == "float32" else 2)
        print(f"  {d:<9} weights: {t * 1e3:6.2f} ms ({nbytes / t / 1e9:5.1f} GB/s of weights)")
    print(f"  XLA:CPU converts the bf16 weight to an f32 copy before the dot: "
          f"{'yes' if prod['converts_weight'] else 'no'}")
    path = resolve_model(a.model)
    rows = []
    for dtype in a.dtype or ["float32", "bfloat16"]:
        target = jspec.load_target(path, dtype=dtype)
        ids = messages.render(target, MESSAGE)
        step = step_time(target, ids, None, a.short, a.long, a.repeats)
        nbytes = step_bytes(target, len(ids) + (a.short + a.long) / 2)
        rows.append((dtype, nbytes, nbytes / floor_bw, step))
    print(f"\nplain decoding at batch 1 ({a.model}; step = slope between {a.short} and "
          f"{a.long} new tokens, best of {a.repeats}):")
    print(f"{'dtype':<10} {'MB/token':>9} {'floor ms':>9} {'step ms':>8} {'tok/s':>7} "
          f"{'floor/step':>10}")
    for dtype, nbytes, floor, step in rows:
        print(f"{dtype:<10} {nbytes / 1e6:9.1f} {floor * 1e3:9.2f} {step * 1e3:8.2f} "
              f"{1 / step:7.1f} {floor / step:10.2f}")


COMMAND = Command("memory-floor", "plain decoding's step against this machine's DRAM "
                  "bandwidth floor (bytes per token / read bandwidth), fp32 and bf16",
                  add_args, main, description=__doc__)

if __name__ == "__main__":
    run_module(COMMAND)
