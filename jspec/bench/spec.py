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

Part B (``--simulate E ...``, batch 1): speculative decoding on a (memory-bound) target with
the accept length *forced* to E (``forced_accept=E``: a benchmark mode whose output is not
the target's), for each ``--sim-spec`` (default the (5, 4, 8) tree and the (4, 1, 5) chain),
beside the ideal speed-up of a cost model:

  t_1  one jitted 1-token decode step (logits included) against a cache of
       ``prompt_len + new_tokens`` positions,
  t_V  one target forward over the spec's N nodes with its tree mask against the same
       cache (the verify step),
  c    one tree-loop step of the ``--sim-drafter`` (default EAGLE-3 with an 8k draft
       vocabulary, ``--sim-draft-vocab``) for K frontier nodes: ``net_apply`` against its
       paged prefix and transient window, plus the top-K; divided by t_1;

  ideal(E) = E / (t_V / t_1 + S c), S drafter forwards per verify (S - 1 loop steps + extend).

The micro-benchmarks are timed alternately, call by call (as ``forward`` does), so
background load affects them alike.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench import common, forward
from jspec.bench.plain import describe, load, make_prompts
from jspec.drafters import registry
from jspec.spec_config import SpecConfig
from jspec.target import Target

COLUMNS = ["drafter", "mode", "S,K,N", "compile s", "tokens/s", "accept len", "speedup",
           "same tokens"]
SIM_COLUMNS = ["E", "S,K,N", "t_V/t_1", "c", "compile s", "tokens/s", "accept len", "speedup", "ideal",
               "measured/ideal"]
RANDOM_KINDS = registry.names(lambda k: k.needs_weights)
SIM_SPEC = SpecConfig(5, 4, 8)
SIM_SPECS = (SpecConfig(5, 4, 8), SpecConfig.chain(4))
SIM_DRAFT_STEPS = 5     # S: S-1 = 4 tree-loop steps + 1 extend per verify pass
SIM_KIND, SIM_DRAFT_VOCAB = "eagle3", 8192


# --------------------------------------------------------------------------- helpers
def spec_shape(drafter, spec: SpecConfig | None) -> str:
    """``"S,K,N"`` of what the driver will actually run for this drafter and knobs."""
    spec = spec if spec is not None else drafter.default_spec
    S, N = drafter.module.tree_shape(spec)
    return f"{S},{spec.topk if spec is not None else '-'},{N}"     # '-': the drafter's own tree


def variants(drafter) -> list[tuple[str, SpecConfig | None]]:
    """``[(mode, spec)]``: a chain and a tree per drafter (see the module docstring)."""
    default = drafter.default_spec
    tree = default if default is None or not default.is_chain else drafter.entry.mode(
        "default", drafter.module)
    return [("chain", drafter.entry.mode("chain", drafter.module)), ("tree", tree)]


def _interleaved(calls: Sequence, repeats: int) -> list[tuple[float, float, object]]:
    """``[(first wall_s, median wall_s, last result)]`` per zero-argument ``generate`` call.

    Every call is warmed up (compiled) first; then the timed calls go round-robin, one of
    each per round, so load from other processes on the machine hits all variants alike and
    the speed-up ratios stay meaningful."""
    firsts, lasts = [], []
    for c in calls:
        res = c()
        firsts.append(res.wall_s)
        lasts.append(res)
    times = [[] for _ in calls]
    for _ in range(max(1, repeats)):
        for i, c in enumerate(calls):
            lasts[i] = c()
            times[i].append(lasts[i].wall_s)
    return [(f, float(statistics.median(t)), r) for f, t, r in zip(firsts, times, lasts)]


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
    """Checkpoint directories, or any ``--drafter`` form the CLI takes (``ngram[:MIN:MAX]``,
    ``random:KIND``)."""
    from jspec.cli import load_drafter_arg
    return [(os.path.basename(os.path.normpath(p)), load_drafter_arg(p, target)) for p in paths]


# --------------------------------------------------------------------------- part A
def run_spec(target: Target, batch: int = 1, new_tokens: int = 128, prompt_len: int = 32,
             repeats: int = 3, drafter_paths: Sequence[str] = (), kinds: Sequence[str] = RANDOM_KINDS,
             oracle: bool = True, seed: int = 0, text_prompts: Sequence[str] | None = None,
             log=print) -> list[dict]:
    """Rows: ``plain`` first, then one row per (drafter, chain/tree). Extra keys per row:
    ``median s``, ``first s``, ``spec`` (S, K, N as a list) and ``exact`` (same tokens).
    ``text_prompts``: run these (tokenized, batch 1 each, one after another) instead of
    ``batch`` random-token prompts."""
    import jspec
    from jspec.drafters import Drafter, Oracle

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

    drafters = [(k, make_random_drafter(k, cfg, seed)) for k in kinds]
    if oracle:
        width = prompt_len + new_tokens + 16
        fut = oracle_future(prompts, plain_toks, width)
        drafters.append(("oracle", Drafter(Oracle(cfg.vocab_size), {"future": jnp.asarray(fut)})))
    drafters += load_checkpoint_drafters(drafter_paths, target)
    cases = [(name, d, mode, spec) for name, d in drafters for mode, spec in variants(d)]
    if log:
        log(f"  {1 + len(cases)} variants: compiling, then {repeats} interleaved rounds")
    timed = _interleaved([plain_call] + [gen(drafter=d, spec=spec) for _, d, _, spec in cases],
                         repeats)

    _, med, res = timed[0]
    first = plain_first
    if res.tokens != plain_toks:
        raise RuntimeError("plain greedy decoding is not deterministic across calls")
    plain_tps = total / med
    rows = [{"drafter": "plain", "mode": "-", "S,K,N": "-", "compile s": max(0.0, first - med),
             "tokens/s": plain_tps, "accept len": 1.0, "speedup": 1.0, "same tokens": True,
             "median s": med, "first s": first}]
    for (name, d, mode, spec), (first, med, res) in zip(cases, timed[1:]):
        acc = float(np.mean([s["mean_accept_len"] for s in res.stats]))
        tps = total / med
        row = {"drafter": name, "mode": mode, "S,K,N": spec_shape(d, spec),
               "compile s": max(0.0, first - med), "tokens/s": tps, "accept len": acc,
               "speedup": tps / plain_tps, "same tokens": res.tokens == plain_toks,
               "median s": med, "first s": first}
        rows.append(row)
        if log:
            log(f"  {name} {mode} ({row['S,K,N']}): {tps:.1f} tok/s, accept {acc:.2f}, "
                f"same tokens {'yes' if row['same tokens'] else 'NO'}")
    return rows


# --------------------------------------------------------------------------- part B
def _prepare(fn, params, tok, pos, cache) -> dict:
    import time
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=(3,)).lower(params, tok, pos, cache).compile()
    return {"compiled": compiled, "tok": tok, "pos": pos, "cache": cache, "params": params,
            "compile s": time.perf_counter() - t0, "times": [], "tokens": tok.shape[1]}


