"""Structured output in the compiled loops (stories260K, a real model with a llama2.c
tokenizer): every output matches its grammar; greedy constrained speculative decoding equals
greedy constrained plain decoding token for token, for every drafter kind, chain and tree,
batch 1 and a ragged batch with unconstrained rows beside constrained ones (which decode as
if alone); an oracle drafter that knows the constrained answer is accepted all the way (the
grammar state follows accepted paths, bonus tokens included)."""

import itertools
import re

import jax
import numpy as np
import pytest
from helpers.oracle_runs import oracle_run
from helpers.tiny_targets import KINDS, drafter_of

import jspec
from jspec.drafters import ngram_drafter
from jspec.grammar import GrammarError
from jspec.spec_config import SpecConfig

EOS = 2
REGEX = r"Once upon a time, there was a (cat|dog|bird|little girl)\. (She|He|It) (liked|loved|saw) [a-z]+( [a-z]+){0,3}\."
CHOICE = ["happy", "sad", "sleepy"]
FORMATS = {"regex": {"type": "regex", "regex": REGEX},
           "choice": {"type": "choice", "choices": CHOICE},
           "json": {"type": "json_schema", "json_schema": {"name": "pet", "schema": {
               "type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                "kind": {"enum": ["cat", "dog"]}},
               "required": ["name", "kind"]}}}}
PROMPTS = ["Once upon a time", "The cat was", "Lily and Tom went to the park.", "One day"]
SPECS = {"chain": SpecConfig.chain(4), "tree": SpecConfig(4, 4, 12)}
NEW = 48


@pytest.fixture(scope="module")
def target(stories_dir):
    return jspec.load_target(stories_dir)


def matches(fmt, text: str) -> bool:
    if fmt["type"] == "regex":
        return re.fullmatch(fmt["regex"], text) is not None
    if fmt["type"] == "choice":
        return text in fmt["choices"]
    import json
    import jsonschema
    jsonschema.validate(json.loads(text), fmt["json_schema"]["schema"])
    return True


@pytest.mark.parametrize("name", list(FORMATS))
def test_outputs_match_their_grammar(target, name):
    fmt = FORMATS[name]
    for kw in ({}, {"temperature": 1.0, "seed": 3}):
        res = jspec.generate(target, PROMPTS, max_new_tokens=NEW, stop_ids=[EOS],
                             response_format=fmt, **kw)
        for toks, text, st in zip(res.tokens, res.text, res.stats):
            assert st["stop_reason"] == "stop_token" and toks[-1] == EOS, (text, st)
            assert matches(fmt, text), text


def combos():
    for kind, spec, size in itertools.product(
            KINDS, SPECS, [1, 4]):
        fast = (kind, spec, size) in {("eagle3", "tree", 4), ("ngram", "chain", 1),
                                      ("medusa", "tree", 1), ("dflash", "chain", 4)}
        yield pytest.param(kind, spec, size, id=f"{kind}-{spec}-{size}",
                           marks=() if fast else (pytest.mark.slow,))


@pytest.mark.parametrize("kind,spec,size", list(combos()))
def test_greedy_speculative_equals_constrained_plain(target, kind, spec, size):
    prompts = PROMPTS[:size]
    fmts = [FORMATS["regex"], None, FORMATS["json"], FORMATS["choice"]][:size]
    limits = [NEW, 20, NEW, 9][:size]
    plain = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[EOS],
                           response_format=fmts)
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[EOS],
                         response_format=fmts, drafter=drafter_of(kind, target.config),
                         spec=SPECS[spec])
    assert res.tokens == plain.tokens
    if size > 1:     # the unconstrained row decodes as if alone
        alone = jspec.generate(target, prompts[1:2], max_new_tokens=20, stop_ids=[EOS])
        assert plain.tokens[1] == alone.tokens[0]


@pytest.mark.parametrize("spec", list(SPECS))
def test_oracle_of_the_constrained_answer_is_accepted_whole(target, spec):
    """A drafter that knows the constrained greedy answer: every verify keeps its whole
    path, so the states of accepted nodes and bonus tokens are exercised, not just rejections."""
    want, res = oracle_run(target, PROMPTS[:2], [FORMATS["regex"], FORMATS["json"]],
                           SPECS[spec], NEW, EOS)
    assert res.tokens == want.tokens
    S = SPECS[spec].num_steps
    for st in res.stats:
        assert st["mean_accept_len"] > S, st["accept_hist"]


def test_unconstrained_output_would_not_match(target):
    """The tests above are not vacuous: unconstrained, the model writes something else."""
    res = jspec.generate(target, PROMPTS[:1], max_new_tokens=NEW, stop_ids=[EOS])
    assert not re.fullmatch(REGEX, res.text[0])


def test_bad_requests_fail_before_compiling(target):
    with pytest.raises(GrammarError, match="no stop ids"):
        jspec.generate(target, PROMPTS[:1], stop_ids=[], response_format=FORMATS["choice"])
    with pytest.raises(GrammarError, match="2 rows for 1"):
        jspec.generate(target, PROMPTS[:1], response_format=[FORMATS["choice"]] * 2)
    with pytest.raises(GrammarError, match="forced_accept"):
        jspec.generate(target, PROMPTS[:1], response_format=FORMATS["choice"],
                       drafter=ngram_drafter(target.config), forced_accept=2.0)
    with pytest.raises(ValueError, match="profile"):
        jspec.generate(target, PROMPTS[:1], response_format=FORMATS["choice"],
                       drafter=ngram_drafter(target.config), profile=True)


