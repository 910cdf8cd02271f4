"""``python -m jspec demo``: speculative generation with the shipped model, timed against plain.

The drafter and tree are picked by measurement on the machine at hand, not by a guess. The
calibration times each candidate (drafter, tree) on held-out prompts that are not the demo's
prompt, in two rounds:

1. every shipped drafter with a 4-step chain (its accept histogram says how deep to go);
2. around the fastest: one step shorter, one longer (when its chain was often fully accepted)
   and the drafter's default tree.

Each candidate compiles once (the calibration prints each compile's time) and is timed warm,
each prompt's best of two calls. The fastest measured candidate wins. The result is
stored in ``~/.cache/jspec/calibration`` (``$JSPEC_CACHE_DIR``), keyed by the checkpoints'
contents, the device and the jax version, so later runs skip it; ``--recalibrate`` redoes it.
Compiled programs go to JAX's persistent cache in ``~/.cache/jspec/xla`` (unless one is
configured already; ``--no-compile-cache`` leaves it off).

The demo then times warm plain and speculative calls side by side on the demo prompt (best of
``--repeats``, interleaved), prints the text, the mean accept length, both rates, the speedup
and whether the tokens are identical (greedy speculative decoding must give the target's own
tokens; a difference is an error).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import jax

from jspec import atomic, compile_cache as compile_cache_mod
from jspec.cache import cache_dir
from jspec.shipped import default_model, shipped_drafters
from jspec.spec_config import SpecConfig
from jspec.timing import round_robin, wall_s

FIRST_CHAIN = 4           # round 1's chain length: deep enough to see how acceptance decays
CALIBRATION_PROMPTS = 3
# The shipped model's most Python-like greedy text starts here (checkpoints/README.md).
SHIPPED_PROMPT = "import os\n"


@dataclasses.dataclass(frozen=True)
class Candidate:
    kind: str                     # the drafter's name: its kind, or --extra-drafter's NAME
    spec: tuple | None            # (S, K, N); None: the drafter's default (Medusa's static tree)

    @property
    def label(self) -> str:
        if self.spec is None:
            return f"{self.kind} default tree"
        S, K, N = self.spec
        return f"{self.kind} chain({S})" if K == 1 else f"{self.kind} tree({S},{K},{N})"

    @classmethod
    def from_dict(cls, d: dict | None) -> "Candidate | None":
        return None if d is None else cls(d["kind"], None if d["spec"] is None else tuple(d["spec"]))

    def spec_config(self):
        return None if self.spec is None else SpecConfig(*self.spec)


def fingerprint(paths) -> str:
    """A key that changes when a checkpoint's contents, the device or jax does."""
    h = hashlib.sha256()
    for p in paths:
        for f in sorted(Path(p).rglob("*")):
            if f.is_file():
                h.update(str(f.relative_to(p)).encode())
                h.update(f.read_bytes())
    d = jax.devices()[0]
    h.update(f"{d.platform}|{d.device_kind}|{os.cpu_count()}|{jax.__version__}".encode())
    return h.hexdigest()[:20]


