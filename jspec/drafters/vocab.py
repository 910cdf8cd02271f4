"""Draft vocabularies: a drafter that proposes over ``Vd < V`` tokens and a map back.

A drafter's LM head is most of its cost at small and medium sizes, and most of the
target's vocabulary is rarely drafted correctly anyway, so every drafter kind can
draft over a reduced vocabulary: the ``Vd`` most frequent target tokens. The spec's
``vocab_size`` field is ``Vd`` (0: the target's vocabulary, no map); ``draft_vocab`` is
``vocab_size or target_vocab``. The drafter's head(s) are ``[H, Vd]`` and its proposals
are draft ids, mapped to target ids before they enter the tree (so the target
verifies only real target tokens, and exactness never depends on the map).

The map lives in the params, in one of two forms (both checked here, both mapped by
:func:`to_target_ids`):

- ``d2t [Vd]`` (EAGLE-1, EAGLE-3, MTP; the EAGLE-3 checkpoint convention): an
  *offset*, ``target_id = draft_id + d2t[draft_id]``. Absent when ``Vd == V`` means the
  identity.
- ``token_map [Vd]`` (Medusa; vLLM's truncated-vocabulary layout): the target id itself.
  Present exactly when the Medusa spec says ``truncated``.

Training-side pieces: :func:`build_d2t` picks the draft vocabulary from token counts,
:func:`target_to_draft` is the inverse map ``t2d [V]`` (-1: not drafted) used to map a
loss's target ids into the draft vocabulary, and :func:`set_draft_vocab` installs a map
and initialises every draft-vocabulary head from the target's head: the columns of the
kept tokens, ``head[:, arange(Vd) + d2t]``.

Each spec names its draft-vocabulary heads (``draft_head_paths``: paths into its
params of ``[H, Vd]`` kernels) and its map's key (``map_key``).
"""

from __future__ import annotations

import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters.base import DrafterMismatchError

MAP_KEYS = ("d2t", "token_map")
log = logging.getLogger("jspec")


# ------------------------------------------------------------------ checks
def check_d2t(d2t, draft_vocab: int, target_vocab: int, kind: str = "eagle3") -> None:
    """``d2t`` must have one entry per draft id and map every draft id into the target vocab."""
    if d2t is None:
        if draft_vocab != target_vocab:
            raise DrafterMismatchError(
                f"{kind} draft vocabulary ({draft_vocab}) differs from the target's "
                f"({target_vocab}) but the checkpoint has no d2t map")
        return
    d2t = np.asarray(d2t)
    if d2t.shape != (draft_vocab,):
        raise DrafterMismatchError(
            f"d2t has shape {d2t.shape}, expected ({draft_vocab},) (one offset per draft id)")
    if not np.issubdtype(d2t.dtype, np.integer):
        raise DrafterMismatchError(f"d2t has dtype {d2t.dtype}, expected an integer type")
    _check_ids("d2t", np.arange(draft_vocab) + d2t, target_vocab)


def warn_zero_d2t(module, params, target_vocab: int, source) -> None:
    """Log a warning when a loaded checkpoint's ``d2t`` over a reduced draft vocabulary is all
    zeros: a valid map (draft id i -> target id i), but the one a d2t buffer holds when it
    was saved before being filled, which no frequency-ranked draft vocabulary is. Only for
    checkpoints: :func:`identity_d2t` gives in-memory drafters that map on purpose."""
    d2t = params.get("d2t")
    if d2t is None or module.draft_vocab == target_vocab or np.asarray(d2t).any():
        return
    log.warning("%s: d2t is all zeros, so draft id i proposes target id i (the first %d of the "
                "target's %d ids, not a frequency-ranked draft vocabulary); a trained %s head "
                "with such a map accepts almost nothing unless it was trained with this "
                "identity-prefix vocabulary (was the d2t buffer saved before it was filled?)",
                source, module.draft_vocab, target_vocab, module.kind)


