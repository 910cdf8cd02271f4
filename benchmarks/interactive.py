"""``python -m jspec.bench interactive``: how often a notebook user's ``generate`` calls
compile, with bucketed shapes (:mod:`jspec.shape_buckets`, the default) against exact shapes
(``exact_shapes=True``, what every call did before), and jax's persistent cache
(:mod:`jspec.compile_cache`) cold and warm. On the shipped default model; each part runs in
fresh processes, one after another.

1. **Seven calls** (a first call, a longer prompt, a shorter one, ``max_new_tokens`` 65 and
   100, 2 and 3 prompts): each call's wall time and the traces so far, exact shapes without
   the persistent cache (before), bucketed with an empty cache (cold), and bucketed again in
   a second process (the cache warm).
2. **A notebook session**: ``--calls`` calls with random prompt lengths (1-400 tokens a row),
   batch sizes (1-8), ``max_new_tokens`` (1-512) and sampling settings (half greedy), half
   with the shipped EAGLE-3 head; compiles against the buckets touched, total wall time
   bucketed against exact, and whether every call's tokens are the same both ways (greedy
   and seeded sampling alike).
3. **Padding's price**, warm, best of ``--repeats`` round-robin in one process: batch 3
   padded to 4 against exact, and a 300-slot KV padded to its bucket (512) against exact.
4. **Time to first token** of ``python -m jspec generate`` in a fresh process (process start
   to its one new token), the cache cold and then warm.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jspec.bench.registry import Command, run_module

SEVEN = [(["import os"], 64), (["import os, sys, json, time, random, math, re"], 64),
         (["import re"], 64), (["import os"], 65), (["import os"], 100),
         (["import os", "def main():"], 64), (["import os", "def main():", "class A:"], 64)]


def add_args(p):
    p.add_argument("--calls", type=int, default=30, help="notebook session: calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="padding: timed calls per shape")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", choices=["seven", "notebook", "padding"], help=None)
    p.add_argument("--exact", action="store_true", help=None)
    p.add_argument("--out", help=None)


# ----------------------------------------------------------------------------- children
def _load():
    import jspec
    from jspec.shipped import default_model
    return jspec.load_target(default_model())


def _traces() -> int:
    from jspec.decode import TRACE_COUNTS
    return sum(TRACE_COUNTS.values())


def child_seven(a) -> dict:
    import jspec
    target = _load()
    rows = []
    for prompts, n in SEVEN:
        t0 = time.perf_counter()
        r = jspec.generate(target, prompts, max_new_tokens=n, exact_shapes=a.exact)
        rows.append({"wall_s": time.perf_counter() - t0, "traces": _traces(),
                     "tokens": r.tokens})
    return {"calls": rows}


def session(calls: int, seed: int, vocab: int) -> list[dict]:
    """The notebook session's calls (plain data: the same in both children)."""
    rng = random.Random(seed)
    out = []
    for _ in range(calls):
        B = rng.randint(1, 8)
        sampled = rng.random() < 0.5
        kw = {"max_new_tokens": rng.randint(1, 512), "seed": rng.randrange(1 << 16)}
        if sampled:
            kw.update(temperature=rng.choice([0.6, 0.8, 1.0]), top_k=rng.choice([0, 20, 50]),
                      top_p=rng.choice([1.0, 0.9]))
        out.append({"prompts": [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 400))]
                                for _ in range(B)],
                    "eagle3": rng.random() < 0.5, "kw": kw})
    return out


def _bucket(call: dict, overshoot: int) -> tuple:
    """The program a bucketed call runs (jspec.shape_buckets), as the test counts them."""
    from jspec import shape_buckets as b
    T = b.prompt(max(map(len, call["prompts"])), 16)
    kv = b.kv(T + max(1, call["kw"]["max_new_tokens"]) + overshoot)
    return (call["eagle3"], "temperature" in call["kw"], b.rows(len(call["prompts"])), T, kv)


def child_notebook(a) -> dict:
    import jspec
    from jspec.drafters import load_drafter
    from jspec.plan import resolve_drafting
    from jspec.shipped import default_model, shipped_drafters
    target = _load()
    drafter = load_drafter(shipped_drafters(default_model())["eagle3"], target.config)
    overshoot = resolve_drafting(target, drafter, None, 1, 0.0).overshoot
    calls = session(a.calls, a.seed, target.config.vocab_size)
    rows, t_all = [], time.perf_counter()
    for c in calls:
        t0, n0 = time.perf_counter(), _traces()
        r = jspec.generate(target, c["prompts"], drafter=drafter if c["eagle3"] else None,
                           stop_ids=[], exact_shapes=a.exact, **c["kw"])
        rows.append({"wall_s": time.perf_counter() - t0, "compiled": _traces() - n0,
                     "tokens": r.tokens,
                     "bucket": _bucket(c, overshoot if c["eagle3"] else 0)})
    return {"calls": rows, "wall_s": time.perf_counter() - t_all, "traces": _traces()}


