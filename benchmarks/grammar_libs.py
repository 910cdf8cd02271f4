"""Why jspec's device path uses outlines-core: the grammar libraries on the same schemas and
vocabulary, side by side.

* **outlines-core** compiles a regex (``build_regex_from_schema``) into an ``Index``, the
  whole token-level automaton up front (``get_transitions``). That is what a device table
  needs; a mask is then one lookup, for every tree node at once, inside the compiled loop.
* **llguidance** (an Earley parser over a lexer) builds a matcher quickly and computes each
  mask lazily on the host (``LLMatcher.compute_bitmask``, then ``consume_token``); it takes
  context-free grammars too. Its automaton is not exported, so each tree node costs a mask
  computed on the host per iteration.
* **xgrammar** needs torch at import; not measured here.

Per schema: outlines-core's build seconds and states, llguidance's matcher build and its
mean microseconds per mask along one valid output (the tokens a tree of N nodes would need N
of, every verify pass).

``python -m jspec.bench grammar-libs --model smollm2``
"""

from __future__ import annotations

import json
import time

import numpy as np

from jspec.bench.registry import Command, run_module


def add_args(s) -> None:
    s.add_argument("--model", default="smollm2")
    s.add_argument("--limit", type=int, default=8, help="JSON schemas to measure")


def llguidance_row(lltok, schema: dict, tokens: list[int], V: int) -> dict:
    import llguidance
    import llguidance.numpy as lnp
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    build = time.perf_counter() - t0
    if m.is_error():
        return {"llg build s": build, "llg error": m.get_error()[:60]}
    mask = lnp.allocate_token_bitmask(1, V)
    t0 = time.perf_counter()
    n = 0
    for t in tokens:
        lnp.fill_next_token_bitmask(m, mask, 0)
        if not m.consume_token(t):
            break
        n += 1
    per = (time.perf_counter() - t0) / max(n, 1)
    return {"llg build s": build, "llg us/mask": 1e6 * per, "llg masks": n}


def main(a) -> None:
    try:
        import llguidance
    except ImportError:
        raise SystemExit("bench grammar-libs compares against llguidance: pip install llguidance")

    import jspec
    from benchmarks.grammar_formats import SCHEMAS
    from jspec.bench import common
    from jspec.fetch import resolve_model
    from jspec.grammar import compile_regex
    from jspec.grammar.schema import schema_regex
    target = jspec.load_target(resolve_model(a.model))
    tok, V = target.tokenizer, target.config.vocab_size
    lltok = llguidance.LLTokenizer(tok.tok.to_str(), n_vocab=V, eos_token=2)
    rows = []
    for what, schema in SCHEMAS[:a.limit]:
        t0 = time.perf_counter()
        auto = compile_regex(schema_regex(schema), tok, V, [2])
        oc_s = time.perf_counter() - t0
        # One valid output: the automaton's own greedy-shortest walk would do, but a real
        # answer is what a server sees; generate one with the target, constrained.
        res = jspec.generate(target, [[1] + tok.encode(json.dumps(schema), bos=False)[:32]],
                             max_new_tokens=96, stop_ids=[2], response_format={
                                 "type": "json_schema", "json_schema": {"schema": schema}})
        toks = [t for t in res.tokens[0] if t != 2]
        row = {"schema": what, "tokens": len(toks), "oc states": auto.num_states,
               "oc build s": oc_s, "oc table KB": auto.nbytes / 1e3}
        row.update(llguidance_row(lltok, schema, toks, V))
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = ["schema", "tokens", "oc states", "oc build s", "oc table KB", "llg build s",
            "llg us/mask", "llg masks"]
    print(common.format_table(rows, cols))
    per = np.mean([r["llg us/mask"] for r in rows if "llg us/mask" in r])
    print(f"llguidance: {per:.0f} us per mask on the host; a (5, 4, 8) tree needs 8 a verify "
          f"pass: {8 * per / 1e3:.2f} ms of host work per iteration, plus the round trip")


COMMAND = Command("grammar-libs", "outlines-core vs llguidance on the same schemas: build time, "
                  "states, host microseconds per mask", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
