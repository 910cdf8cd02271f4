"""``python -m jspec.bench spec``: speculative decoding vs plain greedy decoding.

Part A (always): the same prompts (BOS first, ``prompt_len`` tokens, ``stop_ids=[]`` so every
row makes exactly ``new_tokens``) go through plain :func:`jspec.generate`, then through
speculative ``generate`` with each drafter, once as a chain (``SpecConfig.chain(S)``) and once
as a tree. Drafters: random-weight EAGLE-1, EAGLE-3, MTP and Medusa
(:func:`jspec.drafters.random_drafter`), an :class:`~jspec.drafters.Oracle` fed the plain
greedy continuation (``params={"future": [B, max_len]}``: prompt + plain tokens per row, so
it should accept S + 1 tokens per verify), and any ``--drafter`` checkpoints (loaded
via ``jspec.drafters.load_drafter``).

Columns:
  drafter, mode   chain (K = 1) or tree
  S,K,N           tree depth, branching, node count (root included); Medusa's static tree
                  reports its depth, widest branching and node count
  compile s       first call minus the steady-state median (tracing + XLA compilation)
  tokens/s        generated tokens of all rows / median ``wall_s`` of ``repeats`` calls
                  after one warm-up call
  accept len      mean over rows of ``stats[row]["mean_accept_len"]`` (tokens emitted per
                  verify pass: accepted drafts + the bonus token; plain decoding = 1)
  speedup         tokens/s over plain tokens/s measured in the same run
  same tokens     the greedy output equals plain decoding's, row by row (must be yes)

Part B (``--simulate E ...``): forced accept lengths against a cost model, see
:mod:`jspec.bench.spec_simulate`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench import common
from jspec.bench.plain import describe, load, make_prompts
from jspec.bench.registry import Command
from jspec import position_stats
from jspec.bench.spec_simulate import SIM_COLUMNS, run_simulate, spec_shape
from jspec.drafters import registry
from jspec.spec_config import SpecConfig
from jspec.target import Target
from jspec.timing import round_robin, wall_s

COLUMNS = ["drafter", "mode", "S,K,N", "compile s", "tokens/s", "accept len", "speedup",
           "same tokens"]
RANDOM_KINDS = registry.names(lambda k: k.needs_weights)


# --------------------------------------------------------------------------- helpers
def variants(drafter) -> list[tuple[str, SpecConfig | None]]:
    """``[(mode, spec)]``: a chain and a tree per drafter (see the module docstring); a kind
    whose own default is a chain (DFlash: its whole block) runs its ``wide`` tree."""
    entry, module = drafter.entry, drafter.module
    default = drafter.default_spec
    tree = default if default is None or not default.is_chain else entry.mode("default", module)
    if tree is None and "wide" in entry.modes:
        S, N = module.tree_shape(None)
        if N == S + 1:
            tree = entry.mode("wide", module)
    return [("chain", entry.mode("chain", module)), ("tree", tree)]


def generate_in_turn(target: Target, batches: Sequence[Sequence], **kw):
    """``jspec.generate`` over each batch of prompts in turn, as one result: the rows of
    every call in order, and the calls' summed ``wall_s``."""
    import jspec
    from jspec.generate import GenerationResult

    res = [jspec.generate(target, list(b), **kw) for b in batches]
    return GenerationResult(tokens=[t for r in res for t in r.tokens],
                            stats=[s for r in res for s in r.stats],
                            wall_s=sum(r.wall_s for r in res))