def _first_call(label: str, fn: Callable[[], object]):
    """Run ``fn``, a call that compiles, saying what compiles and how long it took."""
    print(f"  {label}: compiling ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    out = fn()
    print(f" {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return out


def _kwargs(drafters, cand: Candidate | None) -> dict:
    if cand is None:
        return {}
    d, spec = drafters[cand.kind], cand.spec_config()
    if spec is not None and d.default_spec is not None:     # the drafter's node selection
        spec = spec.with_selection(d.default_spec.selection)
    return {"drafter": d, "spec": spec}


def _label(cand: Candidate | None) -> str:
    return "plain" if cand is None else cand.label


def _as_dict(cand: Candidate | None) -> dict | None:
    return None if cand is None else dataclasses.asdict(cand)


def _measure(gen, drafters, cand, prompts, n, repeats=2) -> dict:
    """Warm rates on ``prompts``: each prompt's best of ``repeats`` calls."""
    res = [min((gen([p], max_new_tokens=n, **_kwargs(drafters, cand)) for _ in range(repeats)),
               key=lambda r: r.wall_s) for p in prompts]
    toks = sum(len(r.tokens[0]) for r in res)
    row = {"candidate": _as_dict(cand), "label": _label(cand),
           "tokens": toks, "wall_s": sum(r.wall_s for r in res)}
    row["tokens_per_s"] = toks / row["wall_s"]
    if cand is not None:
        hist = [sum(h) for h in zip(*(r.stats[0]["accept_hist"] for r in res))]
        row["accept_hist"] = hist
        row["mean_accept_len"] = sum(i * c for i, c in enumerate(hist)) / max(1, sum(hist))
    return row


def _helpers(ctx: dict, cands: list) -> tuple[list, list]:
    """Start helper processes that compile a share of ``cands`` into JAX's persistent cache
    (XLA compiles a program on one core; threads do not overlap here, processes do).
    Returns (the candidates left to this process, the helpers)."""
    k = min(len(cands), os.cpu_count() or 1)
    if k < 2 or not ctx.get("cache"):
        return cands, []
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": ctx["cache"],
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1"}
    procs = []
    for i in range(1, k):
        job = {**ctx, "cands": [_as_dict(c) for c in cands[i::k]]}
        procs.append(subprocess.Popen([sys.executable, "-m", "jspec.demo", json.dumps(job)],
                                      env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    return cands[0::k], procs


def _round(gen, drafters, cands, prompts, n, ctx=None) -> list[dict]:
    def first_call(c):
        _first_call(_label(c), lambda: gen(prompts[:1], max_new_tokens=n, **_kwargs(drafters, c)))

    mine, procs = _helpers(ctx or {}, cands)
    if procs:
        print(f"  compiling {len(cands)} programs in {len(procs) + 1} processes", file=sys.stderr,
              flush=True)
    for c in mine:
        first_call(c)
    for p in procs:
        if p.wait():     # a helper that failed only costs time: its programs compile here
            print(f"  (a compile helper exited with {p.returncode})", file=sys.stderr)
    rows = []
    for c in cands:
        if c not in mine:             # compiled by a helper: this call reads the cache
            first_call(c)
        r = _measure(gen, drafters, c, prompts, n)
        rows.append(r)
        acc = f"{r['mean_accept_len']:.2f} tokens/verify, " if c is not None else ""
        print(f"  {r['label']}: {acc}{r['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def second_round(best: dict, drafters) -> list[Candidate]:
    """Shapes around round 1's fastest drafter, chosen from its accept histogram."""
    kind = best["candidate"]["kind"]
    S = best["candidate"]["spec"][0]
    hist = best["accept_hist"]
    full = hist[S + 1] / max(1, sum(hist)) if len(hist) > S + 1 else 0.0
    cands = [Candidate(kind, (S - 1, 1, S))] if S > 1 else []
    if full > 0.3:               # the whole chain was often accepted: a longer one may pay
        cands.append(Candidate(kind, (S + 1, 1, S + 2)))
    d = drafters[kind].default_spec
    if d is None:                 # the drafter's own default: a chain (DFlash's block) or not
        S0, N0 = drafters[kind].module.tree_shape(None)
        d = SpecConfig.chain(S0) if N0 == S0 + 1 else None
    default = Candidate(kind, None if d is None else
                        (d.num_steps, d.topk, d.num_draft_tokens))
    if default.spec is None or default.spec[1] > 1 or default.spec[0] not in (S - 1, S, S + 1):
        cands.append(default)
    return cands


def calibrate(gen, drafters: dict, prompts: list[str], n: int, ctx: dict | None = None) -> dict:
    """Time plain decoding and the candidates on ``prompts`` with ``gen`` (``jspec.generate``
    bound to a target); returns the calibration record. ``ctx`` (model and drafter paths,
    kernels, the persistent cache directory) lets helper processes compile in parallel."""
    first = [Candidate(k, (FIRST_CHAIN, 1, FIRST_CHAIN + 1)) for k in drafters]
    plain_row, *rows = _round(gen, drafters, [None, *first], prompts, n, ctx)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    rows += _round(gen, drafters, second_round(best, drafters), prompts, n, ctx)
    rows.sort(key=lambda r: -r["tokens_per_s"])
    return {"plain": plain_row, "candidates": rows, "pick": rows[0]["candidate"],
            "prompts": prompts, "max_new_tokens": n, "device": str(jax.devices()[0]),
            "cpu_count": os.cpu_count(), "jax": jax.__version__}


def print_calibration(rec: dict, out=sys.stdout) -> None:
    plain = rec["plain"]["tokens_per_s"]
    print(f"{'candidate':<24} {'accept len':>10} {'tok/s':>8} {'vs plain':>9}", file=out)
    print(f"{'plain':<24} {1.0:>10.2f} {plain:>8.1f} {1.0:>8.2f}x", file=out)
    for r in rec["candidates"]:
        print(f"{r['label']:<24} {r['mean_accept_len']:>10.2f} {r['tokens_per_s']:>8.1f} "
              f"{r['tokens_per_s'] / plain:>8.2f}x", file=out)


def load_or_calibrate(gen, drafters, drafter_paths, model_path, prompts, n, recalibrate,
                      kernels="auto", log=print) -> dict:
    key = fingerprint([model_path, *drafter_paths.values()])
    f = cache_dir() / "calibration" / f"demo-{key}-n{n}-{kernels}.json"
    if f.is_file() and not recalibrate:
        rec = json.loads(f.read_text())
        log(f"calibration: measured earlier on this machine ({f}; --recalibrate redoes it)")
        return rec
    log(f"calibration: timing {', '.join(drafters)} with a few chains and trees on "
        f"{len(prompts)} held-out prompts (once per machine; stored in {f})")
    t0 = time.perf_counter()
    ctx = {"model": str(model_path), "drafters": {k: str(p) for k, p in drafter_paths.items()},
           "kernels": kernels, "prompt": prompts[0], "n": n,
           "cache": jax.config.jax_compilation_cache_dir}
    rec = calibrate(gen, drafters, prompts, n, ctx)
    rec["wall_s"] = time.perf_counter() - t0
    atomic.write_text(f, json.dumps(rec, indent=1))
    log(f"calibration took {rec['wall_s']:.0f}s")
    return rec


def calibration_prompts(drafters_dir: Path, demo_prompt: str) -> list[str]:
    f = drafters_dir / "heldout_prompts.txt"
    lines = f.read_text().splitlines() if f.is_file() else ["def main():", "class Parser:"]
    return [p for p in lines if p.strip() and p != demo_prompt][:CALIBRATION_PROMPTS]


def timed_pair(gen, drafter, spec, prompt, n, repeats):
    """Plain and speculative calls on ``prompt`` (compiled already), timed round-robin
    (:func:`jspec.timing.round_robin`, one untimed pass, each call's own ``wall_s``)."""
    return round_robin([lambda: gen([prompt], max_new_tokens=n),
                        lambda: gen([prompt], max_new_tokens=n, drafter=drafter, spec=spec)],
                       repeats, seconds=wall_s)


def report(show, plain, fast, repeats: int) -> None:
    """The speculative text, its accept length, both speeds (the best of ``repeats``) and
    whether its tokens are plain decoding's (an error if not)."""
    res, same = fast.result, fast.result.tokens == plain.result.tokens
    print(f"\n{show(res)}\n")
    st = res.stats[0]
    print(f"mean accept length:   {st['mean_accept_len']:.2f} tokens per verify pass "
          f"({st['iterations']} passes for {st['new_tokens']} tokens)")
    for name, t in (("plain decoding:      ", plain), ("speculative decoding:", fast)):
        k = len(t.result.tokens[0])
        print(f"{name} {k / t.best:7.1f} tok/s ({k} tokens in {t.best:.3f}s, warm, best of "
              f"{repeats})")
    print(f"speedup:              {plain.best / fast.best:.2f}x")
    print(f"tokens identical to plain decoding: {'yes' if same else 'NO'}")
    if not same:
        raise RuntimeError("speculative greedy tokens differ from plain decoding")


def parse_extra(items: list[str]) -> dict[str, Path]:
    """``["NAME=DIR", ...]`` (``--extra-drafter``) as ``{NAME: DIR}``, checked before loading."""
    out = {}
    for it in items:
        name, sep, path = it.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--extra-drafter wants NAME=DIR, got {it!r}")
        if name in out:
            raise ValueError(f"--extra-drafter names {name!r} twice")
        if not (Path(path) / "jspec_drafter.json").is_file():
            raise FileNotFoundError(f"--extra-drafter {name}: {path} holds no saved drafter "
                                    f"(jspec_drafter.json)")
        out[name] = Path(path)
    return out


def run(model: str | None, prompt: str | None, n: int, *, recalibrate: bool = False,
        repeats: int = 3, drafter_kind: str | None = None, kernels: str = "auto",
        compile_cache: bool = True, extra_drafters: dict[str, Path] | None = None) -> int:
    import functools

    import jspec
    from jspec.drafters import load_drafter

    if compile_cache:      # on already, unless JSPEC_COMPILE_CACHE=0 (the demo insists)
        compile_cache_mod.enable(force=True)
    path = Path(model) if model else default_model()
    target = jspec.load_target(path)
    cfg = target.config
    gen = functools.partial(jspec.generate, target, kernels=kernels)
    print(f"model: {path} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size})")
    paths = shipped_drafters(path)
    if drafter_kind is not None:
        if drafter_kind not in paths:
            raise FileNotFoundError(f"no shipped {drafter_kind} drafter beside {path} "
                                    f"(have: {', '.join(paths) or 'none'})")
        paths = {drafter_kind: paths[drafter_kind]}
    root = next(iter(paths.values())).parent if paths else None
    for name, p in (extra_drafters or {}).items():
        if name in paths:
            raise ValueError(f"--extra-drafter {name}: the name of a shipped drafter; pick another")
        paths[name] = p
    if prompt is None:
        prompt = SHIPPED_PROMPT if paths else "Once upon a time"
    show = lambda res: prompt + (res.text[0] if res.text else " ".join(map(str, res.tokens[0])))
    if not paths:
        _first_call("plain", lambda: gen([prompt], max_new_tokens=n))
        plain = gen([prompt], max_new_tokens=n)
        print(show(plain))
        print(f"plain decoding: {len(plain.tokens[0])} tokens, {plain.tokens_per_s:.1f} tok/s")
        print("note: no drafters are shipped beside this model, so no speculative decoding")
        return 0
    drafters = {k: load_drafter(p, cfg) for k, p in paths.items()}
    rec = load_or_calibrate(gen, drafters, paths, path,
                            calibration_prompts(root or path.parent, prompt), n,
                            recalibrate, kernels)
    print_calibration(rec)
    pick = Candidate.from_dict(rec["pick"])
    print(f"picked: {pick.label} (fastest measured)")
    # The pick as it was timed (_kwargs: under the drafter's node selection).
    picked = _kwargs(drafters, pick)
    drafter, spec = picked["drafter"], picked["spec"]
    # The calibration's programs serve the demo prompt too, unless it is long (a new prompt
    # bucket compiles here).
    for label, kw in (("plain", {}), (pick.label, picked)):
        _first_call(f"{label}, demo prompt", lambda: gen([prompt], max_new_tokens=n, **kw))
    report(show, *timed_pair(gen, drafter, spec, prompt, n, repeats), repeats)
    return 0


def _compile_job(job: dict) -> None:
    """A helper process: compile the job's candidates (one generate call each)."""
    import functools

    import jspec
    from jspec.drafters import load_drafter

    target = jspec.load_target(job["model"])
    gen = functools.partial(jspec.generate, target, kernels=job["kernels"])
    cands = [Candidate.from_dict(c) for c in job["cands"]]
    drafters = {c.kind: load_drafter(job["drafters"][c.kind], target.config)
                for c in cands if c is not None}
    for c in cands:
        gen([job["prompt"]], max_new_tokens=job["n"], **_kwargs(drafters, c))


if __name__ == "__main__":
    _compile_job(json.loads(sys.argv[1]))
