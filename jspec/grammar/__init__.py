"""Structured output: a ``response_format`` (JSON schema, JSON object, regex, choice) compiled
to a token-level automaton whose tables live on the device, so that plain and speculative
decoding mask every position by its own grammar state inside the compiled loop; a
context-free grammar (type ``grammar``) runs on a host matcher instead (:mod:`.host`).

``compile_format(response_format, tokenizer, vocab_size, stop_ids)`` returns a
:class:`TokenAutomaton` or a :class:`HostGrammar` (cached: a repeated format compiles once);
:mod:`jspec.grammar.device` holds what the loops call. See docs/structured_output.md.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Sequence

from jspec.grammar.automaton import GrammarError, TokenAutomaton, from_index
from jspec.grammar.formats import to_lark, to_regex
from jspec.grammar.host import HostGrammar, compile_lark
from jspec.grammar.vocab import token_bytes

__all__ = ["GrammarError", "TokenAutomaton", "HostGrammar", "compile_format", "compile_regex",
           "to_regex", "to_lark",
           "token_bytes", "CACHE_STATS"]

_CACHE: collections.OrderedDict = collections.OrderedDict()
_VOCABS: dict = {}
_LOCK = threading.Lock()
CACHE_SIZE = 64
# Builds and hits since start-up, and the seconds the builds took (what bench grammar reads).
CACHE_STATS = collections.Counter()


def _vocabulary(tokenizer, vocab_size: int):
    """outlines-core's Vocabulary of ``tokenizer`` (built once per tokenizer): token bytes ->
    ids, over the model's ``vocab_size`` (ids past the tokenizer's are never allowed); its
    EOS id is ``vocab_size``, which :func:`from_index` turns into the stop class."""
    key = (id(tokenizer), vocab_size)
    if key not in _VOCABS:
        from outlines_core import Vocabulary
        ids: dict[bytes, list[int]] = {}
        for i, b in enumerate(list(token_bytes(tokenizer))[:vocab_size]):
            if b:                        # None (special) and empty tokens add no text
                ids.setdefault(b, []).append(i)
        _VOCABS[key] = (tokenizer, Vocabulary(vocab_size, ids))   # keeps the tokenizer alive
    return _VOCABS[key][1]


def compile_regex(regex: str, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> TokenAutomaton:
    """The automaton of ``regex`` over ``tokenizer``'s tokens (uncached)."""
    from outlines_core import Index
    t0 = time.perf_counter()
    try:
        index = Index(regex, _vocabulary(tokenizer, vocab_size))
    except (ValueError, RuntimeError) as e:
        raise GrammarError(f"cannot build a token automaton for this grammar: {e}") from None
    a = from_index(index, vocab_size, stop_ids, source=regex)
    CACHE_STATS["builds"] += 1
    CACHE_STATS["build_s"] += time.perf_counter() - t0
    return a


def compile_format(response_format: Any, tokenizer, vocab_size: int,
                   stop_ids: Sequence[int]) -> TokenAutomaton | HostGrammar | None:
    """``response_format``'s automaton, or its host grammar for a context-free one (None:
    unconstrained), from a cache keyed by the format, the tokenizer and the stop ids."""
    lark = to_lark(response_format)
    regex = to_regex(response_format) if lark is None else None
    if regex is None and lark is None:
        return None
    if tokenizer is None:
        raise GrammarError("structured output needs the target's tokenizer")
    key = (regex, lark, id(tokenizer), vocab_size, tuple(sorted(stop_ids)))
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            CACHE_STATS["hits"] += 1
            return _CACHE[key]
    if lark is not None:
        a = compile_lark(lark, tokenizer, vocab_size, stop_ids)
    else:
        a = compile_regex(regex, tokenizer, vocab_size, stop_ids)
    with _LOCK:
        _CACHE[key] = a
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return a

