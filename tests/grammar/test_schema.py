"""JSON schema -> regex (jspec.grammar.schema): numeric bounds, which outlines-core ignores,
are enforced exactly; keywords no regular grammar here enforces are refused, not ignored."""

import json
import random
import re

import jsonschema
import pytest

from jspec.grammar import GrammarError
from jspec.grammar.schema import integer_regex, number_regex, schema_regex


def test_integer_and_number_ranges_are_exact():
    rng = random.Random(0)
    for _ in range(200):
        lo = rng.choice([None, rng.randint(-1200, 1200)])
        hi = rng.choice([None, rng.randint(-1200, 1200)])
        if lo is not None and hi is not None and lo > hi:
            lo, hi = hi, lo
        ints, nums = re.compile(integer_regex(lo, hi)), re.compile(number_regex(lo, hi))
        inside = lambda v: (lo is None or v >= lo) and (hi is None or v <= hi)
        for v in range(-2500, 2500, 7):
            assert bool(ints.fullmatch(str(v))) == inside(v), (lo, hi, v)
        for v in (x / 4 for x in range(-5000, 5000, 13)):
            text = str(int(v)) if v == int(v) else repr(v)
            assert bool(nums.fullmatch(text)) == inside(v), (lo, hi, text)
        for bad in ("-0", "007", "1e3", "+5"):
            assert not ints.fullmatch(bad)


def test_bounds_in_a_schema_are_enforced():
    schema = {"type": "object", "required": ["age", "score", "not"],
              "properties": {"age": {"type": "integer", "minimum": 0, "exclusiveMaximum": 121},
                             "score": {"type": "number", "minimum": 0, "maximum": 1},
                             "not": {"type": "string"}}}      # a property named like a keyword
    rx = re.compile(schema_regex(schema))
    for doc, ok in [({"age": 120, "score": 0.5, "not": "x"}, True),
                    ({"age": 121, "score": 0.5, "not": "x"}, False),
                    ({"age": 12, "score": 1.5, "not": "x"}, False),
                    ({"age": 0, "score": 1, "not": ""}, True)]:
        text = json.dumps(doc)
        assert bool(rx.fullmatch(text)) == ok, text
        if ok:
            jsonschema.validate(doc, schema)


@pytest.mark.parametrize("schema,match", [
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "number", "exclusiveMinimum": 0}, "inclusive integers"),
    ({"type": "number", "maximum": 0.5}, "inclusive integers"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "no value"),
])
def test_unenforceable_keywords_are_refused(schema, match):
    with pytest.raises(GrammarError, match=match):
        schema_regex(schema)
