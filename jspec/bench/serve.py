"""``python -m jspec.bench serve``: a stream of requests with skewed lengths, served today's
way (``generate`` on batches of B in input order) and by the engine (B slots refilled as
rows finish), plain and with a drafter at a fixed spec and with the per-occupancy pick; then
(``--sweep``) the engine's tokens/s with every slot full at several slot counts.

Every method runs in the same process, warm: today's way runs its batches twice and times
the second pass (each batch has its own static shapes, so the first pass compiles); the
engine compiles its programs first (:meth:`jspec.engine.Engine.warm`). Latency is from the start of
the method's run to the request's last token (today's way: the end of its batch, which is
also when its first token is seen); first token is when the request's first delta arrives.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from jspec.bench.registry import Command
from jspec.engine import Engine, Request
from jspec.engine.policy import mode_label, parse_mode
from jspec.engine.tuning import MIN_PROMPTS, full_rounds, timed_rounds


def add_args(s) -> None:
    s.add_argument("--model", default=None, help="default: the shipped default model")
    s.add_argument("--drafter", default=None, help="default: the model's shipped EAGLE-3")
    s.add_argument("--prompts", default=None, help="text prompts, one per line (default: the "
                   "shipped held-out prompts)")
    s.add_argument("--requests", type=int, default=256)
    s.add_argument("--min-new", type=int, default=8)
    s.add_argument("--max-new", type=int, default=512)
    s.add_argument("--slots", type=int, default=8)
    s.add_argument("--spec", default="default", help="the fixed mode: default or S,K,N[/cal]")
    s.add_argument("--chunk", type=int, default=8)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--order", choices=["longest", "arrival"], default="longest",
                   help="the engine's admission order (default: longest first)")
    s.add_argument("--skip-today", action="store_true", help="engine rows only")
    s.add_argument("--sweep-only", action="store_true", help="only the --sweep table")
    s.add_argument("--sweep", type=int, nargs="*", default=None, metavar="B",
                   help="also: tokens/s with B full slots (e.g. 1 4 8 16 32)")
    s.add_argument("--sweep-new", type=int, default=64)
    s.add_argument("--sweep-repeats", type=int, default=7, help="timed passes, the engines "
                   "taking turns round by round: tokens/s from the best pass, ratios the "
                   "median of the ratios within a pass")
    s.add_argument("--json", metavar="OUT")


def workload(prompts, n: int, lo: int, hi: int, seed: int) -> list[tuple[str, int]]:
    """``n`` (prompt, max_new_tokens): prompts drawn with replacement, limits log-uniform."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(prompts), n)
    new = np.exp(rng.uniform(math.log(lo), math.log(hi), n)).round().astype(int)
    return [(prompts[i], int(m)) for i, m in zip(idx, new)]


def _summary(name, tokens, wall, lat, first) -> dict:
    return {"method": name, "tokens": int(tokens), "wall_s": wall, "tok_s": tokens / wall,
            "p50_s": float(np.percentile(lat, 50)), "p99_s": float(np.percentile(lat, 99)),
            "ttft_p50_s": float(np.percentile(first, 50)),
            "ttft_p99_s": float(np.percentile(first, 99))}


def today(target, drafter, spec, work, B) -> dict:
    """``generate`` on consecutive batches of B, as a user without the engine would."""
    import jspec
    kw = {} if drafter is None else {"drafter": drafter, "spec": spec}
    batches = [work[i:i + B] for i in range(0, len(work), B)]
    for timed in (False, True):
        t0, lat, tokens = time.perf_counter(), [], 0
        for batch in batches:
            res = jspec.generate(target, [p for p, _ in batch],
                                 max_new_tokens=[m for _, m in batch], slots=len(batch), **kw)
            tokens += sum(map(len, res.tokens))
            lat += [time.perf_counter() - t0] * len(batch)
        wall = time.perf_counter() - t0
    return tokens, wall, lat, lat


def fresh():
    """Drop compiled programs between methods: one process holding every program of every
    method ran out of executable memory (LLVM) after today's way's per-batch programs."""
    import gc

    import jax
    jax.clear_caches()
    gc.collect()


def engine(target, drafter, work, B, chunk, order="longest", **kw):
    longest = max(len(target.tokenizer.encode(p)) for p, _ in work)
    eng = Engine(target, drafter, slots=B, max_new_tokens=max(m for _, m in work), chunk=chunk,
                 longest_prompt=longest, **kw)
    eng.warm(longest)
    t0 = time.perf_counter()
    done = eng.generate([Request(p, m) for p, m in work], order=order)
    wall = time.perf_counter() - t0
    return (sum(len(c.tokens) for c in done), wall, [c.stats["latency_s"] for c in done],
            [c.stats["first_token_s"] or c.stats["latency_s"] for c in done], eng)


