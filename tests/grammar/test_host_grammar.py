"""Context-free grammars on the host path (``{"type": "grammar"}``: an llguidance matcher per
row, asked from inside the compiled loop): outputs follow a recursive grammar; greedy
constrained speculative decoding equals greedy constrained plain decoding on the same path,
for every drafter kind, chain and tree, batch 1 and ragged beside device-path and free rows;
an oracle is accepted whole (the matchers catch up by several tokens a pass); the engine
serves host grammars among others; bad grammars fail before anything compiles."""

import itertools
import re

import numpy as np
import pytest
from helpers.oracle_runs import oracle_run
from helpers.tiny_targets import KINDS, drafter_of

import jspec
from jspec.grammar import GrammarError
from jspec.spec_config import SpecConfig

EOS = 2
NEW = 40
# Balanced parentheses: no regex (and no finite table) holds this language.
NESTED = r'''
start: "Once upon a time, there was a " thing "."
thing: noun | noun " (" thing ")"
noun: "cat" | "dog" | "bird" | "little girl" | "ball"
'''
NESTED_FMT = {"type": "grammar", "grammar": NESTED}
REGEX = r"Once upon a time, there was a (cat|dog|bird|little girl)\. (She|He|It) (liked|loved|saw) [a-z]+( [a-z]+){0,3}\."
DEVICE_FMT = {"type": "regex", "regex": REGEX}
HOST_REGEX_FMT = {"type": "grammar", "grammar": "start: /" + REGEX + "/"}
PROMPTS = ["Once upon a time", "The cat was", "One day", "Lily and Tom went to the park."]
SPECS = {"chain": SpecConfig.chain(4), "tree": SpecConfig(4, 4, 12)}


@pytest.fixture(scope="module")
def target(stories_dir):
    return jspec.load_target(stories_dir)


def nested_ok(text: str, complete: bool) -> bool:
    """``text`` is a sentence of NESTED (``complete``) or a prefix of one."""
    head = "Once upon a time, there was a "
    if not complete:
        return head.startswith(text) or text.startswith(head)
    body = text[len(head):-1] if text.startswith(head) and text.endswith(".") else None
    nouns = "(cat|dog|bird|little girl|ball)"
    while body is not None and "(" in body:      # peel one level: noun " (" thing ")"
        m = re.fullmatch(nouns + r" \((.*)\)", body)
        body = m.group(2) if m else None
    return body is not None and re.fullmatch(nouns, body) is not None


def test_outputs_follow_the_recursive_grammar(target):
    for kw in ({}, {"temperature": 1.0, "seed": 5}):
        res = jspec.generate(target, PROMPTS * 2, max_new_tokens=NEW, stop_ids=[EOS],
                             response_format=NESTED_FMT, **kw)
        for text, st in zip(res.text, res.stats):
            done = st["stop_reason"] == "stop_token"
            assert nested_ok(text, done), (text, st)
        assert sum(s["stop_reason"] == "stop_token" for s in res.stats) >= 4
    assert any("(" in t for t in res.text), res.text       # the recursion was taken


@pytest.mark.slow      # HOST_REGEX_FMT is served by the oracle and engine tests by default
def test_a_regex_as_a_host_grammar(target):
    """A regex given as a Lark terminal runs on the host path and its outputs match. (Not
    token for token the device path's: llguidance spells a stretch the grammar forces in the
    tokenizer's own tokens, where the device automaton allows any spelling of it.)"""
    res = jspec.generate(target, PROMPTS[:2], max_new_tokens=NEW + 8, stop_ids=[EOS],
                         response_format=HOST_REGEX_FMT)
    assert all(re.fullmatch(REGEX, t) for t in res.text), res.text


def combos():
    for kind, spec, size in itertools.product(KINDS, SPECS, [1, 3]):
        fast = (kind, spec, size) in {("eagle3", "tree", 3), ("ngram", "chain", 1)}
        yield pytest.param(kind, spec, size, id=f"{kind}-{spec}-{size}",
                           marks=() if fast else (pytest.mark.slow,))


@pytest.mark.parametrize("kind,spec,size", list(combos()))
def test_greedy_speculative_equals_constrained_plain(target, kind, spec, size):
    prompts = PROMPTS[:size]
    fmts = [NESTED_FMT, None, DEVICE_FMT][:size]
    limits = [NEW, 20, NEW][:size]
    plain = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[EOS],
                           response_format=fmts)
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[EOS],
                         response_format=fmts, drafter=drafter_of(kind, target.config),
                         spec=SPECS[spec])
    assert res.tokens == plain.tokens


def test_oracle_of_the_constrained_answer_is_accepted_whole(target):
    want, res = oracle_run(target, PROMPTS[:2], [NESTED_FMT, HOST_REGEX_FMT], SPECS["tree"],
                           NEW, EOS)
    assert res.tokens == want.tokens
    for st in res.stats:
        assert st["mean_accept_len"] > SPECS["tree"].num_steps, st["accept_hist"]


