"""``python -m jspec.bench long-run``: memory and compilation over long runs.

Two measurements, on the shipped default model (``checkpoints/default/target``) with its
EAGLE-3 drafter unless told otherwise. ``tests/bench/test_long_runs.py`` (slow) asserts their
properties; this prints them.

``long``   One ``generate`` call of about 16k new tokens. The default model has
           ``max_position_embeddings`` 2048 (and was trained on 256-token sequences), so one
           row cannot hold 16k positions; the call runs ``--rows`` rows (default 8), each up
           to that limit (prompt, new tokens and the speculative overshoot: 2010 new tokens a
           row with EAGLE-3's default tree, 16,080 in all), which needs about the KV pool of
           one 16k-position row. ``--new-tokens`` sets the per-row count (past the limit with
           a warning: RoPE needs no table, but the model never saw such positions).
           Warm-up: a short call of the same rows (``--short-tokens`` each: 4k tokens in all)
           compiles its program, and a call of the long shape compiles that one and stops
           each row at its first token (its stop id). Then the short call again and the long
           one, while a thread samples RSS every 50 ms. Flat means: nothing traces after the
           warm-up; RSS does not grow from a quarter of the way into the long call to its
           end (the loop allocates nothing per token); what the long call adds at its start,
           and its peak over the short call's, are at most its KV pool (the difference of the
           pools) times two (the compiled program returns its pools with the final state and
           holds a pool-sized loop buffer besides: XLA's memory analysis of the decoders),
           plus slack; RSS at the end is where the warm-up left it. Freed memory the
           allocator keeps can make the comparisons smaller, never larger.
``calls``  ``--calls`` (200) consecutive calls with varied prompts: lengths across
           ``--buckets`` prompt buckets, batch 1 and 2, stop ids, seeds, temperature 0 and
           ``--temperature``. The first calls cover every distinct static shape (the warm-up);
           after them no call may trace again. RSS at start, after warm-up and at end; every
           ``--check-every``-th greedy call is rerun with plain decoding and compared.

Wall times are printed, never asserted.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from pathlib import Path

import jax
import numpy as np

from jspec import decode, kv_cache as kvc
from jspec.bench import common
from jspec.bench.registry import Command, run_module
from jspec.generate import generate
from jspec.spec_config import SpecConfig
from jspec.spec_decode import tree_shape

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "default"
DEFAULT_TARGET = str(SHIPPED / "target")
DEFAULT_DRAFTER = str(SHIPPED / "drafters" / "eagle3")
DEFAULT_PROMPTS = str(SHIPPED / "drafters" / "heldout_prompts.txt")
MB = 1 << 20


# --------------------------------------------------------------------------- memory
def rss_bytes() -> int:
    """Resident set size of this process: psutil, else /proc/self/statm, else the peak
    (``ru_maxrss``, the only figure some systems give)."""
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssSampler:
    """Samples RSS on a thread while the ``with`` block runs (a compiled loop releases the
    GIL, so the thread sees the program's own allocations as they happen)."""

    def __init__(self, every_s: float = 0.05):
        self.every_s = every_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(rss_bytes())
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max(self.samples)

    def growth_after(self, fraction: float) -> int:
        """How far RSS rose above the sample ``fraction`` of the way through, later on (a
        call freeing its buffers as it ends only lowers it)."""
        i = int(fraction * (len(self.samples) - 1))
        return max(self.samples[i:]) - self.samples[i]

    def timeline(self, points: int = 11) -> list[float]:
        """MB at evenly spaced samples, first to last."""
        idx = np.linspace(0, len(self.samples) - 1, points).round().astype(int)
        return [self.samples[i] / MB for i in idx]


def kv_bytes_per_slot(target, drafter) -> int:
    """KV bytes one position takes in every pool of a call (the target's and the drafter's),
    from the shapes the decoders allocate for a one-page pool (nothing is allocated)."""
    def pool(pages):
        table = np.arange(pages, dtype=np.int32)[None]
        c = target.config
        shapes = [jax.eval_shape(lambda: kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim,
                                                        table, pages, 1, c.dtype))]
        if drafter is not None:
            shapes.append(jax.eval_shape(lambda: drafter.module.init_state(1, table, pages, 1)))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    return pool(2) - pool(1)


# --------------------------------------------------------------------------- inputs
def overshoot(drafter, spec: SpecConfig | None) -> int:
    """KV slots ``generate`` keeps past a row's last new token (speculative writes)."""
    if drafter is None:
        return 0
    spec = spec if spec is not None else drafter.default_spec
    S, N = tree_shape(drafter.module, spec)
    return max(N, drafter.module.cache_slots(spec)) + S + 1


