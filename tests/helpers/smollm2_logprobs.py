"""Logprobs on SmolLM2 against a teacher-forced forward, for ``tests/serve/test_smollm2_server.py``;
run in a subprocess with XLA's full optimisation (``tests/helpers/smollm2_paths.py`` says why).

Three chat prompts of the golden file (ragged lengths, ragged ``max_new_tokens``), greedy with
``logprobs=5``, through plain decoding, a random EAGLE-3 head, n-gram lookup and an oracle
that knows the greedy answer but misses 30% of its drafts (so accepted drafts and bonus tokens
land at every offset of a block), chain and tree, through ``generate``: with fewer slots
than prompts (the engine) but for the oracle (static batches only). Every path is checked with
:func:`helpers.logprob_checks.assert_target_logprobs` (an assertion error is recorded as the
path's failure) and its largest deviations are reported. Also written: each prompt's
teacher-forced logprobs (prompt and greedy output, with the token texts the server sends) for
the server test to compare what it receives with, and ``Engine.score``'s deviation from them.

Run:  python tests/helpers/smollm2_logprobs.py GGUF GOLDEN OUT
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]          # jspec, and the tests' helpers

LIMITS = [24, 12, 18]          # ragged: rows finish at different iterations
K = 5
SLOTS = 2


def _oracle(target, prompts, n):
    import jax
    import numpy as np

    import jspec
    from jspec.drafters import Drafter, Oracle
    longer = jspec.generate(target, prompts, max_new_tokens=n + 8, stop_ids=[])
    fut = np.zeros((len(prompts), 512), np.int32)
    for r, (p, t) in enumerate(zip(prompts, longer.tokens)):
        fut[r, :len(p) + len(t)] = p + t
    return Drafter(Oracle(target.config.vocab_size, miss_rate=0.3),
                   {"future": jax.numpy.asarray(fut)})


def deviation(got, ref) -> dict:
    """Largest |logprob| and |top-k value| differences, top-k id lists that differ."""
    lp = top = 0.0
    ids = 0
    for a, b in zip(got, ref):
        lp = max(lp, abs(a.logprob - b.logprob))
        top = max([top] + [abs(x[1] - y[1]) for x, y in zip(a.top, b.top)])
        ids += [i for i, _ in a.top] != [i for i, _ in b.top]
    return {"max_logprob_diff": lp, "max_top_diff": top, "top_ids_differ": ids}


def main(argv=None) -> int:
    import jax
    import numpy as np

    import jspec
    from jspec.drafters import ngram_drafter, random_drafter
    from jspec.engine import Engine
    from jspec.scoring import teacher_forced
    from jspec.serve.tokens import Tokens
    from jspec.spec_config import SpecConfig
    from helpers.logprob_checks import assert_target_logprobs

    model, golden, dst = argv if argv is not None else sys.argv[1:]
    rows = [r for r in json.loads(Path(golden).read_text())["rows"] if "messages" in r][:3]
    prompts = [r["prompt_ids"] for r in rows]
    target = jspec.load_target(model)
    tokens = Tokens(target)
    plain = jspec.generate(target, prompts, max_new_tokens=max(LIMITS), stop_ids=[])
    refs = [teacher_forced(target, p + list(map(int, t)), K)
            for p, t in zip(prompts, plain.tokens)]

    oracle = _oracle(target, prompts, max(LIMITS))
    # Through the engine (fewer slots than prompts), but the oracle, whose per-row
    # parameters serve generate's static batch only.
    paths = {"plain": {"slots": SLOTS},
             "eagle3-random-chain": {"drafter": random_drafter("eagle3", target.config,
                                                               jax.random.key(3)),
                                     "spec": SpecConfig.chain(3), "slots": SLOTS},
             "ngram": {"drafter": ngram_drafter(target.config), "slots": SLOTS},
             "oracle-chain": {"drafter": oracle, "spec": SpecConfig.chain(4)},
             "oracle-tree": {"drafter": oracle, "spec": SpecConfig(5, 4, 8)}}
    out = {"paths": {}, "rows": []}
    for name, kw in paths.items():
        res = jspec.generate(target, prompts, max_new_tokens=LIMITS, stop_ids=[], logprobs=K,
                             **kw)
        toks = [list(map(int, t)) for t in res.tokens]
        rec = {"tokens_equal_plain": all(t == list(map(int, p))[:len(t)]
                                         for t, p in zip(toks, plain.tokens)),
               "tokens": sum(map(len, toks)),
               "accept_hist": np.sum([s.get("accept_hist", [0]) for s in res.stats],
                                     0).tolist() if "drafter" in kw else None}
        for key in ("max_logprob_diff", "max_top_diff", "top_ids_differ"):
            rec[key] = max(deviation(lp, ref[len(p):])[key]
                           for lp, ref, p in zip(res.logprobs, refs, prompts))
        try:
            assert_target_logprobs(target, prompts, toks, res.logprobs, k=K)
            rec["error"] = None
        except AssertionError:
            rec["error"] = traceback.format_exc(limit=2)[-1500:]
        out["paths"][name] = rec

    engine = Engine(target, slots=SLOTS, max_new_tokens=max(LIMITS), logprobs_k=K)
    score = max(deviation(engine.score(p, K)[1:], ref[1:len(p)])["max_logprob_diff"]
                for p, ref in zip(prompts, refs))
    out["score_max_logprob_diff"] = score
    for r, p, t, ref in zip(rows, prompts, plain.tokens, refs):
        out["rows"].append({
            "messages": r["messages"], "prompt_ids": p, "tokens": list(map(int, t)),
            "text": tokens.decode(t),
            "logprobs": [None if e is None else
                         {"token": tokens.text(e.token), "logprob": e.logprob,
                          "top": [[tokens.text(i), v] for i, v in e.top]} for e in ref]})
    Path(dst).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
