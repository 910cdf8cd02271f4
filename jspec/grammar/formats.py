"""``response_format`` dicts (OpenAI's, and jspec's regex / choice / grammar) -> the regular
expression a token automaton is built from, checked before anything compiles.

- ``{"type": "text"}`` or None: unconstrained;
- ``{"type": "json_object"}``: any JSON object (outlines-core's regex for ``{"type":
  "object"}``, nesting bounded as it bounds it);
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``: outlines-core's
  ``build_regex_from_schema`` with numeric bounds enforced (:mod:`jspec.grammar.schema`); a
  recursive schema (a ``$ref`` cycle: trees, nested lists) is not regular, and outlines-core
  would silently cut its nesting at a fixed depth, so it goes to the host path instead
  (llguidance's ``%json``, nesting unbounded);
- ``{"type": "regex", "regex": "..."}``;
- ``{"type": "choice", "choices": ["a", "b"]}``: exactly one of the strings;
- ``{"type": "grammar", "grammar": "..."}``: a context-free grammar in llguidance's Lark
  dialect, which no finite table holds: :func:`to_lark` gives it to the host path
  (:mod:`jspec.grammar.host`).
"""

from __future__ import annotations

import json
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
    """The Lark grammar of a format that runs on the host path (a ``{"type": "grammar"}``, or a
    recursive JSON schema), or None for every other format (those have a regex:
    :func:`to_regex`)."""
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "grammar":
        return _need(fmt, "grammar", str, 'a non-empty "grammar" string (Lark)')
    spec = fmt.get("json_schema") if fmt.get("type") == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if isinstance(schema, dict) and recursive(schema):
        return json_lark(schema)
    return None          # a malformed json_schema: to_regex says what is wrong


def json_lark(schema: dict) -> str:
    """The Lark grammar of JSON valid against ``schema`` (llguidance's ``%json``), read as the
    device path reads it: separators fixed as ``json.dumps`` writes them (with llguidance's
    default, any whitespace anywhere, a weak model pads with newlines until it runs out of
    tokens), and an object with ``properties`` but no ``additionalProperties`` closed, as
    outlines-core (and OpenAI's strict mode) close it; open, a model keeps adding keys."""
    style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return "start: %json " + json.dumps({**_closed(schema), "x-guidance": style})


_NAMED = ("properties", "patternProperties", "$defs", "definitions")   # name -> schema maps
_DATA = ("enum", "const", "default", "examples")                      # values, not schemas


def _closed(node):
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in _DATA:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: _closed(sub) for name, sub in v.items()}
        else:
            out[k] = _closed(v)
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def recursive(schema: dict) -> bool:
    """Whether a local ``$ref`` (``#/...``) of ``schema`` reaches itself."""
    def resolve(ref: str):
        node = schema
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node

    def walk(node, refs: frozenset) -> bool:
        if isinstance(node, list):
            return any(walk(v, refs) for v in node)
        if not isinstance(node, dict):
            return False
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref in refs:
                return True
            try:
                if walk(resolve(ref), refs | {ref}):
                    return True
            except (KeyError, IndexError, ValueError, TypeError):
                pass                  # a dangling ref: the schema compiler reports it
        return any(walk(v, refs) for k, v in node.items() if k != "$ref")
    return walk(schema, frozenset())