def check_token_map(token_map, draft_vocab: int, target_vocab: int, kind: str = "medusa") -> None:
    """``token_map`` must hold one target id in ``[0, V)`` per draft id."""
    if token_map is None:
        raise DrafterMismatchError(
            f"{kind} drafter has a truncated vocabulary ({draft_vocab}) but no token_map")
    tm = np.asarray(token_map)
    if tm.shape != (draft_vocab,):
        raise DrafterMismatchError(
            f"token_map has shape {tm.shape}, expected ({draft_vocab},) (one target id per "
            f"draft id)")
    if not np.issubdtype(tm.dtype, np.integer):
        raise DrafterMismatchError(f"token_map has dtype {tm.dtype}, expected an integer type")
    _check_ids("token_map", tm, target_vocab)


def _check_ids(name: str, tgt: np.ndarray, target_vocab: int) -> None:
    if tgt.size and (tgt.min() < 0 or tgt.max() >= target_vocab):
        bad = int(np.flatnonzero((tgt < 0) | (tgt >= target_vocab))[0])
        raise DrafterMismatchError(
            f"{name} maps draft id {bad} to target id {int(tgt[bad])}, outside the target "
            f"vocabulary [0, {target_vocab})")


def check_draft_vocab(module, target_vocab: int, params=None) -> None:
    """The spec's draft vocabulary fits the target, and (given params) its map is sound."""
    Vd = module.draft_vocab
    if Vd < 1 or Vd > target_vocab:
        raise DrafterMismatchError(
            f"{module.kind} drafter drafts over {Vd} tokens, the target has {target_vocab} "
            f"(a draft vocabulary is a subset: 1 .. {target_vocab})")
    if module.map_key == "token_map":
        if not module.truncated and Vd != target_vocab:
            raise DrafterMismatchError(
                f"{module.kind} heads predict {Vd} tokens, the target has {target_vocab} "
                f"(a truncated vocabulary needs a token_map)")
        if params is not None and module.truncated:
            check_token_map(params.get("token_map"), Vd, target_vocab, module.kind)
        return
    if params is not None:
        check_d2t(params.get("d2t"), Vd, target_vocab, module.kind)


# ------------------------------------------------------------------ maps
def draft_to_target(params) -> jax.Array | None:
    """``[Vd]`` target id of every draft id, or None when there is no map (the identity)."""
    if "d2t" in params:
        d2t = params["d2t"]
        return jnp.arange(d2t.shape[0], dtype=d2t.dtype) + d2t
    if "token_map" in params:
        return params["token_map"]
    return None


def to_target_ids(params, draft_ids: jax.Array) -> jax.Array:
    """Draft ids -> target ids (no map: unchanged). Works inside jit."""
    if "d2t" in params:
        return draft_ids + params["d2t"][draft_ids]
    if "token_map" in params:
        return params["token_map"][draft_ids]
    return draft_ids


def kept_ids(params, draft_vocab: int) -> np.ndarray:
    """Host ``[Vd]`` target ids of the draft vocabulary (``arange`` without a map)."""
    m = draft_to_target(params)
    return np.arange(draft_vocab) if m is None else np.asarray(m)


def t2d_for(module, params, target_vocab: int) -> np.ndarray | None:
    """``t2d [V]`` (-1: not drafted) when ``module`` drafts over a mapped vocabulary."""
    if not any(k in params for k in MAP_KEYS):
        return None
    return target_to_draft(kept_ids(params, module.draft_vocab), target_vocab)


def d2t_from_ids(target_ids) -> np.ndarray:
    """Offsets ``d2t`` for draft id i -> ``target_ids[i]``."""
    t = np.asarray(target_ids).astype(np.int64)
    return (t - np.arange(len(t))).astype(np.int32)


def identity_d2t(draft_vocab: int, target_vocab: int):
    """The init-time map (draft id i -> target id i), or None when no map is needed."""
    return None if draft_vocab == target_vocab else jnp.zeros((draft_vocab,), jnp.int32)