def oracle_future(prompts: np.ndarray, plain_tokens: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """``[B, width]`` int32: prompt then the plain greedy continuation, per row."""
    B, P = prompts.shape
    fut = np.zeros((B, width), np.int32)
    for r in range(B):
        seq = list(prompts[r]) + list(plain_tokens[r])
        fut[r, :min(width, len(seq))] = seq[:width]
    return fut


def make_random_drafter(kind: str, cfg, seed: int = 0):
    from jspec.drafters import random_drafter
    return random_drafter(kind, cfg, jax.random.key(seed))


def load_checkpoint_drafters(paths: Sequence[str], target: Target) -> list:
    """``(name, drafter, shapes)`` of checkpoint directories, or any ``--drafter`` form the
    CLI takes (``ngram[:MIN:MAX]``, ``random:KIND``); ``PATH@S,K,N[+S,K,N...]`` runs those
    shapes instead of the kind's chain and tree (``shapes`` None otherwise)."""
    from jspec.args import load_drafter_arg
    from jspec.spec_config import parse_spec
    out = []
    for arg in paths:
        p, _, shapes = arg.partition("@")
        specs = [parse_spec(x) for x in shapes.split("+")] if shapes else None
        out.append((os.path.basename(os.path.normpath(p)), load_drafter_arg(p, target), specs))
    return out


# --------------------------------------------------------------------------- part A
def spec_cases(target: Target, kinds: Sequence[str], drafter_paths: Sequence[str], seed: int,
               oracle_fut=None) -> list[tuple]:
    """``(name, drafter, mode, spec)`` of every drafter, each as chain and tree: the random
    ``kinds``, the oracle when given its future, the checkpoints at ``drafter_paths``."""
    from jspec.drafters import Drafter, Oracle

    cfg = target.config
    drafters = [(k, make_random_drafter(k, cfg, seed), None) for k in kinds]
    if oracle_fut is not None:
        drafters.append(("oracle", Drafter(Oracle(cfg.vocab_size),
                                           {"future": jnp.asarray(oracle_fut)}), None))
    drafters += load_checkpoint_drafters(drafter_paths, target)
    return [(name, d, mode, spec) for name, d, specs in drafters
            for mode, spec in (variants(d) if specs is None else
                               [("chain" if s.is_chain else "tree", s) for s in specs])]


def run_spec(target: Target, batch: int = 1, new_tokens: int = 128, prompt_len: int = 32,
             repeats: int = 3, drafter_paths: Sequence[str] = (), kinds: Sequence[str] = RANDOM_KINDS,
             oracle: bool = True, seed: int = 0, text_prompts: Sequence[str] | None = None,
             log=print) -> list[dict]:
    """Rows: ``plain`` first, then one row per (drafter, chain/tree). Extra keys per row:
    ``median s``, ``first s``, ``spec`` (S, K, N as a list) and ``exact`` (same tokens).
    ``text_prompts``: run these (tokenized, batch 1 each, one after another) instead of
    ``batch`` random-token prompts."""
    import jspec

    cfg = target.config
    if text_prompts:
        # Real prompts, one at a time at batch 1 (the demo's setting); the rows of a call's
        # result are the prompts. The oracle needs one batch, so it does not run here.
        ids = [target.tokenizer.encode(p) for p in text_prompts]
        total, oracle = len(ids) * new_tokens, False

        def gen(**kw):
            return lambda: generate_in_turn(target, [[p] for p in ids],
                                            max_new_tokens=new_tokens, stop_ids=[], **kw)
    else:
        prompts = make_prompts(cfg, batch, prompt_len, seed + batch)
        plist = prompts.tolist()
        total = batch * new_tokens

        def gen(**kw):
            return lambda: jspec.generate(target, plist, max_new_tokens=new_tokens, stop_ids=[],
                                          **kw)

    # The plain warm-up call gives the oracle its future; all timing happens below.
    plain_call = gen()
    res0 = plain_call()
    plain_toks, plain_first = res0.tokens, res0.wall_s
    if any(len(t) != new_tokens for t in plain_toks):
        raise RuntimeError(f"plain produced {[len(t) for t in plain_toks]} tokens, expected {new_tokens}")

    fut = oracle_future(prompts, plain_toks, prompt_len + new_tokens + 16) if oracle else None
    cases = spec_cases(target, kinds, drafter_paths, seed, fut)
    if log:
        log(f"  {1 + len(cases)} variants: compiling, then {repeats} interleaved rounds")
    timed = round_robin([plain_call] + [gen(drafter=d, spec=spec) for _, d, _, spec in cases],
                        repeats, seconds=wall_s)

    med, res = timed[0].median, timed[0].result
    first = plain_first
    if res.tokens != plain_toks:
        raise RuntimeError("plain greedy decoding is not deterministic across calls")
    plain_tps = total / med
    rows = [{"drafter": "plain", "mode": "-", "S,K,N": "-", "compile s": max(0.0, first - med),
             "tokens/s": plain_tps, "accept len": 1.0, "speedup": 1.0, "same tokens": True,
             "median s": med, "first s": first}]
    for (name, d, mode, spec), t in zip(cases, timed[1:]):
        rows.append(spec_row(name, mode, spec_shape(d, spec), t, total, plain_tps, plain_toks))
        if log:
            r = rows[-1]
            log(f"  {name} {mode} ({r['S,K,N']}): {r['tokens/s']:.1f} tok/s, accept "
                f"{r['accept len']:.2f}, same tokens {'yes' if r['same tokens'] else 'NO'}")
    return rows


def spec_row(name: str, mode: str, shape, t, total: int, plain_tps: float, plain_toks) -> dict:
    """One drafter variant's row from its :class:`jspec.timing.Timing`."""
    med, res = t.median, t.result
    tps = total / med
    return {"drafter": name, "mode": mode, "S,K,N": shape, "compile s": max(0.0, t.first - med),
            "tokens/s": tps, "accept len": float(np.mean([s["mean_accept_len"]
                                                           for s in res.stats])),
            "speedup": tps / plain_tps, "same tokens": res.tokens == plain_toks,
            "median s": med, "first s": t.first,
            "by position": position_stats.merge(s["accept_by_position"] for s in res.stats)}


# --------------------------------------------------------------------------- CLI
def add_args(s) -> None:
    s.add_argument("--model", metavar="PATH",
                   help="HF directory, jspec Orbax directory or llama2.c .bin")
    common.add_common_args(s, [1], 3)
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--drafter", metavar="PATH", nargs="+", default=[],
                   help="drafter checkpoints (jspec Orbax or a published HF layout), or "
                        "ngram[:MIN_N:MAX_N] (prompt lookup); PATH@S,K,N[+S,K,N...] runs those "
                        "shapes instead of its chain and tree (e.g. a DFlash head's block sizes)")
    s.add_argument("--kinds", nargs="*", default=None,
                   help="random-weight drafters to run (default: all four, none with --prompts; "
                        "the oracle runs unless --prompts)")
    s.add_argument("--prompts", metavar="FILE", default=None,
                   help="text prompts, one per line, run one at a time at batch 1 instead of "
                        "random-token prompts (needs a tokenizer)")
    s.add_argument("--num-prompts", type=int, default=8, help="with --prompts: how many lines")
    s.add_argument("--simulate", metavar="E", type=float, nargs="+", default=None,
                   help="part B: forced mean accept lengths (e.g. 2 3 4)")
    s.add_argument("--sim-drafter", default="eagle3", choices=["eagle1", "eagle3", "mtp"],
                   help="part B: the random drafter whose costs are simulated")
    s.add_argument("--sim-draft-vocab", type=int, default=8192,
                   help="part B: its draft vocabulary (0: the target's)")
    s.add_argument("--sim-spec", nargs="+", default=["5,4,8", "4,1,5"], metavar="S,K,N",
                   help="part B: tree knobs to simulate")