def test_drafts_follow_the_grammar(target):
    """EAGLE's drafter masks each path by its own state: even a random head then drafts
    the grammar's narrow stretches right, where unmasked it almost never is."""
    import dataclasses
    d = drafter_of("eagle3", target.config)
    kw = dict(max_new_tokens=NEW, stop_ids=[EOS], response_format=FORMATS["json"],
              spec=SPECS["tree"])
    masked = jspec.generate(target, PROMPTS, drafter=d, **kw)
    free = type(d.module)
    blind = dataclasses.replace(d, module=type("Blind", (free,), {"masks_drafts": False})(
        **{f.name: getattr(d.module, f.name) for f in dataclasses.fields(d.module)}))
    unmasked = jspec.generate(target, PROMPTS, drafter=blind, **kw)
    assert masked.tokens == unmasked.tokens
    accept = lambda r: np.mean([s["mean_accept_len"] for s in r.stats])
    assert accept(masked) > 2.0 > 1.2 > accept(unmasked), (accept(masked), accept(unmasked))


@pytest.mark.parametrize("kind", [None, "eagle3"])
def test_engine_serves_each_request_its_own_grammar(target, kind):
    """Requests with different grammars (and none) through 2 slots, refilled as rows finish:
    each equals generate alone with its format, and the table grows without touching live
    rows' states."""
    from jspec.engine import Engine, Request
    fmts = [FORMATS["regex"], None, FORMATS["json"], FORMATS["choice"], FORMATS["json"]]
    limits = [NEW, 20, NEW, 9, 30]
    prompts = PROMPTS + PROMPTS[:1]
    want = [jspec.generate(target, [p], max_new_tokens=n, stop_ids=[EOS], response_format=f
                           ).tokens[0] for p, n, f in zip(prompts, limits, fmts)]
    d = None if kind is None else drafter_of(kind, target.config)
    eng = Engine(target, d, slots=2, max_new_tokens=NEW, spec=SPECS["tree"] if d else None)
    done = eng.generate([Request(p, n, stop_ids=[EOS], response_format=f)
                         for p, n, f in zip(prompts, limits, fmts)])
    assert [c.tokens for c in done] == want
    with pytest.raises(GrammarError):
        eng.check(Request("x", 4, response_format={"type": "regex", "regex": "(a"}))


def test_runner_records_take_grammars(target, stories_dir, tmp_path):
    """``python -m jspec run``: ``response_format``, ``regex`` and ``choices`` per record; a
    bad grammar is that record's error, the others are served."""
    import argparse
    import json
    from jspec.engine import runner
    recs = [{"id": "rx", "prompt": PROMPTS[0], "regex": REGEX},
            {"id": "ch", "prompt": PROMPTS[1], "choices": CHOICE},
            {"id": "js", "prompt": PROMPTS[2], "response_format": FORMATS["json"]},
            {"id": "free", "prompt": PROMPTS[3], "max_new_tokens": 8},
            {"id": "bad", "prompt": PROMPTS[0], "regex": "(a"}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = argparse.ArgumentParser()
    runner.add_args(p)
    args = p.parse_args(["--model", str(stories_dir), "--input", str(src), "--output", str(dst),
                         "--slots", "2", "--no-progress", "--max-new-tokens", str(NEW)])
    assert runner.run(args, target=target) == 0
    out = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert re.fullmatch(REGEX, out["rx"]["text"]) and out["ch"]["text"] in CHOICE
    assert matches(FORMATS["json"], out["js"]["text"])
    assert "bad regex" in out["bad"]["error"] and "text" in out["free"]


def test_generate_cli_takes_a_grammar(stories_dir, tmp_path, capsys):
    """``python -m jspec generate --regex / --choices / --json-schema / --response-format /
    --grammar``,
    and a bad one is one line on stderr with status 2."""
    import json
    from jspec.cli import main
    base = ["generate", "--model", str(stories_dir), "--prompt", PROMPTS[0], "--no-stream",
            "--json", "--max-new-tokens", str(NEW)]
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(FORMATS["json"]["json_schema"]["schema"]))
    for flags, fmt in ((["--regex", REGEX], FORMATS["regex"]),
                       (["--choices", ",".join(CHOICE)], FORMATS["choice"]),
                       (["--json-schema", str(schema)], FORMATS["json"]),
                       (["--response-format", json.dumps(FORMATS["choice"])], FORMATS["choice"])):
        assert main(base + flags) == 0
        out = json.loads(capsys.readouterr().out)
        assert matches(fmt, out["text"][0]), (flags, out["text"])
    lark = tmp_path / "g.lark"
    lark.write_text('start: "(" inner ")"\ninner: "cat" | "(" inner ")"\n')
    assert main(base + ["--grammar", str(lark)]) == 0
    text = json.loads(capsys.readouterr().out)["text"][0]
    assert re.fullmatch(r"(\(+)cat(\)+)", text) and text.count("(") == text.count(")"), text
    assert main(base + ["--response-format", "{nope"]) == 2
    assert "not JSON" in capsys.readouterr().err
