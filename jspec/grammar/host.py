"""Context-free grammars on the host: one llguidance matcher per row, asked from inside the
compiled loop (``jax.experimental.io_callback``) for the masks of the positions a step
decides, with no change to the loop's shape or to its other rows.

A context-free grammar (``{"type": "grammar", "grammar": LARK}``: recursion, nesting without
a bound) has no finite token automaton, so it cannot be a table on the device
(:mod:`jspec.grammar.device`). Instead:

- the device carries, per row, the last ``K`` tokens it emitted and how many it has emitted
  (:class:`HostRows`; the emitting code records them as it records device states);
- each verify pass (each step, in plain decoding) makes one callback with the draft tree:
  the row's matcher first consumes the tokens emitted since the last call (what was
  accepted), then walks the tree node by node (consume the path, fill the node's mask, roll
  back), so each node's logits are masked by its own path's grammar state, as the device
  path masks them;
- the masks come back as llguidance's packed bitmask ``[B, N, ceil(V / 32)]`` and are
  unpacked on the device.

Only programs whose batch holds such a grammar trace the callback; a program without one is
unchanged. Drafts are not masked (the drafter drafts freely; a draft the grammar forbids is
simply never accepted), and no tokens are forced. Sessions (one per ``generate`` call or
engine) live in a registry the callback looks up by number, so one compiled program serves
every session of its shape.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.grammar.automaton import GrammarError
from jspec.grammar.vocab import token_bytes
from jspec.shapes import Bool, Int


def _need_llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("context-free grammars (type 'grammar') need llguidance: "
                           "pip install llguidance") from None
    return llguidance


class _ByteTokenizer:
    """What llguidance's ``TokenizerWrapper`` reads: each token's bytes (a special token, which
    is not text, as ``\\xff`` + its name, llguidance's convention), the stop ids as EOS, and
    an encoder for the grammar's literal strings."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        pieces = list(token_bytes(tokenizer))[:vocab_size]
        pieces += [None] * (vocab_size - len(pieces))
        self.tokens = [b if b else b"\xff<jspec_special_%d>" % i for i, b in enumerate(pieces)]
        self.special_token_ids = [i for i, b in enumerate(pieces) if not b]
        self.eos_token_id = int(stop_ids[0])
        self.bos_token_id = getattr(tokenizer, "bos_id", None)
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        """Tokens whose bytes are exactly ``text``'s (llguidance tokenizes the stretches a
        grammar forces with it): the tokenizer's own encoding where it spells the text back
        (byte-level BPE), else the longest known piece at each step (a SentencePiece
        tokenizer would prepend its dummy-prefix space)."""
        data = text if isinstance(text, bytes) else text.encode()
        try:
            ids = list(self._tokenizer.encode(data.decode(), bos=False, eos=False))
        except Exception:   # not UTF-8, or a piece the tokenizer lacks (its dummy-prefix space)
            ids = None
        if ids is not None and b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._longest_pieces(data)

    def _longest_pieces(self, data: bytes) -> list[int]:
        if not hasattr(self, "_by_bytes"):
            # The highest id of equal pieces: a SentencePiece vocabulary's merged piece, not
            # its byte-fallback token (``<0x4F>`` and ``O``), which its tokenizer never emits.
            self._by_bytes = {b: i for i, b in enumerate(self.tokens)
                              if not b.startswith(b"\xff")}
            self._longest = max(map(len, self._by_bytes))
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                if data[i:i + n] in self._by_bytes:
                    out.append(self._by_bytes[data[i:i + n]])
                    i += n
                    break
            else:
                raise GrammarError(f"no token spells byte {data[i]:#x} of {data!r}")
        return out


_TOKENIZERS: dict = {}
_TOKENIZERS_LOCK = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int, stop_ids: Sequence[int]):
    """llguidance's tokenizer over the model's ``vocab_size`` ids whose EOS are ``stop_ids``
    (the grammar allows them once complete), built once per (tokenizer, stop ids)."""
    llg = _need_llguidance()
    key = (id(tokenizer), vocab_size, tuple(sorted(stop_ids)))
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            wrapped = llg.TokenizerWrapper(_ByteTokenizer(tokenizer, vocab_size, stop_ids))
            _TOKENIZERS[key] = (tokenizer, llg.LLTokenizer(wrapped, n_vocab=vocab_size,
                                                           eos_token=sorted(stop_ids)))
        return _TOKENIZERS[key][1]


