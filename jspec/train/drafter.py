"""Draft heads' training objectives, and the fresh drafters they start from.

Every loss runs the drafters' own networks (``net_apply`` of :mod:`jspec.drafters`, or
:class:`~jspec.drafters.medusa.MedusaHeads`), so trained parameters load straight back
into :func:`jspec.drafters.load_drafter` / :func:`jspec.generate`.

Conventions (those of :mod:`jspec.drafters.base`): draft position ``i`` holds the pair
(target feature at ``i``, token ``i+1``) and predicts token ``i+2``; its target is the
target's distribution at position ``i+1`` (the cached top-k, renormalised, restricted to
the draft vocabulary for EAGLE-3).

Training-time test (EAGLE-3 TTT; also used for EAGLE-1's and MTP's unroll). Unroll step 0
is a causal pass over the target's features. Step ``j >= 1`` at position ``i`` stands for a
tree node at depth ``j`` whose committed prefix ends at ``i - j``: it reads the drafter's
own step ``j-1`` output at ``i - 1`` (its parent) and attends to step 0's keys at
positions ``<= i - j`` plus the keys steps ``1 .. j`` wrote at ``i - j + k`` (its ancestors)
-- exactly what the EAGLE-2 tree loop at inference lets it see. All steps write into one
KV cache (step ``j`` at window offset ``j*T``, RoPE position ``i``) with ``lengths = 0``,
and the visibility above is the block mask ``[T, U*T]``. Step ``j``'s loss has weight
``0.8**j``.

Losses: ``eagle3`` soft cross-entropy, 3-step TTT; ``eagle1`` smooth-L1 regression of the
next target feature + soft cross-entropy through the target's head, 2-step unroll;
``mtp`` soft cross-entropy of the next-next token (module 0: (h_t, emb(x_{t+1})) -> x_{t+2}),
3-step unroll; ``medusa`` head ``k`` reads the target's hidden at ``t`` and is trained on the
target's distribution for token ``t+2+k`` (weights ``0.8**k``).

The loop that trains them (offline or online, on a mesh, checkpointed) is
:mod:`jspec.train.trainer`; batches come from :mod:`jspec.train.sources`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import Drafter, random_drafter, registry
from jspec.drafters.base import target_head
from jspec.drafters.vocab import MAP_KEYS, build_d2t, set_draft_vocab, t2d_for
from jspec.train.dflash_loss import dflash_loss
from jspec.train.packing import is_packed, same_segment
from jspec.train.targets import label_mask, soft_ce, soft_targets, train_cache


@dataclasses.dataclass(frozen=True)
class LossConfig:
    unroll: int = 3              # TTT steps (recurrent drafters)
    decay: float = 0.8           # weight of unroll step j (or Medusa head j): decay**j
    ce: float = 1.0              # soft cross-entropy weight
    reg: float = 0.0             # smooth-L1 feature regression weight (EAGLE-1)
    anchors: int = 16            # DFlash: blocks drawn per sequence
    gamma: float = 0.0           # DFlash: position decay (0: the paper's for the block size)


def default_loss(kind: str) -> LossConfig:
    """The loss settings a kind trains with (its registry entry's ``loss``)."""
    return LossConfig(**_entry(kind).loss[1])


def _entry(kind: str):
    entry = registry.kind(kind)
    if not entry.trainable:
        raise ValueError(f"a {kind} drafter is not trained by jspec.train (trainable kinds: "
                         f"{', '.join(registry.names(lambda k: k.trainable))})")
    return entry


# ------------------------------------------------------------------ drafter construction
def _zero_blocks(d: Drafter) -> Drafter:
    """Medusa heads start with zero residual blocks: every head predicts like the target."""
    net = dict(d.params["net"])
    for name in net:
        if not name.endswith("_lm"):
            net[name] = jax.tree.map(jnp.zeros_like, net[name])
    return Drafter(d.module, {**d.params, "net": net})


def build_drafter(kind: str, target_cfg, target_params, key, *, draft_vocab: int = 0,
                  freqs: np.ndarray | None = None, **arch) -> Drafter:
    """A fresh drafter to train; heads start from the target's LM head where they have one.

    ``draft_vocab < V`` (any kind) drafts over the ``draft_vocab`` most frequent tokens of
    ``freqs`` (token counts; :func:`jspec.drafters.vocab.build_d2t`): the drafter gets its
    own ``[H, Vd]`` head(s), initialised as the target head's columns of the kept tokens,
    and the map (``d2t``; Medusa's ``token_map``). Without one, EAGLE-1 reads the target's
    head and MTP's / EAGLE-3's own heads start as copies of it.
    Medusa gets its own per-head LM heads (copies of the target's) and zero residual
    blocks, so every head starts out predicting the next token like the target.
    ``arch``: fields of the kind's architecture (``aux_layers=``, ``num_heads=``, ...); None
    keeps the kind's default.
    """
    family = _entry(kind).loss[0]
    arch = {k: v for k, v in arch.items() if v is not None}
    V = target_cfg.vocab_size
    head = np.asarray(target_head(target_cfg, target_params))            # [H, V]
    vd = draft_vocab if draft_vocab and draft_vocab < V else 0
    ids = None
    if vd:
        if freqs is None:
            raise ValueError("a reduced draft vocabulary needs token frequencies")
        _, ids = build_d2t(freqs, vd)
    d = random_drafter(kind, target_cfg, key, vocab_size=FAMILIES[family].vocab(vd, V), **arch)
    d = FAMILIES[family].start(d)
    return Drafter(d.module, set_draft_vocab(d.module, d.params, ids, head))


def split_params(params):
    """-> ``(trainable, frozen)``: the integer draft-vocabulary map (``d2t`` / Medusa's
    ``token_map``) is frozen."""
    frozen = {k: v for k, v in params.items() if k in MAP_KEYS}
    return {k: v for k, v in params.items() if k not in frozen}, frozen


# ------------------------------------------------------------------ loss pieces
def ttt_masks(T: int, unroll: int) -> np.ndarray:
    """``[U, T, U*T]`` bool: step j's query i sees step 0 at ``<= i-j`` and step k's slot
    ``i-j+k`` (1 <= k <= j); step 0 is plain causal."""
    U = unroll
    m = np.zeros((U, T, U * T), bool)
    i = np.arange(T)
    for j in range(U):
        m[j, :, :T] = np.arange(T)[None, :] <= (i - j)[:, None]
        for k in range(1, j + 1):
            p = i - j + k
            ok = p >= 0
            m[j, i[ok], k * T + p[ok]] = True
    return m


def _shift_left(x, n=1):
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], 1)