def sim_tree_parents(spec: SpecConfig) -> np.ndarray:
    """A representative tree for the knobs: a chain for K = 1; for (5, 4, 8) the depths
    0,1,1,2,2,3,4,5 an EAGLE-2 tree typically has (other trees: a spine plus siblings)."""
    S, K, N = spec.num_steps, spec.topk, spec.num_draft_tokens
    if K == 1:
        return np.arange(-1, N - 1, dtype=np.int32)
    if (S, K, N) == (5, 4, 8):
        return np.array([-1, 0, 0, 1, 1, 3, 5, 6], np.int32)
    spine = list(range(-1, S))[:N]
    return np.array(spine + [0] * (N - len(spine)), np.int32)


def sim_drafter(cfg, kind: str = SIM_KIND, draft_vocab: int = SIM_DRAFT_VOCAB, seed: int = 0):
    """The random drafter part B costs: EAGLE-3 with a reduced draft vocabulary by default."""
    kw = {"vocab_size": draft_vocab} if draft_vocab and draft_vocab < cfg.vocab_size else {}
    from jspec.drafters import random_drafter
    return random_drafter(kind, cfg, jax.random.key(seed), **kw)


def micro_costs(target: Target, context: int, repeats: int = 20, page_size: int = 16,
                seed: int = 0, specs: Sequence[SpecConfig] = SIM_SPECS, drafter=None,
                batch: int = 1) -> dict:
    """``t_1``, and per spec ``t_V`` and one draft step (ms) and ``c`` at ``batch`` rows (see
    the module docstring). All variants are timed alternately, call by call."""
    from jspec import kv_cache as kvc
    from jspec.drafters.base import top_k_logprobs
    from jspec.tree.build import build_tree

    cfg, params = target.config, target.serving_params
    d = drafter if drafter is not None else sim_drafter(target.config, seed=seed)
    d = d.serving                 # the layout generate runs
    m = d.module
    rng = np.random.default_rng(seed)
    B = batch
    maxN = max(sp.num_draft_tokens for sp in specs)
    # t_1: a 1-token decode step.
    tok1 = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)), jnp.int32)
    v1 = _prepare(forward._step_fn(cfg), params, tok1, jnp.full((B, 1), context, jnp.int32),
                  forward.make_cache(cfg, B, context, maxN, page_size, seed))
    variants, per_spec = [v1], []
    for sp in specs:
        S, K, N = sp.num_steps, sp.topk, sp.num_draft_tokens
        W = max((S - 1) * K, 1)
        # t_V: N tree nodes with the tree mask, positions context + depth.
        tree = build_tree(jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32),
                          jnp.asarray(np.repeat(sim_tree_parents(sp)[None], B, 0)), S)
        vV = _prepare(forward._step_fn(cfg, tree.mask()), params, tree.tokens,
                      context + tree.depths,
                      forward.make_cache(cfg, B, context, maxN, page_size, seed))
        # One tree-loop step: the drafter's net for K frontier nodes against its paged
        # prefix and transient window, then the top-K of its distribution.
        feats = jax.random.normal(jax.random.key(seed + 1), (B, K, cfg.hidden_size), cfg.dtype)
        mask = jnp.broadcast_to(jax.nn.one_hot(jnp.arange(K), W, dtype=bool)[None], (B, K, W))

        def draft_step(p, tokens, positions, cache, m=m, feats=feats, mask=mask, W=W, K=K):
            dp, tp = p
            window = kvc.WindowedCache.empty(cache, W)
            out, logits, window = m.net_apply(dp, cfg, tp, tokens, feats, 1, positions, window,
                                              mask, None, 0)
            logp, _ = top_k_logprobs(logits, K)
            return logp, window.prefix

        tokd = jnp.asarray(rng.integers(0, min(cfg.vocab_size, m.draft_vocab), (B, K)), jnp.int32)
        vD = _prepare(draft_step, (d.params, params), tokd, jnp.full((B, K), context, jnp.int32),
                      forward.make_cache(m.layer.replace(num_layers=m.cache_layers), B, context,
                                         W, page_size, seed))
        variants += [vV, vD]
        per_spec.append((sp, vV, vD))
    for i in range(2 + repeats):          # two warm-up rounds
        for v in variants:
            dt = forward._call(v, v["params"])
            if i >= 2:
                v["times"].append(dt)
    med = lambda v: 1000.0 * statistics.median(v["times"])
    t1 = med(v1)
    out = {"context": context, "batch": B, "t_1 ms": t1, "drafter": m.kind,
           "draft vocab": m.draft_vocab,
           "compile s": [v["compile s"] for v in variants], "specs": {}}
    for sp, vV, vD in per_spec:
        key = f"{sp.num_steps},{sp.topk},{sp.num_draft_tokens}"
        out["specs"][key] = {"t_V ms": med(vV), "draft step ms": med(vD), "t_V/t_1": med(vV) / t1,
                             "c": med(vD) / t1}
    return out


