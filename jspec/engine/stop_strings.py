"""Stop strings, matched on the host over each request's decoded text.

The device stops a row at stop *ids*; a stop string may span tokens, and a token may end
inside a multi-byte character, so strings are matched between chunks on the text decoded
so far (its trailing replacement characters, a character still incomplete, left out).

What a match means, chosen so that it never depends on the chunk size or the speculation
(the same tokens always give the same cut):

- the request stops at the first stop string to complete in the stream: the shortest
  prefix of its tokens whose text holds one; within that text, the occurrence that ends
  first wins (ties: the one that starts first, the longer string);
- its text is cut before the stop string; its tokens keep everything up to and including
  the token that completed the match (so the text a caller sees is a prefix of what the
  kept tokens decode to);
- while streaming, the longest suffix of the text that is the start of some stop string is
  held back until the next tokens settle it: text is never streamed and then retracted.
"""

from __future__ import annotations

from typing import Sequence

from jspec.decode import CACHE_FULL, MAX_NEW_TOKENS, NONFINITE, STOP_TOKEN

# A device row's stop reason as the finish_reason a caller sees (OpenAI's words); a stop
# string gives "stop" too, and Engine.cancel "cancelled".
FINISH_REASONS = {STOP_TOKEN: "stop", MAX_NEW_TOKENS: "length", CACHE_FULL: "length",
                  NONFINITE: "error"}


def check_stop(stop, rid, tokenizer) -> tuple[str, ...]:
    """Request ``rid``'s ``stop`` (None, a string or strings) as a tuple; ``ValueError`` for
    an empty string, a non-string, or stop strings on a target without a ``tokenizer``."""
    who = f"request {rid}"
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str):
            raise ValueError(f"{who}: stop strings must be str, got {s!r}")
        if not s:
            raise ValueError(f"{who}: an empty stop string would match at once")
    if stops and tokenizer is None:
        raise ValueError(f"{who}: stop strings need a target with a tokenizer (use stop_ids)")
    return stops


def first_match(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """``(start, end)`` of the occurrence in ``text`` that ends first (ties: starts first),
    or None. A string's first occurrence is also the one of it that ends first."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
            best = (i, i + len(s))
    return best


def held(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string."""
    for n in range(min(len(text), max(map(len, stops), default=1) - 1), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


def stable(tokenizer, ids) -> str:
    """The text of ``ids`` without its trailing replacement characters (a multi-byte
    character the next tokens may complete)."""
    return tokenizer.decode([int(t) for t in ids]).rstrip("\ufffd")


def match_tokens(tokenizer, ids, start: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """``(k, text)`` when ``ids`` hold a stop string: the first ``k`` tokens are the
    shortest prefix whose text holds one, ``text`` that prefix's text cut before it; None
    when there is none. ``start``: tokens already checked (their text held none).
    One decode when nothing matches; one per new token only when something did."""
    if not stops or first_match(stable(tokenizer, ids), stops) is None:
        return None
    for k in range(start + 1, len(ids) + 1):
        text = stable(tokenizer, ids[:k])
        hit = first_match(text, stops)
        if hit is not None:
            return k, text[:hit[0]]
    # Only a decoder that revises earlier text gets here (a match spanning the old tokens
    # and none in any prefix of the new ones): cut at the match in the whole text.
    text = stable(tokenizer, ids)
    return len(ids), text[:first_match(text, stops)[0]]


class TextStream:
    """One request's streamed text: :meth:`step` gives what is new since the last call,
    holding back a possible start of a stop string until ``final``."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(stops)
        self.sent = ""                 # the text streamed so far

    def step(self, text: str, final: bool = False) -> str:
        """The new part of ``text`` (the whole stable text, or the cut text when final).
        Text the decoder revises is not streamed again (rare; the completion holds the
        final text)."""
        keep = text if final or not self.stops else text[:len(text) - held(text, self.stops)]
        if not keep.startswith(self.sent):
            return ""
        delta, self.sent = keep[len(self.sent):], keep
        return delta