def _shift_right(x, n=1):
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([pad, x[:, :-n]], 1)


def _mean(x, m):
    m = m.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def recurrent_loss(module, params, target_cfg, target_params, batch, lc: LossConfig, t2d=None):
    """EAGLE-1 / EAGLE-3 / MTP: full-sequence causal pass plus TTT unroll (see module doc)."""
    tokens = batch["tokens"]
    B, T = tokens.shape
    U = lc.unroll
    nxt = _shift_left(tokens)                                   # token i+1 at draft pos i
    i = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    pos = batch.get("positions", i)                             # RoPE: inside the record
    probs, ids = soft_targets(_shift_left(batch["topk_vals"]), _shift_left(batch["topk_ids"]), t2d)
    masks = jnp.broadcast_to(jnp.asarray(ttt_masks(T, U)), (B, U, T, U * T))
    packed = is_packed(batch)
    if packed:              # keys of the query's own record: step k's slot k*T + p is p's
        seg = batch["segments"]
        masks = masks & (seg[:, :, None] == jnp.tile(seg, (1, U))[:, None, :])[:, None]
    cache = train_cache(module, B, U * T)
    feats = batch["feats"]
    next_hidden = _shift_left(batch["hidden"]) if lc.reg else None
    total, metrics = 0.0, {}
    for j in range(U):
        out, logits, cache = module.net_apply(
            params, target_cfg, target_params, nxt, feats, None if j == 0 else j, pos, cache,
            masks[:, j], None, j * T)
        valid = (i >= j) & label_mask(batch, 2)
        if packed:          # the node's committed prefix (ending at i - j) is its record's
            valid = valid & same_segment(seg, i - j)
        ce, acc = soft_ce(logits, probs, ids)
        lj = lc.ce * _mean(ce, valid)
        if lc.reg:
            d = jnp.abs(out.astype(jnp.float32) - next_hidden)
            sl1 = jnp.where(d < 1.0, 0.5 * d * d, d - 0.5).mean(-1)
            lj = lj + lc.reg * _mean(sl1, valid)
            metrics[f"reg{j}"] = _mean(sl1, valid)
        total = total + lc.decay ** j * lj
        metrics[f"ce{j}"] = _mean(ce, valid)
        metrics[f"acc{j}"] = _mean(acc, valid)
        feats = _shift_right(out)                               # parent = own output at i-1
    return total, metrics


def medusa_loss(module, params, target_cfg, target_params, batch, lc: LossConfig, t2d=None):
    head = None if module.vocab_size else target_head(target_cfg, target_params)
    logits = module.net.apply({"params": params["net"]}, batch["hidden"], head)   # [B, K, T, V]
    total, metrics = 0.0, {}
    for k in range(module.num_heads):
        probs, ids = soft_targets(_shift_left(batch["topk_vals"], k + 1),
                                  _shift_left(batch["topk_ids"], k + 1), t2d)
        ce, acc = soft_ce(logits[:, k], probs, ids)
        valid = label_mask(batch, 2 + k)
        total = total + lc.decay ** k * _mean(ce, valid)
        metrics[f"ce{k}"] = _mean(ce, valid)
        metrics[f"acc{k}"] = _mean(acc, valid)
    return total, metrics


@dataclasses.dataclass(frozen=True)
class LossFamily:
    """How a registry entry's ``loss`` family trains: its loss, the own-head vocabulary it
    starts with (given the draft vocabulary ``vd``, 0 for none, and the target's ``V``), the
    change to random weights it starts from, and whether its loss reads packed rows
    (:mod:`jspec.train.packing`)."""
    loss: Callable
    vocab: Callable[[int, int], int] = lambda vd, V: vd
    start: Callable[[Drafter], Drafter] = lambda d: d
    packs: bool = True


FAMILIES = {
    "recurrent": LossFamily(recurrent_loss),
    "medusa": LossFamily(medusa_loss, vocab=lambda vd, V: vd or V, start=_zero_blocks),
    "dflash": LossFamily(dflash_loss, vocab=lambda vd, V: 0, packs=False),
}


def packs(kind: str) -> bool:
    """Whether ``kind``'s loss trains on packed rows (the CLI's default for online data)."""
    return FAMILIES[_entry(kind).loss[0]].packs


def drafter_loss(module, params, target_cfg, target_params, batch, lc: LossConfig, t2d=None):
    fn = FAMILIES[_entry(module.kind).loss[0]].loss
    return fn(module, params, target_cfg, target_params, batch, lc, t2d)


def draft_t2d(module, frozen, vocab_size: int):
    """A drafter with a draft-vocabulary map: ``t2d [V]`` (-1 = not drafted); else None."""
    t2d = t2d_for(module, frozen, vocab_size)
    return None if t2d is None else jnp.asarray(t2d)