@dataclasses.dataclass(frozen=True, eq=False)
class HostGrammar:
    """A checked context-free grammar for one tokenizer and set of stop ids."""
    grammar: str          # llguidance's grammar (from ``LLMatcher.grammar_from_lark``)
    tokenizer: Any        # llguidance.LLTokenizer
    source: str

    def matcher(self):
        import llguidance
        return llguidance.LLMatcher(self.tokenizer, self.grammar)


def compile_lark(lark: str, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> HostGrammar:
    """``lark`` (llguidance's Lark dialect: rules, ``/regex/`` terminals, ``%json {...}``)
    checked against the tokenizer; a bad grammar raises :class:`GrammarError`."""
    llg = _need_llguidance()
    lltok = ll_tokenizer(tokenizer, vocab_size, stop_ids)
    grammar = llg.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error:
        raise GrammarError(f"bad grammar: {messages[0]}")
    return HostGrammar(grammar, lltok, lark)


# ----------------------------------------------------------------------- the host side
class Session:
    """The matchers of one batch's rows (None: no host grammar), and how many of each row's
    emitted tokens they have consumed."""

    def __init__(self, grammars: Sequence[HostGrammar | None], vocab_size: int):
        self.matchers = [None if g is None else g.matcher() for g in grammars]
        self.consumed = [0] * len(grammars)
        self.words = (vocab_size + 31) // 32
        self.lock = threading.Lock()
        self.calls = 0            # callbacks served (what the tests and benchmarks read)

    def set_row(self, row: int, grammar: HostGrammar | None) -> None:
        """A new request in ``row`` (the engine's slot): a fresh matcher, nothing consumed."""
        with self.lock:
            self.matchers[row] = None if grammar is None else grammar.matcher()
            self.consumed[row] = 0

    @staticmethod
    def _check(m) -> None:
        # A failed matcher (llguidance catches its own panics) would allow only the stop ids:
        # a silently truncated answer. Fail the step instead.
        if m.is_error():
            raise RuntimeError(f"grammar matcher failed: {m.get_error()}")

    def _catch_up(self, r: int, m, recent: np.ndarray, count: int) -> None:
        new = count - self.consumed[r]
        if new > recent.shape[0]:
            raise RuntimeError(f"row {r} emitted {new} tokens since its grammar's last mask, "
                               f"more than the {recent.shape[0]} the loop keeps")
        for t in recent[recent.shape[0] - new:] if new > 0 else ():
            if not m.is_stopped():          # tokens past the stop id are never output
                m.consume_token(int(t))
        self._check(m)
        self.consumed[r] = count

    def _fill(self, m, path: list[int], out: np.ndarray) -> None:
        """``out [W]``: the mask after ``path``, or every token where the path leaves the
        grammar (a refused draft: never accepted, so its mask does not matter)."""
        import llguidance.numpy as lnp
        took = m.try_consume_tokens(path) if path else 0
        if took == len(path):        # a complete grammar's matcher allows its stop ids only
            lnp.fill_next_token_bitmask(m, out[None], 0)
        else:
            out[:] = -1
        self._check(m)
        if took:
            m.rollback(took)

    def masks(self, index, recent, count, tokens, parents) -> np.ndarray:
        """``[B, N, W]`` packed masks of each batch row's tree; batch row ``b`` is the
        session's row ``index[b]`` (the engine's slot), all tokens allowed where that row has
        no matcher."""
        B, N = tokens.shape
        out = np.full((B, N, self.words), -1, np.int32)
        with self.lock:
            self.calls += 1
            for r, row in enumerate(index):
                m = self.matchers[row]
                if m is None:
                    continue
                self._catch_up(row, m, recent[r], int(count[r]))
                for n in range(N):
                    path, k = [], n
                    while k > 0 and parents[r, k] >= 0:     # node 0 (the root) is consumed
                        path.append(int(tokens[r, k]))
                        k = int(parents[r, k])
                    if k == 0:                               # else: a node cut off its tree
                        self._fill(m, path[::-1], out[r, n])
        return out


_SESSIONS: dict[int, Session] = {}
_IDS = itertools.count(1)
_LOCK = threading.Lock()


def open_session(grammars: Sequence[HostGrammar | None], vocab_size: int) -> int:
    s = Session(grammars, vocab_size)
    with _LOCK:
        sid = next(_IDS)
        _SESSIONS[sid] = s
    return sid


def session(sid: int) -> Session:
    with _LOCK:
        if sid not in _SESSIONS:
            raise RuntimeError(f"grammar session {sid} is closed (its run outlived it)")
        return _SESSIONS[sid]


def close_session(sid: int) -> None:
    with _LOCK:
        _SESSIONS.pop(int(sid), None)


def _masks_callback(sid, index, recent, count, tokens, parents):
    return session(int(sid)).masks(*(np.asarray(a) for a in (index, recent, count, tokens,
                                                             parents)))


# --------------------------------------------------------------------- the device side
@struct.dataclass
class HostRows:
    session: Int[""]
    index: Int["B"]          # each batch row's row in the session (the engine's slot)
    recent: Int["B K"]       # each row's last K emitted tokens, the newest last
    count: Int["B"]          # tokens each row has emitted
    active: Bool["B"]        # the row has a matcher: without any, no callback is made


def rows_state(sid: int, index: Sequence[int], width: int = 1,
               active: Sequence[bool] | None = None) -> HostRows:
    """Batch rows that are the session's rows ``index`` (``active``: which have a matcher;
    default all), nothing emitted yet."""
    B = len(index)
    on = np.ones(B, bool) if active is None else np.asarray(active, bool)
    return HostRows(jnp.asarray(sid, jnp.int32), jnp.asarray(index, jnp.int32),
                    jnp.zeros((B, width), jnp.int32), jnp.zeros((B,), jnp.int32),
                    jnp.asarray(on))


def widened(h: HostRows | None, width: int) -> HostRows | None:
    """``h`` keeping at least ``width`` recent tokens (a speculative pass emits up to its
    depth + 1 between two callbacks)."""
    if h is None or h.recent.shape[1] >= width:
        return h
    return h.replace(recent=jnp.pad(h.recent, ((0, 0), (width - h.recent.shape[1], 0))))


def record(h: HostRows | None, toks: jax.Array, n: jax.Array) -> HostRows | None:
    """``h`` after each row emitted its first ``n [B]`` of ``toks [B, A]``."""
    if h is None:
        return h
    K = h.recent.shape[1]
    both = jnp.concatenate([h.recent, toks.astype(jnp.int32)], 1)
    at = n[:, None] + jnp.arange(K)[None]
    return h.replace(recent=jnp.take_along_axis(both, at, 1), count=h.count + n)


def tree_allowed(h: HostRows, tokens: jax.Array, parents: jax.Array, vocab_size: int
                 ) -> Bool["B N V"]:
    """``[B, N, V]``: the tokens allowed after each node (``tokens``/``parents [B, N]``, node 0
    the root, the row's last emitted token), from the rows' matchers on the host."""
    from jax.experimental import io_callback
    B, N = tokens.shape
    words = jax.ShapeDtypeStruct((B, N, (vocab_size + 31) // 32), jnp.int32)

    def ask():
        return io_callback(_masks_callback, words, h.session, h.index, h.recent, h.count,
                           tokens.astype(jnp.int32), parents.astype(jnp.int32))
    # No round trip while no row has a matcher (an engine whose host-grammar requests are
    # done, a free row's step): every token allowed.
    bits = jax.lax.cond(jnp.any(h.active), ask, lambda: jnp.full(words.shape, -1, jnp.int32))
    return unpack(bits, vocab_size)


def unpack(bits: jax.Array, vocab_size: int) -> Bool["... V"]:
    """llguidance's packed bitmask ``[..., ceil(V / 32)]`` (token ``t``: bit ``t % 32`` of
    word ``t // 32``) as ``[..., V]`` bools."""
    v = jnp.arange(vocab_size)
    return ((jnp.take(bits, v // 32, axis=-1) >> (v % 32)) & 1).astype(bool)
