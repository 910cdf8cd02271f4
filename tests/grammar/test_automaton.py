"""The token automaton (jspec.grammar): its class-compressed tables give exactly outlines-core's
transitions, masks and accepting states; rows of different grammars stack into one table; bad
formats fail with clear errors before anything compiles; a repeated format compiles once."""

import json
import re

import numpy as np
import outlines_core as oc
import pytest

from jspec.grammar import (CACHE_STATS, GrammarError, compile_format, compile_regex, to_regex,
                           token_bytes)
from jspec.grammar import device
from jspec.grammar.constraint import padded_state
from jspec.tokenizer import load_tokenizer

SMOLLM2_TOKENIZER = "tests/data/tokenizers/smollm2/tokenizer.json"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def smollm2_tok():
    return load_tokenizer(SMOLLM2_TOKENIZER, eos_ids=(2,))


def test_token_bytes_are_what_decoding_appends(smollm2_tok):
    tb = token_bytes(smollm2_tok)
    assert tb[0] is None and tb[2] is None                      # <|endoftext|>, <|im_end|>
    ids = smollm2_tok.encode('{"name": "Élodie", "age": 12}\n', bos=False)
    assert b"".join(tb[i] for i in ids).decode() == '{"name": "Élodie", "age": 12}\n'


def test_tables_equal_outlines_transitions(smollm2_tok):
    """Every (state, token) of the compressed tables against the Index itself."""
    V = 49152
    regex = to_regex({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    a = compile_regex(regex, smollm2_tok, V, stop_ids=[2])
    vocab = {}
    for i, b in enumerate(token_bytes(smollm2_tok)):
        if b:
            vocab.setdefault(b, []).append(i)
    index = oc.Index(regex, oc.Vocabulary(V, vocab))
    trans = index.get_transitions()
    order = [index.get_initial_state()] + sorted(s for s in trans if s != index.get_initial_state())
    assert a.num_states - 1 >= len(order) and a.num_classes < 1000       # << 49152 columns
    for i, s in enumerate(order):
        row = trans[s]
        want = np.zeros(V, bool)
        want[[t for t in row if t < V]] = True
        allowed = a.allowed(i)
        want[2] = V in row                                 # the stop id in accepting states
        assert np.array_equal(allowed, want), s
        for t, nxt in list(row.items())[:50]:
            if t < V:
                assert order[a.step(i, t)] == nxt if nxt in order else True
    assert a.accepts(smollm2_tok.encode('{"name": "Bo", "age": 7}', bos=False))
    assert not a.accepts(smollm2_tok.encode('{"name": "Bo"}', bos=False))
    assert a.nbytes < 400_000


def test_stacked_rows_keep_their_own_grammar(smollm2_tok):
    V = 49152
    digits = compile_regex(r"[0-9]{2}", smollm2_tok, V, [2])
    word = compile_regex(r"(yes|no)", smollm2_tok, V, [2])
    g = padded_state([digits, None, word, digits], V)
    table = np.asarray(g.next_state)
    assert table.shape[0] & (table.shape[0] - 1) == 0 and table.shape[0] >= 64
    states = np.asarray(g.state)
    assert states[1] == 0 and states[0] == states[3] != states[2]
    ok = np.asarray(device.allowed(g, g.state))
    seven, yes = smollm2_tok.encode("7", bos=False)[0], smollm2_tok.encode("yes", bos=False)[0]
    assert ok[1].all()                                      # the free row: everything
    assert ok[0, seven] and not ok[0, yes] and ok[2, yes] and not ok[2, seven]
    assert not ok[0, 2] and not ok[2, 2]                    # no stop before a full match


@pytest.mark.parametrize("fmt,match", [
    ({"type": "regex", "regex": "(ab"}, "bad regex"),
    ({"type": "regex"}, "needs a non-empty"),
    ({"type": "choice", "choices": []}, "needs a non-empty"),
    ({"type": "choice", "choices": ["a", 3]}, "non-empty strings"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "json_schema", "json_schema": "x"}, '"json_schema" object'),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}, "unsupported"),
    ({"type": "grammar", "grammar": "start: a_rule"}, "bad grammar"),
    ({"type": "yaml"}, "unknown response_format type"),
    ("json", "must be an object"),
])
def test_bad_formats_fail_clearly(smollm2_tok, fmt, match):
    with pytest.raises(GrammarError, match=match):
        compile_format(fmt, smollm2_tok, 49152, [2])


def test_unsatisfiable_regex_is_refused(smollm2_tok):
    with pytest.raises(GrammarError, match="cannot build"):
        compile_regex("[a&&b]", smollm2_tok, 49152, [2])      # an empty class


def test_a_repeated_format_compiles_once(smollm2_tok):
    fmt = {"type": "choice", "choices": ["red", "green", "blue"]}
    a = compile_format(fmt, smollm2_tok, 49152, [2])
    builds = CACHE_STATS["builds"]
    assert compile_format(json.loads(json.dumps(fmt)), smollm2_tok, 49152, [2]) is a
    assert CACHE_STATS["builds"] == builds
    assert compile_format(fmt, smollm2_tok, 49152, [0]) is not a     # other stop ids
    assert re.fullmatch(a.source, "green")


def test_a_hash_collision_falls_back_to_exact_classes(smollm2_tok, monkeypatch):
    from jspec.grammar import automaton
    regex = r"(yes|no), [0-9]{2}"
    want = compile_regex(regex, smollm2_tok, 49152, [2])
    monkeypatch.setattr(automaton, "_classes", lambda cols, V: np.zeros(V, np.int32))
    got = compile_regex(regex, smollm2_tok, 49152, [2])
    assert got.num_classes == want.num_classes
    for s in range(want.num_states - 1):
        assert np.array_equal(got.allowed(s), want.allowed(s))
