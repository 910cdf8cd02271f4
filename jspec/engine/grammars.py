"""The engine's grammars: every automaton its slots use, stacked in one device table that
the compiled programs read (:mod:`jspec.grammar.device`), and each slot's state beside its
row (``SlotState.grammar_state``; 0, the free state, for a slot without a grammar).

An automaton joins the table when a request that needs it is inserted; the ones already in
keep their state offsets, so the states of live slots stay valid, while the token classes are
refined anew (a host rebuild, then one upload). The table's shape is rounded up to powers of
two, so the programs recompile only when it outgrows its bucket. Once it would pass
:data:`COMPACT_AT` states, the automata no live slot uses are dropped and the live slots'
states renumbered.

A request with a context-free grammar (:mod:`jspec.grammar.host`) sits in the free state; its
matcher is the slot's row of the engine's host session, opened with the first such request
and kept for the engine's life. From then on every insert and decode carries the slots'
recent tokens (``SlotState.grammar_host``); a decode makes the host callback only while some
slot's row is ``active`` (holds a matcher), and rows without one get every token allowed.
"""

from __future__ import annotations

import weakref

import jax.numpy as jnp
import numpy as np

from jspec.grammar import host
from jspec.grammar.constraint import compile_row, padded_state
from jspec.grammar.device import state_offsets

COMPACT_AT = 4096


class SlotGrammars:
    def __init__(self, vocab_size: int, slots: int, width: int):
        self.vocab_size = vocab_size
        self.slots = slots
        self.width = width                # recent tokens a host row keeps (max depth + 1)
        self.automata: list = []          # in offset order
        self.tables = None                # a GrammarState (its ``state`` unused), or None
        self.of_slot: dict[int, object] = {}
        self.session: int | None = None   # the host session, once a request needed one

    def _offsets(self) -> dict[int, int]:
        return state_offsets(self.automata)[0]  # the offsets padded_state's table uses

    def _rebuild(self) -> None:
        self.tables = padded_state(self.automata, self.vocab_size,
                                   always=self.session is not None)

    def initial(self, slot: int, automaton) -> tuple[int, dict | None]:
        """``(the slot's initial state, a renumbering {old: new} of live states or None)``
        for a request with ``automaton`` (None: unconstrained; or a host grammar) inserted
        into ``slot``."""
        self.of_slot.pop(slot, None)
        if isinstance(automaton, host.HostGrammar) and self.session is None:
            self.session = host.open_session([None] * self.slots, self.vocab_size)
            # The engine has no close(): its matchers go when it does.
            weakref.finalize(self, host.close_session, self.session)
            self._rebuild()
        if self.session is not None:
            host.session(self.session).set_row(
                slot, automaton if isinstance(automaton, host.HostGrammar) else None)
        if automaton is None or isinstance(automaton, host.HostGrammar):
            return 0, None
        renumber = None
        if all(a is not automaton for a in self.automata):
            total = 1 + sum(a.num_states - 1 for a in self.automata) + automaton.num_states
            if total > COMPACT_AT:
                renumber = self._compact()
            self.automata.append(automaton)
            self._rebuild()
        self.of_slot[slot] = automaton
        return self._offsets()[id(automaton)] + automaton.initial, renumber

    def _compact(self) -> dict:
        """Drop the automata no live slot uses; ``{old state: new state}`` for the kept ones'
        states (and the free state)."""
        old = self._offsets()
        used = {id(a) for a in self.of_slot.values()}
        self.automata = [a for a in self.automata if id(a) in used]
        new = self._offsets()
        mapping = {0: 0}
        for a in self.automata:
            for s in range(a.num_states - 1):
                mapping[old[id(a)] + s] = new[id(a)] + s
        return mapping

    def release(self, slot: int) -> None:
        self.of_slot.pop(slot, None)
        if self.session is not None:
            host.session(self.session).set_row(slot, None)


def renumbered(states: np.ndarray, mapping: dict, dead: int) -> np.ndarray:
    """Live slots' states under a compaction's ``mapping`` (unknown: ``dead``)."""
    return np.asarray([mapping.get(int(s), dead) for s in states], np.int32)


def automaton_for(target, req):
    """The compiled (cached) automaton of ``req.response_format``, or None; a bad format, or
    one with no stop id to end on, raises :class:`jspec.grammar.GrammarError`."""
    stops = req.stop_ids if req.stop_ids is not None else target.config.eos_token_ids
    return compile_row(target, req.response_format, stops, f"request {req.id}")


def grammar_kw(tables) -> dict:
    """The programs' ``grammar=`` keyword, left out when there is none: a call that names it
    and one that does not are two entries of jit's cache, and ``Engine.warm`` names none."""
    return {} if tables is None else {"grammar": tables}


def insert_grammar(grammars: SlotGrammars, slot: int, automaton, state):
    """``(the insert's grammar argument or None, the engine state)``: ``slot``'s automaton
    registered, and the live slots' states renumbered if the table was compacted."""
    init, mapping = grammars.initial(slot, automaton)
    if grammars.tables is None:
        return None, state
    if mapping is not None:
        dead = grammars.tables.next_state.shape[0] - 1
        states = renumbered(np.asarray(state.grammar_state), mapping, dead)
        state = state.replace(grammar_state=jnp.asarray(states))
    rows = None
    if grammars.session is not None:
        rows = host.rows_state(grammars.session, [slot], grammars.width,
                               [isinstance(automaton, host.HostGrammar)])
        if state.grammar_host is None:
            state = state.replace(grammar_host=host.rows_state(
                grammars.session, range(grammars.slots), grammars.width,
                [False] * grammars.slots))
    return grammars.tables.replace(state=jnp.asarray([init], jnp.int32), host=rows), state
