"""``response_format`` dicts (OpenAI's, and jspec's regex / choice / grammar) -> the regular
expression a token automaton is built from, checked before anything compiles.

- ``{"type": "text"}`` or None: unconstrained;
- ``{"type": "json_object"}``: any JSON object (outlines-core's regex for ``{"type":
  "object"}``, nesting bounded as it bounds it);
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``: outlines-core's
  ``build_regex_from_schema`` with numeric bounds enforced (:mod:`jspec.grammar.schema`; no
  recursion: a regular grammar);
- ``{"type": "regex", "regex": "..."}``;
- ``{"type": "choice", "choices": ["a", "b"]}``: exactly one of the strings;
- ``{"type": "grammar", "grammar": "..."}``: a context-free grammar in llguidance's Lark
  dialect, which no finite table holds: :func:`to_lark` gives it to the host path
  (:mod:`jspec.grammar.host`).
"""

from __future__ import annotations

import re
from typing import Any

from jspec.grammar.automaton import GrammarError
from jspec.grammar.schema import schema_regex

TYPES = ("text", "json_object", "json_schema", "regex", "choice", "grammar")


def _need(fmt: dict, key: str, kind, what: str):
    v = fmt.get(key)
    if not isinstance(v, kind) or (isinstance(v, (str, list, dict)) and not v):
        raise GrammarError(f"response_format of type {fmt['type']!r} needs {what}")
    return v


def to_regex(fmt: Any) -> str | None:
    """The regex ``fmt`` constrains output to, or None for unconstrained output."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise GrammarError('response_format must be an object with a "type" '
                           f"(one of {', '.join(TYPES)})")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_regex({"type": "object"})
    if kind == "json_schema":
        spec = _need(fmt, "json_schema", dict, 'a "json_schema" object')
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError('response_format json_schema needs a "schema" object')
        return schema_regex(schema)
    if kind == "regex":
        rx = _need(fmt, "regex", str, 'a non-empty "regex" string')
        try:
            re.compile(rx)
        except re.error as e:
            raise GrammarError(f"bad regex {rx!r}: {e}") from None
        return rx
    if kind == "choice":
        choices = _need(fmt, "choices", list, 'a non-empty "choices" list')
        if not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("response_format choices must be non-empty strings")
        return "(" + "|".join(re.escape(c) for c in choices) + ")"
    if kind == "grammar":
        raise GrammarError("a context-free grammar (type 'grammar') has no regex: it runs on "
                           "the host matcher (jspec.grammar.formats.to_lark)")
    raise GrammarError(f"unknown response_format type {kind!r} (one of {', '.join(TYPES)})")


def to_lark(fmt: Any) -> str | None:
    """The Lark grammar of a ``{"type": "grammar"}`` format (the host path), or None for every
    other format (those have a regex: :func:`to_regex`)."""
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        return _need(fmt, "grammar", str, 'a non-empty "grammar" string (Lark)')
    return None
