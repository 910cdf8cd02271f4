"""Structured output on SmolLM2 (or any chat model), in one run:

* **valid output:** 20 JSON schemas and 10 regexes (``benchmarks/grammar_formats.py``), each
  asked for in a chat request, greedy and sampled (temperature 0.8); every output is checked
  with ``jsonschema`` / ``re.fullmatch``; each automaton's states, token classes, device bytes
  and build seconds beside it (and the dense ``[states, vocab]`` table it replaces);
  the JSON schemas also greedy on the host path (``host valid``);
* **table sizes at another vocabulary** (``--vocab``: a tokenizer.json or a GGUF, e.g.
  llama.cpp's vocabulary-only ``ggml-vocab-llama-bpe.gguf``, Llama-3's 128,256 tokens);
* **speed**, batch 1 on the JSON requests: unconstrained and constrained plain decoding and
  EAGLE-3 speculation (a trained head with ``--drafter``, else a random one: its drafts are
  right where the grammar narrows the choice), each grammar on the device path (its table)
  and on the host path (the same schema as llguidance's ``%json``); tok/s, accept length,
  the tokens the grammar forced per verify pass, and whether constrained speculation equals
  constrained plain on the same path;
* **the engine at 8 slots** serving the first 8 JSON requests at once, the same cases.

``python -m jspec.bench grammar --model smollm2``
"""

from __future__ import annotations

import json
import re
import time

import numpy as np

from jspec.bench.registry import Command, run_module


def add_args(s) -> None:
    s.add_argument("--model", default="smollm2")
    s.add_argument("--max-new-tokens", type=int, default=160)
    s.add_argument("--batch", type=int, default=8, help="rows per call in the validity pass")
    s.add_argument("--speed-prompts", type=int, default=4)
    s.add_argument("--drafter", default=None, help="an EAGLE-3 head's directory (default: random)")
    s.add_argument("--json", default=None, help="write the rows here")
    s.add_argument("--skip-valid", action="store_true", help="the speed table only")
    s.add_argument("--vocab", default=None, help="also build every automaton over this "
                   "tokenizer (tokenizer.json or GGUF) and report its table sizes")
    s.add_argument("--skip-speed", action="store_true", help="no batch-1 speed table")
    s.add_argument("--engine-slots", type=int, default=8, help="0: skip the engine table")


def valid(fmt, text: str) -> bool:
    if fmt["type"] == "regex":
        return re.fullmatch(fmt["regex"], text) is not None
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), fmt["json_schema"]["schema"])
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def validity(target, reqs, a) -> list[dict]:
    import jspec
    from jspec.grammar import CACHE_STATS, compile_format
    from jspec.messages import stop_ids
    V, stops = target.config.vocab_size, stop_ids(target)
    rows = tables(reqs, target.tokenizer, V, stops)
    hits = CACHE_STATS["hits"]
    compile_format(reqs[0][2], target.tokenizer, V, stops)
    assert CACHE_STATS["hits"] == hits + 1          # a repeated format compiles once
    for label, kw in (("greedy", {}), ("sampled", {"temperature": 0.8, "seed": 7}),
                      ("host", {})):
        for i in range(0, len(reqs), a.batch):
            part = reqs[i:i + a.batch]
            fmts = [f for _, _, f in part]
            if label == "host":        # the JSON schemas on the host path, greedy
                if fmts[0]["type"] != "json_schema":
                    continue
                fmts = [host_of(f) if f["type"] == "json_schema" else f for f in fmts]
            res = jspec.chat(target, [m for _, m, _ in part], max_new_tokens=a.max_new_tokens,
                             response_format=fmts, **kw)
            for j, ((_, _, fmt), text) in enumerate(zip(part, res.texts)):
                if label == "host" and fmt["type"] != "json_schema":
                    continue
                rows[i + j][f"{label} valid"] = valid(fmt, text)
                rows[i + j][f"{label} tokens"] = len(res.result.tokens[j])
                if label == "greedy":
                    rows[i + j]["greedy text"] = text[:60]
    return rows


def load_vocab(path: str):
    """A tokenizer from a tokenizer.json, a llama2.c .bin, or a GGUF (vocabulary-only ones
    included); its vocabulary size."""
    if path.endswith(".gguf"):
        import gguf
        from jspec.checkpoint.gguf_tokenizer import gguf_tokenizer
        tok = gguf_tokenizer(gguf.GGUFReader(path))
    else:
        from jspec.tokenizer import load_tokenizer
        tok = load_tokenizer(path)
    return tok, tok.vocab_size


