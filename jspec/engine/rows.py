"""Rows of a decode state: take some slots out as a smaller batch, put them back.

A decode state (:class:`jspec.spec_decode.SpecState`, a drafter's state) mixes two kinds
of leaves: per-row arrays, whose leading axis is the batch, and shared ones, chiefly the
KV page pools, which every row reads through its own page table. The engine runs a chunk
of iterations on the live slots only (a batch bucket smaller than its slot count), so it
gathers the per-row leaves of those slots, keeps the pools whole, and scatters back.

The rule: inside a :class:`~jspec.kv_cache.PagedKVCache` the pools are shared and the page
table, lengths and capacity are per row; any other leaf is per row when its leading axis
has the slot count, shared otherwise (a drafter's scalar PRNG key, say).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.kv_cache import PagedKVCache

_ROW_FIELDS = ("page_table", "lengths", "capacity")


def _is_cache(x) -> bool:
    return isinstance(x, PagedKVCache)


def _per_row(x, slots: int) -> bool:
    return getattr(x, "ndim", 0) >= 1 and x.shape[0] == slots


def take(state, rows: jax.Array, slots: int):
    """The sub-state of slots ``rows [b]`` (distinct): per-row leaves gathered, pools kept."""
    def one(x):
        if _is_cache(x):
            return x.replace(**{f: getattr(x, f)[rows] for f in _ROW_FIELDS})
        return x[rows] if _per_row(x, slots) else x
    return jax.tree.map(one, state, is_leaf=_is_cache)


def put(state, sub, rows: jax.Array, slots: int):
    """``state`` with slots ``rows`` replaced by ``sub``'s rows, and its shared leaves
    (the pools ``sub``'s rows wrote into) taken from ``sub``."""
    def one(x, y):
        if _is_cache(x):
            return y.replace(**{f: getattr(x, f).at[rows].set(getattr(y, f))
                                for f in _ROW_FIELDS})
        return x.at[rows].set(y) if _per_row(x, slots) else y
    return jax.tree.map(one, state, sub, is_leaf=_is_cache)


def release(state, gone: jax.Array):
    """Rows ``gone [B]`` lose their pages: every page table entry becomes out of range and
    capacity 0, so whatever such a row still computes (a done row rides along in a batch)
    writes nothing, and its pages can go to the next request."""
    def one(x):
        if not _is_cache(x):
            return x
        table = jnp.where(gone[:, None], x.num_pages, x.page_table)
        return x.replace(page_table=table, capacity=jnp.where(gone, 0, x.capacity))
    return jax.tree.map(one, state, is_leaf=_is_cache)


def with_pools(fresh, live):
    """``fresh`` (a one-row cache or drafter state, made by ``init_cache`` / ``init_state``)
    reading and writing ``live``'s pools instead of its own zeros (which XLA then drops)."""
    def one(x, y):
        return x.replace(k_pages=y.k_pages, v_pages=y.v_pages) if _is_cache(x) else x
    return jax.tree.map(one, fresh, live, is_leaf=_is_cache)