def build_d2t(freqs: np.ndarray, draft_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """-> ``(d2t [Vd] int32, draft_to_target_ids [Vd])``.

    The ``draft_vocab`` most frequent ids (ties: lower id first), sorted by id, are the
    draft vocabulary; ``target_id = draft_id + d2t[draft_id]``.
    """
    V = len(freqs)
    if not 0 < draft_vocab <= V:
        raise ValueError(f"draft vocabulary size must be in [1, {V}], got {draft_vocab}")
    order = np.lexsort((np.arange(V), -np.asarray(freqs)))   # by count desc, then id
    ids = np.sort(order[:draft_vocab]).astype(np.int32)
    return (ids - np.arange(draft_vocab, dtype=np.int32)).astype(np.int32), ids


def target_to_draft(draft_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """``t2d [V]``: the draft id of each target id, -1 when it is not in the draft vocab."""
    t2d = np.full(vocab_size, -1, np.int32)
    t2d[np.asarray(draft_ids)] = np.arange(len(draft_ids), dtype=np.int32)
    return t2d


# ------------------------------------------------------------------ heads
def truncate_head(head, target_ids):
    """A full ``[H, V]`` head -> the ``[H, Vd]`` head over the draft vocabulary."""
    return jnp.asarray(head)[:, jnp.asarray(target_ids)]


def _set(tree: dict, path, value) -> dict:
    out = dict(tree)
    if len(path) == 1:
        out[path[0]] = value
    else:
        out[path[0]] = _set(tree[path[0]], path[1:], value)
    return out


def set_draft_vocab(module, params: dict, target_ids=None, full_head=None) -> dict:
    """``params`` with the draft -> target map for ``target_ids [Vd]`` (None: keep the
    current map) and, given the target's ``full_head [H, V]``, every draft-vocabulary head
    of ``module`` initialised as that head's columns of the kept tokens."""
    Vd = module.draft_vocab
    out = dict(params)
    if target_ids is not None:
        ids = np.asarray(target_ids)
        if ids.shape != (Vd,):
            raise ValueError(f"{module.kind} drafts over {Vd} tokens, got {ids.shape} target ids")
        if module.map_key == "token_map":
            if not module.truncated:
                raise ValueError("a Medusa drafter with a token map needs truncated=True")
            out["token_map"] = jnp.asarray(ids.astype(np.int32))
        else:
            out["d2t"] = jnp.asarray(d2t_from_ids(ids))
    if full_head is not None:
        cols = truncate_head(full_head, kept_ids(out, Vd))
        for path in module.draft_head_paths:
            leaf = nn.unbox(_get(out, path))        # a plain array replaces a boxed one
            out = _set(out, path, cols.astype(leaf.dtype).reshape(leaf.shape))
    return out


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


class DraftVocab:
    """Mixin for drafter specs with a ``vocab_size`` field and a ``d2t`` map: the draft
    vocabulary's size, the id map, and its checks (see the module docstring)."""

    map_key = "d2t"
    vocab_size: int
    target_vocab: int

    @property
    def draft_vocab(self) -> int:
        return self.vocab_size or self.target_vocab

    def to_target_ids(self, params, draft_ids: jax.Array) -> jax.Array:
        return to_target_ids(params, draft_ids)

    def init_map(self) -> dict[str, Any]:
        """Init-time map params (identity prefix), empty when none is needed."""
        d2t = identity_d2t(self.draft_vocab, self.target_vocab)
        return {} if d2t is None else {"d2t": d2t}


__all__ = ["MAP_KEYS", "check_d2t", "warn_zero_d2t", "check_token_map", "check_draft_vocab",
           "draft_to_target", "to_target_ids", "kept_ids", "t2d_for", "d2t_from_ids",
           "identity_d2t", "build_d2t", "target_to_draft", "truncate_head", "set_draft_vocab",
           "DraftVocab"]