def tables(reqs, tokenizer, V: int, stops) -> list[dict]:
    """Each format's automaton over ``tokenizer``: states, classes, device bytes, the dense
    ``[states, vocab]`` table it replaces, and its build seconds."""
    from jspec.grammar import compile_format
    rows = []
    for name, _, fmt in reqs:
        t0 = time.perf_counter()
        auto = compile_format(fmt, tokenizer, V, stops)
        rows.append({"format": name, "vocab": V, "states": auto.num_states,
                     "classes": auto.num_classes, "table KB": auto.nbytes / 1e3,
                     "dense MB": auto.num_states * V * 4 / 1e6,
                     "build s": time.perf_counter() - t0})
    return rows


def tables_at(path: str, reqs) -> list[dict]:
    """Each format's automaton over another tokenizer (the end-of-turn stop id: its last id;
    the stop class's size does not depend on which)."""
    tok, V = load_vocab(path)
    return tables(reqs, tok, V, [V - 1])


def host_of(fmt: dict) -> dict:
    """The same JSON schema as a context-free grammar: the host path."""
    from jspec.grammar.formats import json_lark
    return {"type": "grammar", "grammar": json_lark(fmt["json_schema"]["schema"])}


def forced_per_pass(target, fmt, tokens, iterations) -> float:
    """Tokens emitted from states that allow one token only, per verify pass."""
    from jspec.grammar import compile_format
    from jspec.messages import stop_ids
    auto = compile_format(fmt, target.tokenizer, target.config.vocab_size, stop_ids(target))
    s, forced = auto.initial, 0
    for t in tokens:
        forced += int(auto.allowed(s).sum() == 1)
        s = auto.step(s, t)
    return forced / max(iterations, 1)


def drafter_for(target, a):
    import jax
    from jspec.args import load_drafter_arg
    from jspec.drafters import random_drafter
    return (load_drafter_arg(a.drafter, target) if a.drafter else
            random_drafter("eagle3", target.config, jax.random.key(0), vocab_size=8192))


def speed(target, reqs, a, d) -> list[dict]:
    import jspec
    from jspec.timing import round_robin, wall_s
    jsons = [r for r in reqs if r[0].startswith("json")][:a.speed_prompts]
    rows = []
    for name, msgs, fmt in jsons:
        # Every case decodes as many tokens as the constrained answer has (the unconstrained
        # ones with no stop id), so the rates compare the same work, prefill included.
        n = len(jspec.chat(target, msgs, max_new_tokens=a.max_new_tokens,
                           response_format=fmt).result.tokens[0])
        free = {"stop_ids": []}
        cases = {"plain": free, "plain+grammar": {"response_format": fmt},
                 "plain+host": {"response_format": host_of(fmt)},
                 "eagle3": {"drafter": d, **free},
                 "eagle3+grammar": {"drafter": d, "response_format": fmt},
                 "eagle3+host": {"drafter": d, "response_format": host_of(fmt)}}
        calls = {k: (lambda kw=kw: jspec.chat(target, msgs, max_new_tokens=n, **kw).result)
                 for k, kw in cases.items()}
        timed = round_robin(calls, 2, seconds=wall_s)
        base = timed["plain"]
        for k, t in timed.items():
            r = t.result
            n = len(r.tokens[0])
            row = {"format": name, "decoding": k, "tokens": n, "tok/s": n / t.median,
                   "vs plain": (n / t.median) / (len(base.result.tokens[0]) / base.median)}
            if k.startswith("eagle3"):
                st = r.stats[0]
                row["accept"] = st["mean_accept_len"]
            if k == "eagle3+grammar":
                row["forced/pass"] = forced_per_pass(target, fmt, r.tokens[0], st["iterations"])
            if k.startswith("eagle3+"):
                plain = timed["plain+" + k.split("+")[1]].result
                row["== constrained plain"] = r.tokens == plain.tokens
            rows.append(row)
    return rows


