"""JSON schema -> regex, with what outlines-core leaves out filled in or refused.

outlines-core's ``build_regex_from_schema`` ignores numeric bounds (``minimum``, ``maximum``
and their exclusive forms): its integer regex allows any integer, so output could parse and
still fail validation. Here every bounded number is swapped for a placeholder string before
outlines-core sees the schema, and the placeholder in its regex is replaced by a regex of
exactly the allowed numbers (:func:`integer_regex`, :func:`number_regex`). Keywords no regex
here enforces (``multipleOf``, ``uniqueItems``, ``not``, fractional or exclusive bounds on a
``number``) are refused with a :class:`GrammarError` rather than silently ignored.
"""

from __future__ import annotations

import json
import math

from jspec.grammar.automaton import GrammarError

REFUSED = ("multipleOf", "uniqueItems", "not", "if", "dependentSchemas", "patternProperties")
PLACEHOLDER = "JSPECBOUND{}X"


def _same_length(a: str, b: str) -> list[str]:
    """Regex alternatives for the decimal strings from ``a`` to ``b`` of one length."""
    if a == b:
        return [a]
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [a[0] + x for x in _group(_same_length(a[1:], b[1:]))]
    n = len(a) - 1
    out = [a[0] + x for x in _group(_same_length(a[1:], "9" * n))]
    lo, hi = int(a[0]) + 1, int(b[0]) - 1
    if lo <= hi:
        out.append((f"[{lo}-{hi}]" if lo < hi else str(lo)) + f"[0-9]{{{n}}}")
    out += [b[0] + x for x in _group(_same_length("0" * n, b[1:]))]
    return out


def _group(alts: list[str]) -> list[str]:
    return alts if len(alts) == 1 else ["(" + "|".join(alts) + ")"]


def _naturals(lo: int, hi: int | None) -> list[str]:
    """Alternatives for the integers in ``[lo, hi]`` (``lo >= 0``; ``hi`` None: unbounded),
    written without leading zeros."""
    out = []
    top = len(str(hi)) if hi is not None else len(str(lo))
    for d in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (d - 1) if d > 1 else 0)
        b = 10 ** d - 1 if hi is None else min(hi, 10 ** d - 1)
        if a <= b:
            out += _same_length(str(a), str(b))
    if hi is None:
        out.append(f"[1-9][0-9]{{{top},}}")
    return out


def _alts(parts: list[str]) -> str:
    if not parts:
        raise GrammarError("a numeric range with no value in it (minimum above maximum)")
    return "(" + "|".join(parts) + ")"


def integer_regex(lo: int | None, hi: int | None) -> str:
    """The integers in ``[lo, hi]`` (None: unbounded), as JSON writes them."""
    parts = []
    if hi is None or hi >= 0:
        parts += _naturals(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:
        top = None if lo is None else -lo
        low = 1 if hi is None or hi >= 0 else -hi
        if top is None or low <= top:
            parts.append("-" + _alts(_naturals(low, top)))
    return _alts(parts)


def number_regex(lo: int | None, hi: int | None) -> str:
    """The JSON numbers (no exponent) in ``[lo, hi]``, integral bounds (None: unbounded)."""
    frac, zeros = r"(\.[0-9]+)?", r"(\.0+)?"

    def magnitude(a: int, b: int | None) -> list[str]:      # m in [a, b], a >= 0
        if b is None:
            return [_alts(_naturals(a, None)) + frac]
        out = [_alts(_naturals(a, b - 1)) + frac] if a <= b - 1 else []
        return out + [str(b) + zeros]

    parts = []
    if hi is None or hi >= 0:
        parts += magnitude(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:
        top = None if lo is None else -lo
        if hi is not None and hi < 0:
            neg = magnitude(-hi, top)
        else:            # (0, top]: a fraction of zero, or 1 and up
            neg = [r"0\.[0-9]*[1-9][0-9]*"] + (magnitude(1, top) if top is None or top >= 1
                                                else [])
        parts.append("-" + _alts(neg))
    return _alts(parts)


def _bounds(node: dict, integral: bool):
    lo, hi = node.get("minimum"), node.get("maximum")
    xlo, xhi = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    if not integral and (xlo is not None or xhi is not None or
                         any(v is not None and v != int(v) for v in (lo, hi))):
        raise GrammarError("a number's bounds must be inclusive integers here "
                           f"(got {json.dumps({k: node[k] for k in node if 'imum' in k})}); "
                           "use an integer, or round the bounds")
    if integral:       # the tightest integer bounds each keyword gives
        los = ([math.ceil(lo)] if lo is not None else []) + \
            ([math.floor(xlo) + 1] if xlo is not None else [])
        his = ([math.floor(hi)] if hi is not None else []) + \
            ([math.ceil(xhi) - 1] if xhi is not None else [])
        lo, hi = max(los, default=None), min(his, default=None)
    return (None if lo is None else int(lo)), (None if hi is None else int(hi))


def _rewrite(node, found: dict):
    """``node`` with bounded numbers replaced by placeholders (their regexes in ``found``)."""
    if isinstance(node, list):
        return [_rewrite(x, found) for x in node]
    if not isinstance(node, dict):
        return node
    bad = [k for k in REFUSED if k in node]
    if bad:
        raise GrammarError(f"JSON schema keyword {bad[0]!r} cannot be enforced by a regular "
                           "grammar here; drop it or use a regex")
    kind = node.get("type")
    if kind in ("integer", "number") and any(k in node for k in (
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        lo, hi = _bounds(node, kind == "integer")
        key = PLACEHOLDER.format(len(found))
        found[key] = integer_regex(lo, hi) if kind == "integer" else number_regex(lo, hi)
        return {"const": key}
    out = {}
    for k, v in node.items():
        if k in ("properties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _rewrite(sub, found) for name, sub in v.items()}   # names, not keywords
        elif k in ("const", "enum", "default", "examples"):
            out[k] = v
        else:
            out[k] = _rewrite(v, found)
    return out


def schema_regex(schema: dict) -> str:
    """The regex of ``schema``'s JSON texts (outlines-core's, bounds enforced)."""
    from outlines_core.json_schema import build_regex_from_schema
    found: dict[str, str] = {}
    rewritten = _rewrite(schema, found)
    try:
        regex = build_regex_from_schema(json.dumps(rewritten))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"unsupported JSON schema: {e}") from None
    for key, sub in found.items():
        lit = f'"{key}"'
        if lit not in regex:
            raise GrammarError(f"internal: bound placeholder {key} not found in the regex")
        regex = regex.replace(lit, sub)
    return regex