def test_engine_serves_host_grammars_beside_others(target):
    """Host, device and free requests through 2 slots, refilled as rows finish: each equals
    generate alone (the slot's matcher is reset for each request)."""
    from jspec.engine import Engine, Request
    fmts = [NESTED_FMT, None, DEVICE_FMT, HOST_REGEX_FMT, NESTED_FMT]
    limits = [NEW, 12, NEW, NEW, 30]
    prompts = PROMPTS + PROMPTS[2:3]
    want = [jspec.generate(target, [p], max_new_tokens=n, stop_ids=[EOS], response_format=f
                           ).tokens[0] for p, n, f in zip(prompts, limits, fmts)]
    eng = Engine(target, drafter_of("eagle3", target.config), slots=2, max_new_tokens=NEW,
                 spec=SPECS["tree"])
    done = eng.generate([Request(p, n, stop_ids=[EOS], response_format=f)
                         for p, n, f in zip(prompts, limits, fmts)])
    assert [c.tokens for c in done] == want
    # Once no slot holds a host grammar, the engine's steps make no host round trip.
    from jspec.grammar.host import session
    calls = session(eng.grammars.session).calls
    free = eng.generate([Request(p, 8, stop_ids=[EOS]) for p in PROMPTS[:2]])
    assert session(eng.grammars.session).calls == calls
    assert [c.tokens for c in free] == [w[:8] for w in jspec.generate(
        target, PROMPTS[:2], max_new_tokens=8, stop_ids=[EOS]).tokens]


def test_bad_grammars_fail_before_compiling(target):
    with pytest.raises(GrammarError, match="bad grammar"):
        jspec.generate(target, PROMPTS[:1], stop_ids=[EOS],
                       response_format={"type": "grammar", "grammar": "start: missing_rule"})
    with pytest.raises(GrammarError, match="grammar"):
        jspec.generate(target, PROMPTS[:1], stop_ids=[EOS], response_format={"type": "grammar"})
    with pytest.raises(GrammarError, match="no stop ids"):
        jspec.generate(target, PROMPTS[:1], stop_ids=[], response_format=NESTED_FMT)


def test_a_failed_matcher_fails_the_step(target):
    """A matcher in error would allow only the stop ids (a silently cut answer): the step
    raises instead."""
    from jspec.grammar import compile_format
    from jspec.grammar.host import Session
    V = target.config.vocab_size
    s = Session([compile_format(NESTED_FMT, target.tokenizer, V, [EOS])], V)
    bad = target.tokenizer.encode("The", bos=False, eos=False)[0]     # the grammar wants "Once"
    with pytest.raises(RuntimeError, match="matcher failed"):
        s.masks(np.array([0]), np.array([[bad]]), np.array([1]), np.zeros((1, 1), np.int32),
                np.full((1, 1), -1))


def test_a_recursive_json_schema_takes_the_host_path(target):
    """A ``$ref`` cycle is not regular (outlines-core would cut the nesting at a fixed depth):
    it runs on the host path, and complete outputs validate."""
    import json

    import jsonschema
    from jspec.grammar import HostGrammar, compile_format
    tree = {"type": "object", "additionalProperties": False, "required": ["n", "kids"],
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                           "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    V = target.config.vocab_size
    assert isinstance(compile_format(fmt, target.tokenizer, V, [EOS]), HostGrammar)
    res = jspec.generate(target, PROMPTS[:2], max_new_tokens=NEW, stop_ids=[EOS],
                         response_format=fmt, temperature=1.0, seed=3)
    done = [t for t, s in zip(res.text, res.stats) if s["stop_reason"] == "stop_token"]
    assert done, res.text
    for text in done:
        jsonschema.validate(json.loads(text), tree)


def test_host_json_reads_a_schema_as_the_device_path_does(target):
    """On the host path an object with ``properties`` is closed (no extra keys) and the
    separators are json.dumps's, as on the device path; a property named "properties" and
    a ``const`` holding one are left alone."""
    from jspec.grammar import compile_format
    from jspec.grammar.formats import json_lark
    schema = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "integer"},
                             "properties": {"const": {"properties": 1}}}}
    g = compile_format({"type": "grammar", "grammar": json_lark(schema)}, target.tokenizer,
                       target.config.vocab_size, [EOS])

    def takes(text):
        toks = g.tokenizer.tokenize_str(text)
        return g.matcher().try_consume_tokens(toks) == len(toks)
    assert takes('{"a": 1}') and takes('{"a": 1, "properties": {"properties": 1}}')
    assert not takes('{"a": 1, "b"') and not takes('{"a":1}') and not takes('{ "a": 1}')