def corpus_ids(target, path: str = DEFAULT_PROMPTS) -> list[int]:
    """The prompt file's text as token ids (no BOS): windows of it make varied prompts."""
    with open(path) as f:
        return target.tokenizer.encode(f.read())[1:]


def text_prompts(target, rows: int, path: str = DEFAULT_PROMPTS) -> list[list[int]]:
    with open(path) as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    return [target.tokenizer.encode(lines[r % len(lines)]) for r in range(rows)]


def load_default(target_path: str = DEFAULT_TARGET, drafter_path: str | None = DEFAULT_DRAFTER):
    from jspec.checkpoint import load_target
    from jspec.drafters import load_drafter
    target = load_target(target_path)
    return target, (load_drafter(drafter_path, target) if drafter_path else None)


# --------------------------------------------------------------------------- long
def _slots(n: int, page_size: int = 16) -> int:
    return kvc.pages_needed(n, page_size) * page_size


def row_budget(limit: int, T: int, extra: int, new_tokens: int | None) -> tuple[int, int]:
    """``(new tokens a row, max_len)`` for a padded prompt of ``T`` and ``extra`` overshoot
    slots: by default as many as the ``limit`` positions hold (``max_len`` = the limit)."""
    fits = limit - T - extra
    if new_tokens is None:
        return fits, limit
    if new_tokens > fits:
        warnings.warn(f"{new_tokens} new tokens a row reach past the model's "
                      f"max_position_embeddings={limit} (at most {fits} fit)")
        return new_tokens, T + new_tokens + extra
    return new_tokens, limit


