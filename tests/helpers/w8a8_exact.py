"""W8A8 exactness on stories260K, for ``tests/quant/test_batch_invariance.py``; run in a
subprocess with jspec's CPU layer layout (an unrolled stack), which is the one W8A8 is
exact in (docs/quantization.md). Writes JSON:

- ``invariance``: for each (T, pages, rows) case, whether row 0's first block token has its
  1-token step's keys and values at every layer bit for bit, and the largest logit
  difference;
- ``exact``: for each drafter case, whether greedy speculative tokens equal plain decoding's;
- ``logprob_diff``: for each, the largest difference of the two runs' logprobs of a token
  they share (0 where the verify gives every token its 1-token step's logits);
- ``engine``: the same two measures for the serving engine (2 slots, refilled, a ragged
  batch of 4 requests) with an EAGLE-3 drafter, chain and tree, against plain ``generate``;
  and ``score_diff``, the largest difference of its output's logprobs from its echo
  scoring of prompt + output (a teacher-forced prefill in a program of its own);
- ``tree_node_diff``: the largest difference between a verify tree node's attention output
  and its 1-token step's after its path (0: bit-identical).

Run:  python tests/helpers/w8a8_exact.py STORIES_DIR OUT [all]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import kv_cache as kvc
from jspec import llama
from jspec.engine import Engine, Request
from jspec.spec_config import SpecConfig

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[2])]
from benchmarks.quant import first_parting  # noqa: E402
from helpers.tiny_targets import drafter_of  # noqa: E402

# (T, pages of 8 slots, rows); more with "all". 4 pages: a cache of 32 keys, fewer than the
# base's 128 (jspec.invariant_attention.MIN_KEYS).
CASES = [(4, 16, 1), (8, 64, 2), (4, 4, 1)]
MORE_CASES = [(1, 64, 1), (8, 64, 1)]
SPECS = {"chain": SpecConfig.chain(4), "tree": SpecConfig(4, 4, 12)}
FAST = [("eagle3", "tree", 4), ("eagle3", "chain", 1)]
MORE = [("ngram", "chain", 1), ("eagle1", "tree", 4), ("mtp", "chain", 1), ("medusa", "tree", 1),
        ("dflash", "chain", 4)]


def invariance(target, prompt, cases):
    c, p = target.config, target.serving_params
    P, ps = len(prompt), 8
    block = [5, 17, 33, 71, 9, 12, 40, 41]

    @jax.jit
    def run(tokens, prompts, lengths, table):
        cache = kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim, table, table.size, ps,
                               c.dtype)
        pos = jnp.broadcast_to(jnp.arange(prompts.shape[1]), prompts.shape)
        _, _, cache = llama.forward(c, p, prompts, pos, cache)
        cache = cache.replace(lengths=lengths)
        T = tokens.shape[1]
        h, _, cache = llama.forward(c, p, tokens, lengths[:, None] + jnp.arange(T), cache)
        page, slot = table[0, P // ps], P % ps              # row 0's first block position
        kv = jnp.stack([cache.k_pages[:, :, page, slot], cache.v_pages[:, :, page, slot]])
        return kv, llama.logits(c, p, h[:1, 0])[0]

    def row0(T, M, B):
        table = np.arange(B * M).reshape(B, M)
        prompts = np.array([prompt, prompt[::-1]][:B])
        tokens = np.array([block[:T], block[::-1][:T]][:B])
        kv, logits = run(jnp.asarray(tokens), jnp.asarray(prompts),
                         jnp.full((B,), P, jnp.int32), jnp.asarray(table))
        return np.asarray(kv), np.asarray(logits)

    kv1, l1 = row0(1, 16, 1)
    out = {}
    for T, M, B in cases:
        kv, logits = row0(T, M, B)
        out[f"{T}-{M}-{B}"] = {"kv_equal": bool(np.array_equal(kv, kv1)),
                               "max_logit_diff": float(np.abs(logits - l1).max())}
    return out


def tree_node_diff(target):
    """The largest difference between a verify tree's node's attention output and its
    1-token step's after its path was decoded in sequence (SmolLM2's head shapes), compiled
    as ``target``'s programs are."""
    from jspec.invariant_attention import compiler_options, invariant_attend
    KVH, G, D = 3, 3, 64
    parent = [-1, 0, 0, 1, 1, 2, 3, 5]
    T, live, S = len(parent), 100, 512
    r = np.random.default_rng(4)
    f = lambda *s: r.standard_normal(s).astype(np.float32)
    kp, vp, kn, vn, qn = f(1, KVH, S, D), f(1, KVH, S, D), f(T, KVH, D), f(T, KVH, D), \
        f(T, KVH, G, D)
    run = jax.jit(invariant_attend, static_argnums=4,
                  compiler_options=compiler_options(target.serving_params))
    path = lambda t: [] if t < 0 else path(parent[t]) + [t]
    k, v = kp.copy(), vp.copy()
    k[0, :, live:live + T], v[0, :, live:live + T] = kn.swapaxes(0, 1), vn.swapaxes(0, 1)
    vis = np.zeros((1, T, S), bool)
    vis[0, :, :live] = True
    for t in range(T):
        vis[0, t, [live + a for a in path(t)]] = True
    tree = np.asarray(run(jnp.asarray(qn[None]), jnp.asarray(k), jnp.asarray(v),
                          jnp.asarray(vis)[:, None, None], D))[0]
    worst = 0.0
    for t in range(T):
        k1, v1 = kp.copy(), vp.copy()
        for j, a in enumerate(path(t)):
            k1[0, :, live + j], v1[0, :, live + j] = kn[a], vn[a]
        vis1 = np.zeros((1, 1, S), bool)
        vis1[0, 0, :live + len(path(t))] = True
        step = run(jnp.asarray(qn[None, t:t + 1]), jnp.asarray(k1), jnp.asarray(v1),
                   jnp.asarray(vis1)[:, None, None], D)
        worst = max(worst, float(np.abs(np.asarray(step)[0, 0] - tree[t]).max()))
    return worst