def engine_speed(target, reqs, a, d) -> list[dict]:
    """``--engine-slots`` requests served at once, each case decoding the device-path
    constrained answers' lengths (unconstrained: no stop id)."""
    import jspec
    from jspec.engine import Engine, Request
    from jspec.messages import stop_ids
    from jspec.timing import round_robin
    jsons = [r for r in reqs if r[0].startswith("json")][:a.engine_slots]
    msgs = [m for _, m, _ in jsons]
    fmts = [f for _, _, f in jsons]
    lens = [len(t) for t in jspec.chat(target, msgs, max_new_tokens=a.max_new_tokens,
                                       response_format=fmts).result.tokens]
    stops = stop_ids(target)
    by_case = {"": lambda i: {"stop_ids": []},
               "+grammar": lambda i: {"stop_ids": stops, "response_format": fmts[i]},
               "+host": lambda i: {"stop_ids": stops, "response_format": host_of(fmts[i])}}
    calls = {}
    for e, drafter in (("plain", None), ("eagle3", d)):
        for c, kw in by_case.items():
            # An engine per case: each keeps its own steady grammar table (the same 8
            # automata every round) and serves only its own kind of request.
            eng = Engine(target, drafter, slots=len(jsons), max_new_tokens=a.max_new_tokens)
            reqs_ = [Request(messages=m, max_new_tokens=n, **kw(i))
                     for i, (m, n) in enumerate(zip(msgs, lens))]
            calls[e + c] = lambda eng=eng, reqs_=reqs_: eng.generate(reqs_)
    # Two untimed rounds: the first fills each engine's grammar table request by request
    # (its shape grows, and programs recompile, as automata join), the second compiles for
    # the steady table.
    timed = round_robin(calls, 2, warmup=2)
    rows = []
    for k, t in timed.items():
        done = t.result
        n = sum(len(c.tokens) for c in done)
        row = {"decoding": k, "requests": len(done), "tokens": n, "tok/s": n / t.median}
        if k.startswith("eagle3"):
            row["accept"] = float(np.mean([c.stats["mean_accept_len"] for c in done]))
            plain = timed["plain" + k[len("eagle3"):]].result
            row["== plain"] = [c.tokens for c in done] == [c.tokens for c in plain]
        rows.append(row)
    return rows


def main(a) -> None:
    import jax

    import jspec
    from jspec.bench import common
    from jspec.fetch import resolve_model
    from benchmarks.grammar_formats import requests
    target = jspec.load_target(resolve_model(a.model))
    reqs = requests()
    vrows = [] if a.skip_valid else validity(target, reqs, a)
    cols = ["format", "states", "classes", "table KB", "dense MB", "build s", "greedy valid",
            "greedy tokens", "sampled valid", "sampled tokens", "host valid", "host tokens",
            "greedy text"]
    if vrows:
        print(f"{a.model}: {len(reqs)} formats, greedy and sampled (T=0.8), max "
              f"{a.max_new_tokens} new tokens, {a.batch} rows a call")
        print(common.format_table(vrows, cols))
        for label in ("greedy", "sampled", "host"):
            got = [r[f"{label} valid"] for r in vrows if f"{label} valid" in r]
            print(f"{label}: {sum(got)}/{len(got)} valid")
    trows = tables_at(a.vocab, reqs) if a.vocab else []
    if trows:
        print(f"\nthe same formats over {a.vocab}")
        print(common.format_table(trows, ["format", "vocab", "states", "classes", "table KB",
                                          "dense MB", "build s"]))
    d = drafter_for(target, a)
    head = "head " + a.drafter if a.drafter else "random head (8k vocab)"
    # Every phase compiles its own programs (table buckets x paths); dropping the last
    # phase's keeps one process under the kernel's limit on memory maps.
    jax.clear_caches()
    srows = [] if a.skip_speed else speed(target, reqs, a, d)
    jax.clear_caches()
    if srows:
        print(f"\nbatch 1, EAGLE-3 {head}, every case decoding the constrained answer's "
              "length; +grammar: the device path, +host: the same schema on the host path")
        print(common.format_table(srows, ["format", "decoding", "tokens", "tok/s", "vs plain",
                                          "accept", "forced/pass", "== constrained plain"]))
    erows = engine_speed(target, reqs, a, d) if a.engine_slots else []
    if erows:
        print(f"\nthe engine, {a.engine_slots} slots, {a.engine_slots} JSON requests at once, "
              f"EAGLE-3 {head}")
        print(common.format_table(erows, ["decoding", "requests", "tokens", "tok/s", "accept",
                                          "== plain"]))
    if a.json:
        common.write_json(a.json, {"valid": vrows, "tables": trows, "speed": srows,
                                   "engine": erows})


COMMAND = Command("grammar", "structured output: valid JSON/regex output over 30 formats, "
                  "table sizes, and constrained plain vs EAGLE-3 speed", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