def print_by_position(rows) -> None:
    print("\nmean accept length by context position (verify passes):")
    print(position_stats.table({f"{r['drafter']} {r['mode']} ({r['S,K,N']})": r["by position"]
                                for r in rows if "by position" in r}))


def check_args(args) -> None:
    """The checks and defaults of the command line (``--model`` or ``--random-config``, one
    ``--batch``)."""
    if args.model is not None and args.random_config is not None:
        raise SystemExit("pass --model or --random-config, not both")
    if len(args.batch) != 1:
        raise SystemExit("spec takes one --batch")
    if args.model is None and args.random_config is None:
        args.random_config = "100m" if args.simulate else "tiny"


def main(args) -> dict:
    check_args(args)
    target, source = load(args.model, args.random_config, args.dtype, args.seed)
    batch = args.batch[0] if isinstance(args.batch, (list, tuple)) else args.batch
    print(describe(target, source))
    text = None
    if getattr(args, "prompts", None):
        if batch != 1:
            raise SystemExit("--prompts runs its prompts one at a time at batch 1; drop --batch")
        if target.tokenizer is None:
            raise SystemExit("--prompts needs a target with a tokenizer")
        text = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        text = text[:getattr(args, "num_prompts", 8)]
        print(f"prompts: the first {len(text)} lines of {args.prompts}, batch 1 each, in turn")
    shape = "" if text else f", prompt {args.prompt_len} tokens"
    print(f"part A: batch {batch}{shape}, {args.new_tokens} new tokens, greedy, median of "
          f"{args.repeats} calls after one warm-up")
    kinds = args.kinds if args.kinds is not None else (() if text else RANDOM_KINDS)
    rows = run_spec(target, batch, args.new_tokens, args.prompt_len, args.repeats,
                    args.drafter or (), kinds=kinds, seed=args.seed, text_prompts=text)
    print()
    print(common.format_table(rows, COLUMNS))
    who = (f"prompts from {args.prompts}; --drafter checkpoints" if text else
           "random-weight drafters, so their accept length is ~1; oracle = the plain greedy "
           "continuation planted as the best path")
    print_by_position(rows)
    print(f"\n(tokens/s: all rows' tokens / median wall_s, prefill included; speedup: over plain "
          f"in this run, all variants timed round-robin; {who}. load avg {common.load_avg()})")
    payload = {"benchmark": "spec", "model": source, "description": describe(target, source),
               "batch": batch, "prompt len": args.prompt_len, "new tokens": args.new_tokens,
               "repeats": args.repeats, "columns": COLUMNS, "rows": rows}
    if args.simulate:

        vocab = args.sim_draft_vocab
        print(f"\npart B: forced accept length, {args.sim_drafter} (random weights, draft vocab "
              f"{vocab or target.config.vocab_size}), batch 1, context {args.prompt_len} + "
              f"{args.new_tokens}")
        specs = [SpecConfig(*map(int, x.split(","))) for x in args.sim_spec]
        costs, sim = run_simulate(target, args.simulate, args.new_tokens, args.prompt_len,
                                  args.repeats, seed=args.seed, specs=specs,
                                  kind=args.sim_drafter, draft_vocab=vocab)
        print()
        print(f"t_1 = {costs['t_1 ms']:.3f} ms (1-token decode step, context {costs['context']}; "
              f"plain generate: {costs['plain ms/token']:.3f} ms/token incl. prefill)")
        for k, v in costs["specs"].items():
            print(f"({k}): t_V = {v['t_V ms']:.3f} ms = {v['t_V/t_1']:.3f} t_1 (tree verify); "
                  f"c = {v['c']:.4f} (one {costs['drafter']} tree-loop step: "
                  f"{v['draft step ms']:.3f} ms / t_1)")
        print()
        print(common.format_table(sim, SIM_COLUMNS))
        print(f"\nideal = E / (t_V/t_1 + S*c): S drafter forwards per verify pass (the tree "
              f"loop's S-1 recurrent steps plus the extend over the accepted tokens, each costed "
              f"as one tree-loop step c); tree selection, walk, commit and the loop's "
              f"bookkeeping are not in the model. Forced rows do not emit the target's tokens. "
              f"speedup: tokens/s over plain batch-1 decoding in this run. "
              f"load avg {common.load_avg()}")
        payload["simulate"] = {"costs": costs, "columns": SIM_COLUMNS, "rows": sim}
    if args.json:
        common.write_json(args.json, payload)
    return payload


COMMAND = Command("spec", "speculative decoding (chain/tree per drafter) vs plain; --simulate: "
                          "forced accept lengths vs a cost model", add_args, main)
