"""What the plan calls: a request's ``response_format`` (one for every row, or one per row)
checked and compiled on the host, then the rows' grammars stacked into one device table whose
shape is rounded up, so that other schemas of similar size reuse the compiled decoder."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.grammar import compile_format, device, host
from jspec.grammar.automaton import GrammarError, TokenAutomaton


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


def row_formats(response_format: Any, B: int) -> list:
    """One format per row: ``response_format`` is one format (a dict or None) or a list of
    them, one per row."""
    if isinstance(response_format, (list, tuple)):
        if len(response_format) != B:
            raise GrammarError(f"response_format has {len(response_format)} rows for {B} "
                               "prompts")
        return list(response_format)
    return [response_format] * B


def padded_state(grammars, vocab_size: int, always: bool = False
                 ) -> device.GrammarState | None:
    """The device state of a batch's grammars (None when no row has one: then nothing
    grammar-related is traced), the table rounded up to power-of-two states and classes (at
    least 64 and 128): the padding rows are dead, the padding classes unused. Rows with a
    :class:`jspec.grammar.HostGrammar` get a host session (closed by :func:`close`).
    ``always``: a (free) table even without a grammar (the engine's, once it has host rows)."""
    if all(a is None for a in grammars) and not always:
        return None
    automata = [a if isinstance(a, TokenAutomaton) else None for a in grammars]
    on_host = [isinstance(a, host.HostGrammar) for a in grammars]
    rows = None
    if any(on_host):
        sid = host.open_session([a if h else None for a, h in zip(grammars, on_host)],
                                vocab_size)
        rows = host.rows_state(sid, range(len(grammars)), active=on_host)
    table, classes, initial = device.stack(automata, vocab_size)
    S, C = table.shape
    Sp, Cp = _bucket(S, 64), _bucket(C, 128)
    dead = Sp - 1
    out = np.full((Sp, Cp), dead, np.int32)
    out[:S, :C] = np.where(table == S - 1, dead, table)
    return device.GrammarState(jnp.asarray(out), jnp.asarray(classes),
                               jnp.asarray(device.forced_tokens(out, classes)),
                               jnp.asarray(initial), rows)


def close(g: device.GrammarState | None, result=None) -> None:
    """Once ``result`` (the run that used ``g``) is computed, ``g``'s host matchers, if any,
    are dropped."""
    if g is not None and g.host is not None:
        jax.block_until_ready(result)
        host.close_session(int(g.host.session))


def compile_row(target, fmt, stops, who: str):
    """The (cached) automaton of one row's or request's ``fmt`` ending on ``stops``, or None
    for no format; refused when there is no stop id to end on."""
    if fmt is None:
        return None
    if not stops:
        raise GrammarError(f"{who} has a response_format but no stop ids: a constrained row "
                           "ends on a stop id once its grammar is complete")
    return compile_format(fmt, target.tokenizer, target.config.vocab_size, list(stops))


def plan_grammar(target, response_format, stops: np.ndarray, B: int, Bc: int, *, mesh=None,
                 forced_accept: float = 0.0) -> device.GrammarState | None:
    """The device grammars of a batch of ``B`` real rows padded to ``Bc`` (``stops [B, W]``:
    each row's stop ids, -1 padded; they are what an accepting state allows), or None."""
    formats = row_formats(response_format, B)
    if all(f is None for f in formats):
        return None
    if mesh is not None:
        raise GrammarError("response_format is not supported on a mesh yet; run constrained "
                           "requests on one device")
    if forced_accept:
        raise GrammarError("forced_accept (a benchmark mode whose output is not the target's) "
                           "cannot be combined with response_format")
    V = target.config.vocab_size
    automata = [compile_row(target, f, [int(t) for t in stops[r] if t >= 0], f"row {r}")
                for r, f in enumerate(formats)]
    return padded_state(automata + [None] * (Bc - B), V)