def sweep(target, drafter, prompts, slot_counts, new, chunk, fixed, cap,
          repeats=7) -> list[dict]:
    """Tokens/s with every slot full (no stop ids: each request runs ``new`` tokens), plain,
    the fixed spec and the stored pick, the engines taking turns round by round
    (:func:`jspec.engine.tuning.timed_rounds`) over ``repeats`` passes of at least four rounds
    (:func:`jspec.engine.tuning.full_rounds`); engines sized for ``cap`` new tokens a
    request, as in the stream above. Tokens/s: the best pass. The ratios: the median over
    the passes of the ratio within one pass. This VM's speed moves by 10% within seconds:
    with whole passes in turn, the pick and the fixed spec, the same program at one slot,
    measured 0.953-1.035 apart across three sweeps of 5-7 passes."""
    rows = []
    longest = max(len(target.tokenizer.encode(p)) for p in prompts)
    for B in slot_counts:
        kw = dict(slots=B, max_new_tokens=cap, chunk=chunk, longest_prompt=longest)
        engines = {"plain": Engine(target, None, **kw),
                   "fixed": Engine(target, drafter, spec=fixed, **kw),
                   "pick": Engine(target, drafter, policy="auto", **kw)}
        for e in engines.values():
            e.warm(longest, buckets=[B])            # every slot full: only bucket B runs
        rounds = full_rounds(prompts, B, new, max(MIN_PROMPTS, 2 * B), min_rounds=4)
        t = timed_rounds(engines, rounds, repeats)
        pick_mode = mode_label(engines["pick"].policy[B])
        del engines
        fresh()
        # Every engine makes the same tokens (no stops), so a ratio of rates is one of times.
        paired = lambda num, den: statistics.median(
            min(t[k].times[i] for k in den) / t[num].times[i] for i in range(repeats))
        rows.append({"slots": B, **{f"{k}_tok_s": sum(v.result) / v.best for k, v in t.items()},
                     "pick_mode": pick_mode,
                     "pick_vs_best": paired("pick", ("plain", "fixed")),
                     "fixed_vs_plain": paired("fixed", ("plain",)),
                     "pick_vs_plain": paired("pick", ("plain",))})
    return rows


def stream_rows(target, drafter, work, args, fixed) -> list[dict]:
    """The stream served each way: today's way (unless ``--skip-today``), then the engine."""
    B, rows = args.slots, []

    def add(name, out):
        fresh()
        rows.append(_summary(name, *out[:4]))
        print(f"  {name}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)

    if not args.skip_today:
        add("today: generate in batches, plain", today(target, None, None, work, B))
        add(f"today: generate in batches, {drafter.kind} {args.spec}",
            today(target, drafter, fixed, work, B))
    add("engine, plain", engine(target, None, work, B, args.chunk, args.order))
    add(f"engine, {drafter.kind} {args.spec}", engine(target, drafter, work, B, args.chunk,
                                                       args.order, spec=fixed))
    out = engine(target, drafter, work, B, args.chunk, args.order, policy="auto")
    add(f"engine, {drafter.kind} pick per occupancy", out)
    print(f"  pick: {out[4].policy.describe()}\n")
    print(f"{'method':<44} {'tokens':>7} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} "
          f"{'TTFT p50':>9} {'TTFT p99':>9}")
    for r in rows:
        print(f"{r['method']:<44} {r['tokens']:>7} {r['tok_s']:>8.1f} {r['p50_s']:>7.2f} "
              f"{r['p99_s']:>7.2f} {r['ttft_p50_s']:>9.2f} {r['ttft_p99_s']:>9.2f}")
    return rows


def main(args) -> dict:
    import jspec
    from jspec.shipped import default_model
    from jspec.drafters import load_drafter

    model = Path(args.model) if args.model else default_model()
    target = jspec.load_target(model)
    dpath = args.drafter or str(model.parent / "drafters" / "eagle3")
    drafter = load_drafter(dpath, target.config)
    ppath = args.prompts or str(model.parent / "drafters" / "heldout_prompts.txt")
    prompts = [x for x in Path(ppath).read_text().splitlines() if x.strip()]
    fixed = parse_mode(args.spec)
    result = {"workload": {"requests": args.requests, "slots": args.slots, "seed": args.seed}}
    if not args.sweep_only:
        work = workload(prompts, args.requests, args.min_new, args.max_new, args.seed)
        print(f"{len(work)} requests, max_new_tokens log-uniform in [{args.min_new}, "
              f"{args.max_new}] ({sum(m for _, m in work)} at most), {args.slots} slots",
              flush=True)
        result["rows"] = stream_rows(target, drafter, work, args, fixed)
    if args.sweep:
        print()
        result["sweep"] = sw = sweep(target, drafter, prompts, args.sweep, args.sweep_new,
                                     args.chunk, fixed, args.max_new, args.sweep_repeats)
        print(f"{'slots':>5} {'plain':>8} {'fixed':>8} {'pick':>8} {'pick mode':>10} "
              f"{'pick/best':>9} {'pick/plain':>10}")
        for r in sw:
            print(f"{r['slots']:>5} {r['plain_tok_s']:>8.1f} {r['fixed_tok_s']:>8.1f} "
                  f"{r['pick_tok_s']:>8.1f} {r['pick_mode']:>10} {r['pick_vs_best']:>9.3f} "
                  f"{r['pick_vs_plain']:>10.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


COMMAND = Command("serve", "a skewed stream of requests: generate in batches vs the engine (plain, "
                           "fixed spec, pick per occupancy)", add_args, main)
