"""A regular grammar as a token-level automaton, stored compactly enough for a 128k vocabulary.

outlines-core compiles a regex against the vocabulary's token bytes into an ``Index``: the
next state for every (state, allowed token). A dense ``[states, vocab]`` table of that would
be tens to hundreds of MiB at 128k tokens, but most tokens behave alike: every token whose
column (its next state from each state) is the same falls in one class. The automaton is
then two small tables (DESIGN.md §4c):

- ``token_class [V]``: each token's class;
- ``next_state [S + 1, C]``: the next state from each state for each class, where row and
  value ``S`` is the dead state (no token allowed, nothing leaves it).

A token is allowed in state ``s`` when ``next_state[s, token_class[t]] != S``. The stop ids
(``<|im_end|>``, EOS) form a class of their own, allowed in accepting states only, where they
leave the state as it is (the row stops on them anyway).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


class GrammarError(ValueError):
    """A grammar that cannot constrain decoding (bad syntax, unsatisfiable, too large)."""


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    next_state: np.ndarray        # int32 [S + 1, C]; S: the dead state
    token_class: np.ndarray       # int32 [V]
    final: np.ndarray             # bool [S + 1]: accepting states (a stop id is allowed)
    initial: int = 0
    source: str = ""              # the regex it was built from

    @property
    def num_states(self) -> int:
        """States, the dead one included."""
        return self.next_state.shape[0]

    @property
    def dead(self) -> int:
        return self.num_states - 1

    @property
    def num_classes(self) -> int:
        return self.next_state.shape[1]

    @property
    def nbytes(self) -> int:
        return self.next_state.nbytes + self.token_class.nbytes + self.final.nbytes

    def allowed(self, state: int) -> np.ndarray:
        """``[V]`` bool: the tokens allowed in ``state``."""
        return self.next_state[state][self.token_class] != self.dead

    def step(self, state: int, token: int) -> int:
        return int(self.next_state[state, self.token_class[token]])

    def accepts(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` (stop ids excluded) spell a complete match."""
        s = self.initial
        for t in tokens:
            s = self.step(s, t)
        return bool(self.final[s])


def _classes(columns, V: int) -> np.ndarray:
    """``[V]`` class ids: tokens with equal columns (next state from every state) share one.
    Each column is folded into a 64-bit hash per token, one vectorised pass per state;
    :func:`from_index` then checks every column against the tables, and a collision (never
    seen, but possible) falls back to exact refinement state by state."""
    h = np.zeros(V, np.uint64)
    for col in columns:
        h = h * np.uint64(0x9E3779B97F4A7C15) + (col.astype(np.uint64) + np.uint64(1)) \
            * np.uint64(0xC2B2AE3D27D4EB4F)
    return np.unique(h, return_inverse=True)[1].astype(np.int32)


def refine(classes: np.ndarray, column: np.ndarray) -> np.ndarray:
    """``[V]`` classes split by one more non-negative per-token ``column``: two tokens stay
    together only if they shared a class and agree on the column."""
    key = classes.astype(np.int64) * (int(column.max()) + 1) + column
    return np.unique(key, return_inverse=True)[1].astype(np.int32)


def representatives(classes: np.ndarray) -> np.ndarray:
    """``[C]``: the first token of each class."""
    first = np.zeros(int(classes.max()) + 1, np.int64)
    first[classes[::-1]] = np.arange(len(classes))[::-1]
    return first


def _refined(columns, V: int) -> np.ndarray:
    classes = np.zeros(V, np.int32)
    for col in columns:
        classes = refine(classes, col)
    return classes


def from_index(index, vocab_size: int, stop_ids: Sequence[int], source: str = "",
               max_states: int = 1 << 16) -> TokenAutomaton:
    """The class-compressed tables of an outlines-core ``Index`` over ``vocab_size`` tokens
    (its EOS id, ``vocab_size``, stands for ``stop_ids``)."""
    transitions = index.get_transitions()
    order = [index.get_initial_state()] + sorted(s for s in transitions
                                                 if s != index.get_initial_state())
    finals = set(index.get_final_states())
    reached = {n for t in transitions.values() for n in t.values()}
    order += sorted((reached | finals) - set(order))
    if len(order) >= max_states:
        raise GrammarError(f"the grammar compiles to {len(order)} states (at most {max_states}); "
                           "bound it more loosely or use a context-free grammar")
    S, V = len(order), vocab_size
    raw = np.asarray(order, np.int64)
    by_raw = np.argsort(raw)
    dense = lambda ids: by_raw[np.searchsorted(raw[by_raw], ids)].astype(np.int32)
    sid = dict(zip(order, range(S)))
    columns = []                         # [V] per state: the next state by token
    for row in transitions.values():
        toks = np.fromiter(row.keys(), np.int64, len(row))
        nxt = dense(np.fromiter(row.values(), np.int64, len(row)))
        keep = toks < V                  # outlines' EOS (id V) is the stop class, below
        col = np.full(V, S, np.int32)
        col[toks[keep]] = nxt[keep]
        columns.append(col)
    final = np.zeros(S + 1, bool)
    final[[sid[f] for f in finals]] = True
    stops = np.asarray([t for t in stop_ids if 0 <= t < V], np.int64)
    if stops.size:                       # text tokens never share a class with the stops
        columns.append(np.isin(np.arange(V), stops).astype(np.int32))
    classes = _classes(columns, V)
    table = _table(columns, classes, [sid[st] for st in transitions], S)
    if table is None:                    # a hash collision: refine exactly
        classes = _refined(columns, V)
        table = _table(columns, classes, [sid[st] for st in transitions], S)
    if stops.size:
        table[:S, classes[stops[0]]] = np.where(final[:S], np.arange(S), S)
    return TokenAutomaton(table, classes, final, 0, source)


def _table(columns, classes: np.ndarray, states, S: int) -> np.ndarray | None:
    """``next_state [S + 1, C]`` from one representative token per class, or None when a
    column disagrees with it (two different columns hashed alike)."""
    first = representatives(classes)
    table = np.full((S + 1, len(first)), S, np.int32)
    for st, col in zip(states, columns):
        table[st] = col[first]
        if not np.array_equal(table[st][classes], col):
            return None
    return table