def lp_diff(tokens, logprobs, plain):
    """The largest difference of two runs' logprobs of the tokens they share."""
    return max(abs(a.logprob - b.logprob)
               for ra, rb, ta, tb in zip(plain.logprobs, logprobs, plain.tokens, tokens)
               for a, b, x, y in zip(ra, rb, ta, tb) if x == y)


def exact(target, prompts, cases):
    """Per case: whether the speculative tokens equal plain decoding's, and the largest
    difference between the two runs' logprobs of the tokens they share before any parting."""
    out, diffs = {}, {}
    for kind, spec, size in cases:
        ps = prompts[:1] if size == 1 else prompts[1:5]
        limits = [32] if size == 1 else [32, 9, 21, 14]
        plain = jspec.generate(target, ps, max_new_tokens=limits, stop_ids=[], logprobs=0)
        res = jspec.generate(target, ps, max_new_tokens=limits, stop_ids=[], logprobs=0,
                             drafter=drafter_of(kind, target.config), spec=SPECS[spec])
        name = f"{kind}-{spec}-{size}"
        out[name] = res.tokens == plain.tokens
        diffs[name] = lp_diff(res.tokens, res.logprobs, plain)
    return out, diffs


def engine_vs_plain(eng, prompts, limits, plain) -> dict:
    """The engine's greedy run of ``prompts`` (``limits`` new tokens each) against plain
    ``generate``'s ``plain``: each row's first parting (None: equal), the largest difference
    of the two runs' logprobs of a token they share, and the largest of its logprobs from its
    echo scoring of prompt + output (a prefill in a program of its own)."""
    done = eng.generate([Request(p, n, stop_ids=[], id=i, logprobs=0)
                         for i, (p, n) in enumerate(zip(prompts, limits))])
    tokens = [c.tokens for c in done]
    echo = [eng.score(p + c.tokens)[len(p):] for p, c in zip(prompts, done)]
    return {"partings": [first_parting(a, b) for a, b in zip(tokens, plain.tokens)],
            "logprob_diff": lp_diff(tokens, [c.logprobs for c in done], plain),
            "score_diff": max(abs(a.logprob - b.logprob) for c, e in zip(done, echo)
                              for a, b in zip(c.logprobs, e))}


def engine(target, prompts):
    """The serving engine's speculative output against plain ``generate``, per spec."""
    ps, limits = prompts[1:5], [32, 9, 21, 14]
    plain = jspec.generate(target, ps, max_new_tokens=limits, stop_ids=[], logprobs=0)
    out = {}
    for spec in ("chain", "tree"):
        eng = Engine(target, drafter_of("eagle3", target.config), slots=2, spec=SPECS[spec],
                     max_new_tokens=32, chunk=3, logprobs_k=0)
        r = engine_vs_plain(eng, ps, limits, plain)
        out[spec] = {"exact": all(k is None for k in r["partings"]), **r}
    return out


def main(argv=None) -> int:
    stories, dst, *which = argv if argv is not None else sys.argv[1:]
    cases = json.loads((Path(stories) / "reference_greedy.json").read_text())["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    target = jspec.load_target(stories, quantize="w8a8")
    every = which == ["all"]
    equal, diffs = exact(target, prompts, FAST + (MORE if every else []))
    doc = {"invariance": invariance(target, prompts[0], CASES + (MORE_CASES if every else [])),
           "exact": equal, "logprob_diff": diffs, "engine": engine(target, prompts),
           "tree_node_diff": tree_node_diff(target)}
    Path(dst).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