def child_padding(a) -> dict:
    import jspec
    from jspec.timing import round_robin
    target = _load()
    ids = target.tokenizer.encode("import os\nimport sys\n" * 3)[:44]
    cases = {"batch 3 (padded to 4)": ([ids] * 3, 64, False),
             "batch 3 (exact)": ([ids] * 3, 64, True),
             "KV 300 (padded to 512)": ([ids], 252, False),
             "KV 300 (exact)": ([ids], 252, True)}
    calls = {k: (lambda p=p, n=n, e=e: jspec.generate(target, p, max_new_tokens=n, stop_ids=[],
                                                       exact_shapes=e))
             for k, (p, n, e) in cases.items()}
    timed = round_robin(calls, a.repeats)          # the warm-up round compiles
    return {k: {"wall_s": t.best, "tokens": sum(map(len, t.result.tokens))}
            for k, t in timed.items()}


# ----------------------------------------------------------------------------- parent
def _run_child(part: str, a, env: dict, exact: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        cmd = [sys.executable, "-m", "jspec.bench", "interactive", "--child", part,
               "--out", str(out), "--calls", str(a.calls), "--seed", str(a.seed),
               "--repeats", str(a.repeats)] + (["--exact"] if exact else [])
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def _env(cache: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    if cache is None:
        env["JSPEC_COMPILE_CACHE"] = "0"
    else:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
    return env


def ttft(env: dict) -> float:
    from jspec.shipped import default_model
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jspec", "generate", "--model", str(default_model()),
                    "--prompt",
                    "import os", "--max-new-tokens", "1", "--no-stream"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(a) -> int:
    if a.child:
        res = {"seven": child_seven, "notebook": child_notebook,
               "padding": child_padding}[a.child](a)
        Path(a.out).write_text(json.dumps(res))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        before = _run_child("seven", a, _env(None), exact=True)
        cold = _run_child("seven", a, _env(cache))
        warm = _run_child("seven", a, _env(cache))
    results["seven"] = {"before": before, "cold": cold, "warm": warm}
    print("\n1. seven calls, one fresh process each column (wall s / traces so far)")
    print(f"{'call':<44} {'before (exact)':>15} {'bucketed, cold':>15} {'cache warm':>11}")
    for (prompts, n), b, c, w in zip(SEVEN, before["calls"], cold["calls"], warm["calls"]):
        name = f"{len(prompts)} x {prompts[-1][:18]!r}, {n} new"
        print(f"{name:<44} {b['wall_s']:9.2f} / {b['traces']:<3} {c['wall_s']:9.2f} / "
              f"{c['traces']:<3} {w['wall_s']:6.2f} / {w['traces']}")
    same = all(b["tokens"] == c["tokens"] == w["tokens"]
               for b, c, w in zip(before["calls"], cold["calls"], warm["calls"]))
    print(f"tokens equal in all three: {'yes' if same else 'NO'}")

    nb_exact = _run_child("notebook", a, _env(None), exact=True)
    nb = _run_child("notebook", a, _env(None))
    results["notebook"] = {"exact": nb_exact, "bucketed": nb}
    buckets = {tuple(c["bucket"]) for c in nb["calls"]}
    same = [x["tokens"] == y["tokens"] for x, y in zip(nb_exact["calls"], nb["calls"])]
    print(f"\n2. a notebook session: {a.calls} calls (prompts 1-400 tokens, batch 1-8, "
          f"max_new_tokens 1-512, half sampled, half EAGLE-3), no persistent cache")
    print(f"{'':<24} {'compiles':>8} {'wall s':>8}")
    print(f"{'exact shapes (before)':<24} {nb_exact['traces']:>8} {nb_exact['wall_s']:8.1f}")
    print(f"{'bucketed':<24} {nb['traces']:>8} {nb['wall_s']:8.1f}   "
          f"({len(buckets)} buckets touched)")
    print(f"tokens equal call by call: {sum(same)}/{len(same)}")
    sys.stdout.flush()

    pad = _run_child("padding", a, _env(None))
    results["padding"] = pad
    print(f"\n3. padding's price (warm, best of {a.repeats}, one process)")
    print(f"{'shape':<26} {'wall ms':>8} {'tok/s':>8}")
    for k, v in pad.items():
        print(f"{k:<26} {v['wall_s'] * 1e3:8.1f} {v['tokens'] / v['wall_s']:8.0f}")

    with tempfile.TemporaryDirectory() as cache:
        cold_s, warm_s = ttft(_env(cache)), ttft(_env(cache))
    results["ttft"] = {"cold_s": cold_s, "warm_s": warm_s}
    print("\n4. python -m jspec generate (the default model, 1 new token), a fresh process")
    print(f"cache cold {cold_s:.2f} s, cache warm {warm_s:.2f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


COMMAND = Command("interactive", "notebook-style generate calls: compiles and wall time, "
                  "bucketed vs exact shapes, the persistent cache cold and warm, padding's "
                  "price, time to first token", add_args, main, description=__doc__)

if __name__ == "__main__":
    run_module(COMMAND)
