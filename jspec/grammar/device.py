"""Grammar automata on the device: the tables of every row's grammar in one pytree, and the
lookups the compiled loops make (masks, state steps, the states of a draft tree's nodes).

Rows of one batch may hold different grammars, or none: :func:`stack` puts the automata in
one table, each at its own state offset, over classes refined jointly. State 0 is free (every
token allowed, stop ids included, and it stays 0): a row without a grammar sits there. The
last state is the shared dead state. Everything here is a table lookup, so the masks of all
the tree's nodes cost one gather, inside the loop, with no host round trip.

Rows with a context-free grammar sit in the free state and are masked, in addition, by their
host matchers (``GrammarState.host``, :mod:`jspec.grammar.host`): the functions below that
mask, advance or accept carry them along, so the loops call one API for both paths.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.grammar import host as hostg
from jspec.grammar.automaton import TokenAutomaton, refine, representatives
from jspec.shapes import Bool, Int


@struct.dataclass
class GrammarState:
    next_state: Int["S C"]     # the stacked table; row S - 1 is dead
    token_class: Int["V"]
    forced: Int["S"]           # the one token a state allows, or -1 (none, or several)
    state: Int["B"]            # each row's state after every token it has emitted
    # The rows' host matchers (jspec.grammar.host.HostRows); None: no row has one, and no
    # callback is traced.
    host: Any = None

    @property
    def dead(self):
        return self.next_state.shape[0] - 1


def forced_tokens(table: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """``[S]``: the single token each state allows, or -1 (a stretch the grammar forces:
    drafted for free, see :func:`force_tree`)."""
    dead = table.shape[0] - 1
    sizes = np.bincount(classes, minlength=table.shape[1])
    ok = table != dead
    count = (ok * sizes[None]).sum(1)
    rep = np.zeros(table.shape[1], np.int64)        # padding classes (no token): never picked
    used = representatives(classes)
    rep[:len(used)] = used
    only = rep[np.argmax(ok, 1)]
    return np.where(count == 1, only, -1).astype(np.int32)


def state_offsets(automata: Sequence[TokenAutomaton]) -> tuple[dict[int, int], int]:
    """``(where each distinct automaton's states start, by ``id``, the shared dead state)`` in
    a stacked table: in order of first appearance after state 0, the free state; each one's
    own dead state is the shared one. The engine relies on this order to keep live states
    valid as its table grows."""
    offsets, total = {}, 1
    for a in automata:
        if id(a) not in offsets:
            offsets[id(a)] = total
            total += a.num_states - 1
    return offsets, total


def stack(automata: Sequence[TokenAutomaton | None], vocab_size: int):
    """``(next_state [S, C], token_class [V], initial [B])`` numpy tables for rows whose
    grammars are ``automata`` (None: unconstrained)."""
    present = [a for a in automata if a is not None]
    classes = np.zeros(vocab_size, np.int32)
    for a in present:               # joint classes: tokens alike under every grammar
        if a.token_class.shape[0] != vocab_size:
            raise ValueError(f"a grammar built for {a.token_class.shape[0]} tokens, the "
                             f"model has {vocab_size}")
        classes = refine(classes, a.token_class)
    rep = representatives(classes)
    offsets, dead = state_offsets(present)
    table = np.full((dead + 1, len(rep)), dead, np.int32)
    table[0] = 0
    for a in present:
        o = offsets[id(a)]
        sub = a.next_state[:-1][:, a.token_class[rep]]
        table[o:o + a.num_states - 1] = np.where(sub == a.dead, dead, sub + o)
    initial = np.asarray([0 if a is None else offsets[id(a)] + a.initial for a in automata],
                         np.int32)
    return table, classes.astype(np.int32), initial


def allowed(g: GrammarState, states: jax.Array) -> Bool["..."]:
    """``[..., V]``: the tokens allowed in ``states [...]``. The dead state allows every token
    (a node under a refused draft is never reached; this keeps its logits finite)."""
    rows = g.next_state[states]                            # [..., C]
    ok = jnp.take(rows, g.token_class, axis=-1) != g.dead
    return ok | (states == g.dead)[..., None]


# A forbidden token's logit: finite, so the loops' NaN/inf checks keep meaning a broken model,
# and far enough down that its probability underflows to exactly 0 (exp(-1e30) in f32).
FORBIDDEN = -1e30


def masked(ok: jax.Array, logits: jax.Array) -> jax.Array:
    """``logits`` with the tokens ``ok`` forbids at :data:`FORBIDDEN`. Softmax of the result is
    the target's distribution renormalized over the allowed tokens, which is what every
    sampling path must use (lossless under a grammar)."""
    return jnp.where(ok, logits, jnp.asarray(FORBIDDEN, logits.dtype))


def mask_rows(g: GrammarState | None, logits: jax.Array) -> jax.Array:
    """``logits [B, V]`` masked by each row's current state: the next token's distribution."""
    if g is None:
        return logits
    ok = allowed(g, g.state)
    if g.host is not None:
        root = jnp.zeros(logits.shape[:1], jnp.int32)
        ok &= hostg.tree_allowed(g.host, root[:, None], root[:, None] - 1,
                                 logits.shape[-1])[:, 0]
    return masked(ok, logits)


def widened(g: GrammarState | None, width: int) -> GrammarState | None:
    """``g`` whose host rows keep ``width`` recent tokens (what a loop emits per pass)."""
    return None if g is None else g.replace(host=hostg.widened(g.host, width))


def step(g: GrammarState, states: jax.Array, tokens: jax.Array) -> jax.Array:
    return g.next_state[states, g.token_class[tokens]]


def advance(g: GrammarState | None, tokens: jax.Array, live: jax.Array) -> GrammarState | None:
    """Each live row's state after its new ``tokens [B]``."""
    if g is None:
        return None
    return g.replace(state=jnp.where(live, step(g, g.state, tokens), g.state),
                     host=hostg.record(g.host, tokens[:, None], live.astype(jnp.int32)))


def walk_tree(g: GrammarState, tree, max_depth: int, force: bool = False):
    """``(tokens [B, N], states [B, N])``: each node's state from its own path, depth by depth
    (the root, already counted in the row's state, at the row's state; a node at its parent's
    stepped by its token). ``force``: a node whose parent's state allows one token only
    takes that token first (:func:`force_tree`)."""
    s = jnp.broadcast_to(g.state[:, None], tree.tokens.shape)
    toks = tree.tokens
    parent = jnp.maximum(tree.parents, 0)
    for d in range(1, max_depth + 1):
        up = jnp.take_along_axis(s, parent, 1)
        at = tree.depths == d
        if force:
            f = g.forced[up]
            toks = jnp.where(at & (f >= 0), f, toks)
        s = jnp.where(at, step(g, up, toks), s)
    return toks, s


def node_states(g: GrammarState, tree, max_depth: int) -> Int["B N"]:
    """The state at each node of a draft tree (:func:`walk_tree`)."""
    return walk_tree(g, tree, max_depth)[1]


def mask_tree(g: GrammarState | None, tree, logits, max_depth: int):
    """``(logits [B, N, V] masked node by node, node states [B, N])``: each node's logits
    decide the token after it, so they are masked by the node's own path's state. Unchanged
    (and None) without a grammar."""
    if g is None:
        return logits, None
    states = node_states(g, tree, max_depth)
    ok = allowed(g, states)
    if g.host is not None:
        ok &= hostg.tree_allowed(g.host, tree.tokens, tree.parents, logits.shape[-1])
    return masked(ok, logits), states


def after_accept(g: GrammarState | None, states, idx, n, bonus, live, toks
                 ) -> GrammarState | None:
    """The rows' states once a verify pass emitted its ``n [B]`` tokens ``toks [B, S+1]``:
    the last accepted node's state (``idx [B, S+1]``: the path's nodes), stepped by the bonus
    token; the host rows record the tokens."""
    if g is None:
        return None
    at = jnp.take_along_axis(states, jnp.maximum(idx, 0), 1)
    last = jnp.take_along_axis(at, jnp.maximum(n - 1, 0)[:, None], 1)[:, 0]
    return g.replace(state=jnp.where(live & (n > 0), step(g, last, bonus), g.state),
                     host=hostg.record(g.host, toks, jnp.where(live, n, 0)))


def force_tree(g: GrammarState | None, tree, max_depth: int):
    """``tree`` with every node whose parent's state allows one token only set to that token:
    the grammar drafts forced stretches (JSON keys, punctuation) for free, and the target,
    whose masked distribution there is that token with probability 1, accepts them."""
    if g is None:
        return tree
    return tree.replace(tokens=walk_tree(g, tree, max_depth, force=True)[0])


def draft_logits(g: GrammarState | None, states, logits, draft_to_target=None):
    """A drafter's ``logits [..., Vd]`` masked by ``states [...]`` (its draft vocabulary's
    ids map to the target's through ``draft_to_target [Vd]``; None: the same vocabulary)."""
    if g is None:
        return logits
    ok = allowed(g, states)
    if draft_to_target is not None:
        ok = jnp.take(ok, draft_to_target, axis=-1)
    return masked(ok, logits)


def child_states(g: GrammarState | None, states, tokens):
    """``states [...]`` stepped by ``tokens [..., K]`` (target ids); None without a grammar."""
    return None if g is None else step(g, states[..., None], tokens)
