"""Part B of ``python -m jspec.bench spec`` (``--simulate E ...``): forced accept lengths
against a cost model's ideal speed-up.

At batch 1, speculative decoding on a (memory-bound) target runs with the accept length
*forced* to E (``forced_accept=E``: a benchmark mode whose output is not the target's), for
each ``--sim-spec`` (default the (5, 4, 8) tree and the (4, 1, 5) chain), beside the ideal
speed-up of a cost model:

  t_1  one jitted 1-token decode step (logits included) against a cache of
       ``prompt_len + new_tokens`` positions,
  t_V  one target forward over the spec's N nodes with its tree mask against the same
       cache (the verify step),
  c    one tree-loop step of the ``--sim-drafter`` (default EAGLE-3 with an 8k draft
       vocabulary, ``--sim-draft-vocab``) for K frontier nodes: ``net_apply`` against its
       paged prefix and transient window, plus the top-K; divided by t_1;

  ideal(E) = E / (t_V / t_1 + S c), S drafter forwards per verify (S - 1 loop steps + extend).

The micro-benchmarks (:func:`micro_costs`, also what ``jspec tune`` and the device
benchmark's ``draft`` section time) are timed alternately, call by call (as ``forward``
does), so background load affects them alike.
"""

from __future__ import annotations

import functools
import statistics
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import kv_cache as kvc
from jspec.bench import common
from jspec.bench.plain import make_prompts
from jspec.drafters.base import top_k_logprobs
from jspec.spec_config import SpecConfig
from jspec.target import Target
from jspec.timing import own_seconds, round_robin, wall_s
from jspec.tree.build import build_tree

SIM_COLUMNS = ["E", "S,K,N", "t_V/t_1", "c", "compile s", "tokens/s", "accept len", "speedup", "ideal",
               "measured/ideal"]
SIM_SPECS = (SpecConfig(5, 4, 8), SpecConfig.chain(4))
SIM_DRAFT_STEPS = 5     # S: S-1 = 4 tree-loop steps + 1 extend per verify pass
SIM_KIND, SIM_DRAFT_VOCAB = "eagle3", 8192


def spec_shape(drafter, spec: SpecConfig | None) -> str:
    """``"S,K,N"`` of what the driver will actually run for this drafter and knobs."""
    spec = spec if spec is not None else drafter.default_spec
    S, N = drafter.module.tree_shape(spec)
    return f"{S},{spec.topk if spec is not None else '-'},{N}"     # '-': the drafter's own tree


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
    cfg, params = target.config, target.serving_params
    d = drafter if drafter is not None else sim_drafter(target.config, seed=seed)
    d = d.serving                 # the layout generate runs
    m = d.module
    rng = np.random.default_rng(seed)
    B = batch
    maxN = max(sp.num_draft_tokens for sp in specs)
    # t_1: a 1-token decode step.
    tok1 = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)), jnp.int32)
    v1 = _prepare(common.step_fn(cfg), params, tok1, jnp.full((B, 1), context, jnp.int32),
                  common.make_cache(cfg, B, context, maxN, page_size, seed))
    variants, per_spec = [v1], []
    for sp in specs:
        S, K, N = sp.num_steps, sp.topk, sp.num_draft_tokens
        W = max((S - 1) * K, 1)
        # t_V: N tree nodes with the tree mask, positions context + depth.
        tree = build_tree(jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32),
                          jnp.asarray(np.repeat(sim_tree_parents(sp)[None], B, 0)), S)
        vV = _prepare(common.step_fn(cfg, tree.mask()), params, tree.tokens,
                      context + tree.depths,
                      common.make_cache(cfg, B, context, maxN, page_size, seed))
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
                      common.make_cache(m.layer.replace(num_layers=m.cache_layers), B, context,
                                        W, page_size, seed))
        variants += [vV, vD]
        per_spec.append((sp, vV, vD))
    timed = round_robin([functools.partial(common.timed_call, v, v["params"]) for v in variants],
                        repeats, warmup=2, seconds=own_seconds)
    for v, t in zip(variants, timed):
        v["times"] = t.times
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
    timed = round_robin([gen()] + [gen(drafter=d, spec=sp, forced_accept=float(E))
                                   for sp, E in cases], repeats, seconds=wall_s)
    med = timed[0].median
    plain_tps = new_tokens / med
    costs["plain tokens/s"] = plain_tps
    costs["plain ms/token"] = 1000.0 * med / new_tokens
    rows = []
    for (sp, E), t in zip(cases, timed[1:]):
        first, med, res = t.first, t.median, t.result
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