def long_generation(target, drafter, prompts, new_tokens: int | None = None,
                    short_tokens: int = 512, spec: SpecConfig | None = None) -> dict:
    """The ``long`` measurement (see the module docstring); returns its figures."""
    T = -(-max(map(len, prompts)) // 16) * 16
    limit = target.config.max_position_embeddings
    extra = overshoot(drafter, spec)
    new_tokens, max_len = row_budget(limit, T, extra, new_tokens)
    short_kw = dict(drafter=drafter, spec=spec, max_new_tokens=short_tokens)
    long_kw = dict(drafter=drafter, spec=spec, max_new_tokens=new_tokens, max_len=max_len)
    trace0 = sum(decode.TRACE_COUNTS.values())
    rss = {"start": rss_bytes()}
    # Warm-up: compile both programs. The long one's rows stop at their first token (greedy:
    # the short call's), so its warm-up costs one token a row.
    firsts = [[t[0]] for t in generate(target, prompts, stop_ids=[], **short_kw).tokens]
    warm = generate(target, prompts, stop_ids=firsts, **long_kw)
    rss["after_warmup"] = rss_bytes()
    trace1 = sum(decode.TRACE_COUNTS.values())
    # The short call first: memory it frees cannot then hide the long call's own growth.
    with RssSampler() as short_mem:
        short = generate(target, prompts, stop_ids=[], **short_kw)
    with RssSampler() as mem:
        res = generate(target, prompts, stop_ids=[], **long_kw)
    rss["end"] = rss_bytes()
    per_row = kv_bytes_per_slot(target, drafter) * len(prompts)
    kv_long, kv_short = per_row * _slots(max_len), per_row * _slots(T + short_tokens + extra)
    return {
        "rows": len(prompts), "new_tokens_per_row": new_tokens, "position_limit": limit,
        "max_len": max_len, "tokens": sum(map(len, res.tokens)),
        "short_tokens": sum(map(len, short.tokens)), "warmup_tokens": sum(map(len, warm.tokens)),
        "stop_reasons": sorted({s["stop_reason"] for s in res.stats}),
        "wall_s": res.wall_s, "tokens_per_s": res.tokens_per_s, "accept_len": _mean_accept(res),
        "compiles": trace1 - trace0,
        "compiles_after_warmup": sum(decode.TRACE_COUNTS.values()) - trace1,
        "rss_start_mb": rss["start"] / MB, "rss_after_warmup_mb": rss["after_warmup"] / MB,
        "rss_end_mb": rss["end"] / MB, "rss_peak_short_mb": short_mem.peak / MB,
        "rss_peak_mb": mem.peak / MB, "rss_rise_in_call_mb": (mem.peak - mem.samples[0]) / MB,
        "rss_growth_in_call_mb": mem.growth_after(0.25) / MB, "rss_timeline_mb": mem.timeline(),
        "rss_peak_long_minus_short_mb": (mem.peak - short_mem.peak) / MB,
        "kv_pool_mb": kv_long / MB, "kv_long_minus_short_mb": (kv_long - kv_short) / MB,
        "short_is_prefix": all(a == b[:len(a)] for a, b in zip(short.tokens, res.tokens)),
    }


def _mean_accept(res) -> float | None:
    hists = [s["accept_hist"] for s in res.stats if "accept_hist" in s]
    if not hists:
        return None
    h = np.sum(hists, 0)
    return float((h * np.arange(len(h))).sum() / max(1, h.sum()))


# --------------------------------------------------------------------------- calls
@dataclasses.dataclass(frozen=True)
class Call:
    prompts: tuple[tuple[int, ...], ...]
    limits: tuple[int, ...]
    stop_ids: tuple[int, ...]
    temperature: float
    seed: int

    def request(self) -> dict:
        """``generate``'s arguments for this call, less sampling and drafter."""
        return dict(prompts=[list(p) for p in self.prompts], max_new_tokens=list(self.limits),
                    stop_ids=list(self.stop_ids))

    def shape(self, bucket: int = 16) -> tuple:
        """What ``generate`` compiles for: batch, prompt bucket, greedy or not (the new
        token count is fixed across calls)."""
        return len(self.prompts), -(-max(map(len, self.prompts)) // bucket), self.temperature > 0


def call_schedule(ids: list[int], vocab: int, eos: int, calls: int = 200, max_new: int = 32,
                  buckets: int = 2, temperature: float = 0.8, seed: int = 0) -> list[Call]:
    """``calls`` varied requests, the first of each distinct shape first (the warm-up)."""
    rng = np.random.default_rng(seed)

    def one(batch, bucket, sampled):
        lens = rng.integers(16 * bucket - 15, 16 * bucket + 1, size=batch)
        starts = rng.integers(0, len(ids) - 16 * bucket, size=batch)
        prompts = tuple(tuple([0] + ids[s:s + n - 1]) for s, n in zip(starts, lens))
        limits = tuple(int(x) for x in [max_new] + list(rng.integers(1, max_new + 1, batch - 1)))
        stop = [(), (eos,), (int(rng.integers(3, vocab)),),
                (eos, int(rng.integers(3, vocab)))][rng.integers(4)]
        return Call(prompts, limits, stop, temperature if sampled else 0.0,
                    int(rng.integers(1 << 30)))

    shapes = [(b, k, s) for b in (1, 2) for k in range(1, buckets + 1) for s in (False, True)]
    first = [one(*sh) for sh in shapes]
    rest = [one(*shapes[rng.integers(len(shapes))]) for _ in range(calls - len(first))]
    return first + rest


def _valid(tokens, limits, vocab: int) -> bool:
    return all(len(t) <= n and all(0 <= x < vocab for x in t) for t, n in zip(tokens, limits))


def many_calls(target, drafter, schedule: list[Call], check_every: int = 10,
               spec: SpecConfig | None = None, top_p: float = 0.95) -> dict:
    """The ``calls`` measurement: run ``schedule`` in order; returns its figures and the
    problems found (``retraced``: calls that traced again; ``mismatches``: greedy calls
    that differ from plain decoding; ``invalid``: sampled ids outside the vocabulary or
    rows longer than their limit)."""
    seen, retraced, invalid, greedy, compiles, tokens = set(), [], [], [], 0, 0
    warmup = len({c.shape() for c in schedule})
    rss = {"start": rss_bytes()}
    t0 = time.perf_counter()
    for i, c in enumerate(schedule):
        before = decode.TRACE_COUNTS["spec"]
        res = generate(target, **c.request(), temperature=c.temperature, top_p=top_p, seed=c.seed,
                   drafter=drafter, spec=spec)
        traced = decode.TRACE_COUNTS["spec"] - before
        compiles += traced
        if traced != (0 if c.shape() in seen else 1):
            retraced.append(i)
        seen.add(c.shape())
        if not _valid(res.tokens, c.limits, target.config.vocab_size):
            invalid.append(i)
        if c.temperature == 0:
            greedy.append((i, c, res.tokens))
        tokens += sum(map(len, res.tokens))
        if i + 1 == warmup:
            rss["after_warmup"] = rss_bytes()
            t_warm = time.perf_counter()
    t_end = time.perf_counter()
    rss["end"] = rss_bytes()
    checked = greedy[::check_every]
    mismatches = [i for i, c, toks in checked if toks != generate(target, **c.request()).tokens]
    return {
        "calls": len(schedule), "distinct_shapes": len(seen), "compiles": compiles,
        "retraced": retraced, "invalid": invalid, "greedy_calls": len(greedy),
        "checked_against_plain": len(checked), "mismatches": mismatches, "tokens": tokens,
        "wall_s": t_end - t0, "wall_after_warmup_s": t_end - t_warm,
        "rss_start_mb": rss["start"] / MB, "rss_after_warmup_mb": rss["after_warmup"] / MB,
        "rss_end_mb": rss["end"] / MB,
        "rss_growth_after_warmup_mb": (rss["end"] - rss["after_warmup"]) / MB,
    }


# --------------------------------------------------------------------------- CLI
LONG_COLUMNS = ["rows", "new_tokens_per_row", "position_limit", "max_len", "tokens", "wall_s",
                "tokens_per_s", "accept_len", "short_tokens", "warmup_tokens", "compiles",
                "compiles_after_warmup", "rss_start_mb", "rss_after_warmup_mb",
                "rss_peak_short_mb", "rss_peak_mb", "rss_end_mb", "rss_rise_in_call_mb",
                "kv_pool_mb", "rss_growth_in_call_mb", "rss_peak_long_minus_short_mb",
                "kv_long_minus_short_mb", "short_is_prefix"]
CALLS_COLUMNS = ["calls", "distinct_shapes", "compiles", "retraced", "checked_against_plain",
                 "mismatches", "invalid", "tokens", "wall_s", "wall_after_warmup_s",
                 "rss_start_mb", "rss_after_warmup_mb",
                 "rss_end_mb", "rss_growth_after_warmup_mb"]


def print_figures(title: str, row: dict, columns) -> None:
    print(f"\n{title} (load {common.load_avg()})")
    # Lists of call indices (retraced, mismatches) print as their count; the JSON has them.
    value = lambda v: len(v) if isinstance(v, list) else v
    print(common.format_table([{"figure": c, "value": value(row.get(c))} for c in columns],
                              ["figure", "value"]))


def add_args(s) -> None:
    s.add_argument("--parts", nargs="+", choices=["long", "calls"], default=["long", "calls"])
    s.add_argument("--model", default=None, help="default: checkpoints/default/target")
    s.add_argument("--drafter", default=None,
                   help="drafter checkpoint (default: the shipped EAGLE-3), or none")
    s.add_argument("--spec", metavar="S,K,N", default=None, help="default: the drafter's")
    s.add_argument("--prompts", default=None,
                   help="text file (default: the shipped held-out prompts); long: one line a "
                        "row; calls: windows of its tokens")
    s.add_argument("--rows", type=int, default=8, help="long: rows of the long call")
    s.add_argument("--new-tokens", type=int, default=None,
                   help="long: new tokens a row (default: up to max_position_embeddings)")
    s.add_argument("--short-tokens", type=int, default=512,
                   help="long: new tokens a row of the short call it is compared with")
    s.add_argument("--calls", type=int, default=200)
    s.add_argument("--max-new", type=int, default=32, help="calls: max_new_tokens")
    s.add_argument("--buckets", type=int, default=2, help="calls: prompt buckets of 16 used")
    s.add_argument("--temperature", type=float, default=0.8, help="calls: the sampled calls'")
    s.add_argument("--check-every", type=int, default=10,
                   help="calls: rerun every n-th greedy call with plain decoding")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", metavar="OUT", help="also write the figures as JSON")


def main(args) -> dict:
    args.model = args.model or DEFAULT_TARGET
    args.drafter = args.drafter or DEFAULT_DRAFTER
    args.prompts = args.prompts or DEFAULT_PROMPTS
    target, drafter = load_default(args.model, None if args.drafter == "none" else args.drafter)
    spec = SpecConfig(*map(int, args.spec.split(","))) if args.spec else None
    out = {"model": args.model, "drafter": args.drafter, "spec": args.spec}
    if "long" in args.parts:
        prompts = text_prompts(target, args.rows, args.prompts)
        out["long"] = long_generation(target, drafter, prompts, args.new_tokens,
                                      args.short_tokens, spec)
        print_figures("long generation", out["long"], LONG_COLUMNS)
    if "calls" in args.parts:
        schedule = call_schedule(corpus_ids(target, args.prompts), target.config.vocab_size,
                                 target.config.eos_token_ids[0], args.calls, args.max_new,
                                 args.buckets, args.temperature, args.seed)
        out["calls"] = many_calls(target, drafter, schedule, args.check_every, spec)
        print_figures(f"{args.calls} consecutive calls", out["calls"], CALLS_COLUMNS)
    if args.json:
        common.write_json(args.json, out)
    return out


COMMAND = Command("long-run", "a ~16k-token generation and 200 consecutive calls: RSS, compile "
                              "counts, wall time", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