def ideal_speedup(E: float, tv_over_t1: float, c: float, S: int = SIM_DRAFT_STEPS) -> float:
    return E / (tv_over_t1 + S * c)


def run_simulate(target: Target, accepts: Sequence[float] = (2, 3, 4), new_tokens: int = 128,
                 prompt_len: int = 32, repeats: int = 3, micro_repeats: int = 20,
                 seed: int = 0, specs: Sequence[SpecConfig] = SIM_SPECS, kind: str = SIM_KIND,
                 draft_vocab: int = SIM_DRAFT_VOCAB, log=print) -> tuple[dict, list[dict]]:
    """``(costs, rows)``: the micro costs and one row per (spec, forced accept length E),
    batch 1; plain batch-1 decoding is timed interleaved with the forced runs."""
    import jspec

    cfg = target.config
    d = sim_drafter(cfg, kind, draft_vocab, seed)
    costs = micro_costs(target, prompt_len + new_tokens, micro_repeats, seed=seed, specs=specs,
                        drafter=d)
    if log:
        log(f"  t_1 {costs['t_1 ms']:.3f} ms; " + "; ".join(
            f"({k}) t_V {v['t_V ms']:.3f} ms, draft step {v['draft step ms']:.3f} ms"
            for k, v in costs["specs"].items()))
    prompts = make_prompts(cfg, 1, prompt_len, seed + 1)
    plist = prompts.tolist()

    def gen(**kw):
        return lambda: jspec.generate(target, plist, max_new_tokens=new_tokens, stop_ids=[], **kw)

    cases = [(sp, E) for sp in specs for E in accepts if E <= sp.num_steps + 1]
    timed = _interleaved([gen()] + [gen(drafter=d, spec=sp, forced_accept=float(E))
                                    for sp, E in cases], repeats)
    _, med, _ = timed[0]
    plain_tps = new_tokens / med
    costs["plain tokens/s"] = plain_tps
    costs["plain ms/token"] = 1000.0 * med / new_tokens
    rows = []
    for (sp, E), (first, med, res) in zip(cases, timed[1:]):
        tps = new_tokens / med
        shape = spec_shape(d, sp)
        c = costs["specs"][shape]
        ideal = ideal_speedup(float(E), c["t_V/t_1"], c["c"], sp.num_steps)
        row = {"E": int(E) if float(E).is_integer() else float(E), "S,K,N": shape,
               "c": c["c"], "t_V/t_1": c["t_V/t_1"],
               "compile s": max(0.0, first - med), "tokens/s": tps,
               "accept len": float(np.mean([s["mean_accept_len"] for s in res.stats])),
               "speedup": tps / plain_tps, "ideal": ideal, "median s": med, "first s": first}
        row["measured/ideal"] = row["speedup"] / ideal
        rows.append(row)
        if log:
            log(f"  ({shape}) forced E={E}: {tps:.1f} tok/s, accept {row['accept len']:.2f}")
    return costs, rows


# --------------------------------------------------------------------------- CLI
def main(args) -> dict:
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
