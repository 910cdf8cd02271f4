"""The draft loop shared by the feature-recurrent drafters, and helpers every drafter uses.

The protocol itself is :class:`jspec.drafters.protocol.DraftModule`. Every drafter is a
pair: a frozen, hashable *architecture* (its static fields; a static argument of the
compiled driver) and a parameter pytree. The driver calls:

- ``init_state(batch, page_table, num_pages, page_size)`` -> drafter state (inside jit);
- every call below that runs the network also takes ``kernels=`` (keyword, static): the
  attention implementation, a concrete :mod:`jspec.kernels` mode (default "reference");
- ``prefill(params, target, state, feats, next_tokens, lens)`` after the target prefill's
  first chunk (:mod:`jspec.prefill`): ``feats [B, C, F]`` are the target's features at
  each of its positions and ``next_tokens [B, C]`` the token that follows each position
  (prompt shifted by one, then the first generated token), ``lens`` the valid ones per
  row; every later chunk of a long prompt comes as an ``extend`` of its pairs, so the
  two must compose as one whole-prompt ``prefill`` does;
- ``propose(params, target, state, root, spec)`` -> :class:`~jspec.tree.build.DraftTree`
  (N nodes, root = the last emitted token); ``target`` is ``(target_config, target_params)``;
  dynamic-tree drafters also expose ``draft_pool(params, target, state, spec)``, the scored
  EAGLE-2 candidate pool that ``propose`` selects from (calibration and ``selection`` use it);
- ``extend(params, target, state, feats, next_tokens, n)`` after verification with the
  accepted nodes' features ``[B, S+1, F]`` and the tokens emitted after them; ``n`` per row.

Feature-recurrent drafters (EAGLE-1, EAGLE-3, MTP) share :class:`RecurrentDrafter`:
they differ only in their network (how a token embedding and a feature combine, and
the head), while the EAGLE-2 tree loop, the drafter's own one-layer paged KV and the
bookkeeping are here once.

Draft positions: draft position i holds the pair (feature of target position i,
token i+1) and predicts token i+2, so the drafter's committed length always equals
the target's. A tree node at depth d sits at draft position ``L - 1 + d`` (L = the
committed length); the tree loop writes step s (depth s) into transient slots
``L + (s-1)K .. L + sK - 1``, past the committed length, and ``extend`` overwrites them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from jspec import kv_cache as kvc
from jspec.config import LlamaConfig
from jspec.drafters.hf_layout import draft_layer_config
from jspec.drafters.protocol import DraftModuleDefaults
from jspec.grammar import device as gdev
from jspec.llama import out_major_params
from jspec.serving_layout import is_packed
from jspec.shapes import Float
from jspec.spec_config import SpecConfig
from jspec.topk import top_k
from jspec.tree.build import DraftTree
from jspec.tree.calibration import node_scores
from jspec.tree.select import (CandidatePool, expand_frontier, pool_offset, pool_parent_index,
                               select_pool)


def kept_rows(x: jax.Array, keep: jax.Array | None) -> jax.Array:
    """``x [B, T, ...]`` -> row ``keep[b]`` of each batch row, ``[B, 1, ...]`` (all rows when
    ``keep`` is None). Drafter nets apply their head after this, so a committed block of
    S+1 rows pays for one row's head (the head is the drafter's main cost at small sizes)."""
    if keep is None:
        return x
    return jnp.take_along_axis(x, keep.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)


def top_k_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k best log-probabilities and their ids: top-k of the raw logits minus one
    logsumexp, instead of a full-vocabulary log_softmax followed by top-k (the two-stage
    :func:`jspec.topk.top_k`: ``lax.top_k`` over a vocabulary compiles slowly on TPU)."""
    vals, ids = top_k(logits, k)
    return vals - jax.nn.logsumexp(logits, -1, keepdims=True), ids


class DrafterMismatchError(ValueError):
    """A drafter does not fit the target it is paired with."""


def target_embedding(target_params) -> jax.Array:
    """``[V, H]``, from packed (serving) or checkpoint-layout target params."""
    if is_packed(target_params):
        return target_params["embed"]
    return target_params["embed_tokens"]["embedding"]


def target_head_out_major(target_cfg: LlamaConfig, target_params) -> jax.Array:
    """``[V, H]``: the target's LM head as :func:`jspec.serving_layout.linear` takes it (no copy for
    packed serving params or a tied embedding)."""
    if target_cfg.tie_word_embeddings:
        return target_embedding(target_params)
    if is_packed(target_params):
        return target_params["lm_head"]
    return target_params["lm_head"]["kernel"].T


def target_head(target_cfg: LlamaConfig, target_params) -> jax.Array:
    """``[H, V]`` LM head of the target (the transposed embedding when tied)."""
    return target_head_out_major(target_cfg, target_params).T


@struct.dataclass
class RecurrentState:
    cache: kvc.PagedKVCache
    feature: Float["B H"]      # the drafter's output at the root's draft position
    logits: Float["B Vd"]      # its distribution over the root's children


@dataclasses.dataclass(frozen=True)
class RecurrentDrafter(DraftModuleDefaults):
    """Base for the EAGLE-1 / EAGLE-3 / MTP architectures. Subclasses define the network."""

    layer: LlamaConfig          # the drafter's decoder layer (num_layers = 1)
    target_vocab: int
    # Serving layout: every Linear kernel held [out, in] (jspec.llama.Linear), the product
    # XLA:CPU runs about 3x faster for the few rows of a tree step or an extend. Set by
    # serving(); checkpoints, training and random init use the [in, out] layout.
    out_major: bool = dataclasses.field(default=False, metadata={"runtime": True})

    kind = "recurrent"
    cache_layers = 1
    has_pool = True             # draft_pool: the EAGLE-2 candidate pool

    # -------------------------------------------------------- network hooks
    def net_apply(self, params, target_cfg, target_params, tokens, feats, step, positions,
                  cache, block_mask, valid, offset, keep=None, *, kernels: str = "reference"):
        """-> ``(feature_out [B,T,H], draft logits [B,T,Vd] fp32, cache)``.

        ``step`` is None for committed positions (``feats`` are the target's features)
        and the tree-loop step s >= 1 (traced) otherwise (``feats`` are the drafter's own).
        ``keep [B]`` (optional): the head runs on row ``keep[b]`` only and the logits are
        ``[B, 1, Vd]`` (see :func:`kept_rows`). ``kernels``: the attention's
        :mod:`jspec.kernels` mode.
        """
        raise NotImplementedError

    def init_params(self, key, target_cfg: LlamaConfig):
        """Random parameters (tests, benchmarks, training from scratch)."""
        raise NotImplementedError

    def _dummy(self, target_cfg: LlamaConfig, feat_width: int):
        c = self.layer
        cache = kvc.init_cache(self.cache_layers, c.num_kv_heads, c.head_dim,
                               jnp.zeros((1, 1), jnp.int32), 1, 8, c.dtype)
        z = jnp.zeros((1, 1), jnp.int32)
        return (jnp.zeros((1, 1, target_cfg.hidden_size), c.dtype),
                jnp.zeros((1, 1, feat_width), c.dtype), z, cache)

    def to_target_ids(self, params, draft_ids: jax.Array) -> jax.Array:
        return draft_ids

    def validate(self, target_cfg: LlamaConfig, params=None) -> None:
        if target_cfg.vocab_size != self.target_vocab:
            raise DrafterMismatchError(
                f"{self.kind} drafter was built for a vocabulary of {self.target_vocab} tokens, "
                f"the target has {target_cfg.vocab_size}")
        if target_cfg.hidden_size != self.layer.hidden_size:
            raise DrafterMismatchError(
                f"{self.kind} drafter has hidden size {self.layer.hidden_size}, the target "
                f"{target_cfg.hidden_size}")

    def serving(self, params):
        """``(spec, params)`` in the serving layout (output-major kernels)."""
        if self.out_major:
            return self, params
        return dataclasses.replace(self, out_major=True), out_major_params(params)

    # ------------------------------------------------------------ protocol
    def cache_slots(self, spec: SpecConfig) -> int:
        """Draft KV slots a row needs past its committed length."""
        return max((spec.num_steps - 1) * spec.topk, spec.num_steps + 1)

    def init_state(self, batch: int, page_table, num_pages: int, page_size: int) -> RecurrentState:
        c = self.layer
        cache = kvc.init_cache(self.cache_layers, c.num_kv_heads, c.head_dim, page_table, num_pages,
                               page_size, c.dtype)
        return RecurrentState(cache=cache, feature=jnp.zeros((batch, c.hidden_size), c.dtype),
                              logits=jnp.zeros((batch, self.draft_vocab), jnp.float32))

    @property
    def draft_vocab(self) -> int:
        return self.target_vocab

    def _run_committed(self, params, target, state: RecurrentState, feats, next_tokens, n,
                       kernels: str):
        """Feed (feature, next token) pairs at the committed end; keep ``n`` per row."""
        cfg, tparams = target
        B, T = next_tokens.shape
        j = jnp.arange(T, dtype=jnp.int32)[None]
        pos = state.cache.lengths[:, None] + j
        valid = j < n[:, None]
        last = jnp.maximum(n - 1, 0)
        out, logits, cache = self.net_apply(params, cfg, tparams, next_tokens, feats, None, pos,
                                            state.cache, None, valid, 0, keep=last,
                                            kernels=kernels)
        keep = n > 0
        return RecurrentState(
            cache=kvc.advance(cache, n),
            feature=jnp.where(keep[:, None], kept_rows(out, last)[:, 0], state.feature),
            logits=jnp.where(keep[:, None], logits[:, 0], state.logits))

    def prefill(self, params, target, state, feats, next_tokens, lens, *,
                kernels: str = "reference"):
        return self._run_committed(params, target, state, feats, next_tokens, lens, kernels)

    def extend(self, params, target, state, feats, next_tokens, n, *, kernels: str = "reference"):
        return self._run_committed(params, target, state, feats, next_tokens, n, kernels)

    # propose takes grammar= (jspec.grammar.device.GrammarState): drafts only allowed tokens.
    masks_drafts = True

    def propose(self, params, target, state: RecurrentState, root: jax.Array,
                spec: SpecConfig, *, kernels: str = "reference", grammar=None) -> DraftTree:
        """The EAGLE-2 loop (:meth:`draft_pool`), then the global selection."""
        pool = self.draft_pool(params, target, state, spec, kernels=kernels, grammar=grammar)
        tree, _ = select_pool(root, pool, spec.num_draft_tokens, spec.num_steps)
        return tree

    def draft_pool(self, params, target, state: RecurrentState, spec: SpecConfig, *,
                   kernels: str = "reference", grammar=None) -> CandidatePool:
        """S-1 recurrent steps of K frontier paths -> the EAGLE-2 candidate pool, scored
        under ``spec.selection`` (:func:`jspec.tree.calibration.node_scores`). ``grammar``:
        each path's logits masked by its own grammar state (the root's is the row's)."""
        cfg, tparams = target
        S, K = spec.num_steps, spec.topk
        B = state.logits.shape[0]
        W = max((S - 1) * K, 1)                                  # transient window
        ids = self.to_target_ids(params, jnp.arange(state.logits.shape[-1]))
        mask = functools.partial(gdev.draft_logits, grammar, draft_to_target=ids)
        g0 = None if grammar is None else grammar.state
        logq0, tok0 = top_k_logprobs(mask(g0, state.logits), K)
        score0 = node_scores(spec.selection, logq0, 0, params, self.to_target_ids(params, tok0))
        base = state.cache.lengths - 1                           # root's draft position

        def step(carry, s):
            f_scores, f_idx, f_logq, f_tok, f_feat, f_anc, (wk, wv), f_g = carry
            # The pool is closed over (read only), not carried: only the window is.
            cache = kvc.WindowedCache(prefix=state.cache, k=wk, v=wv)
            slot = (s - 1) * K + jnp.arange(K)                   # this step's transient slots
            self_mask = jax.nn.one_hot(slot, W, dtype=bool)[None]
            amask = f_anc | self_mask
            pos = jnp.broadcast_to((base + s)[:, None], (B, K))
            out, logits, cache = self.net_apply(
                params, cfg, tparams, self.to_target_ids(params, f_tok), f_feat, s, pos, cache,
                amask, None, (s - 1) * K, kernels=kernels)
            c_logq, c_tok = top_k_logprobs(mask(f_g, logits), K)          # [B, K, K]
            c_g = gdev.child_states(grammar, f_g, self.to_target_ids(params, c_tok))
            c_scores = node_scores(spec.selection, c_logq, s, params,
                                   self.to_target_ids(params, c_tok), f_idx % K, f_logq)
            scores, keep = expand_frontier(f_scores, c_scores)
            parent_slot = keep // K
            new = (
                jnp.take_along_axis(scores, keep, 1),
                pool_offset(s, K) + keep,
                jnp.take_along_axis(c_logq.reshape(B, K * K), keep, 1),
                jnp.take_along_axis(c_tok.reshape(B, K * K), keep, 1),
                jnp.take_along_axis(out, parent_slot[..., None], 1),
                jnp.take_along_axis(amask, parent_slot[..., None], 1),
                (cache.k, cache.v),
                None if c_g is None else jnp.take_along_axis(c_g.reshape(B, K * K), keep, 1))
            return new, (c_tok.reshape(B, K * K), scores, c_logq.reshape(B, K * K),
                         pool_parent_index(f_idx, K))

        f_feat = jnp.broadcast_to(state.feature[:, None], (B, K, state.feature.shape[-1]))
        empty = kvc.WindowedCache.empty(state.cache, W)
        window = (empty.k, empty.v)
        init = (score0, jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K)), logq0, tok0,
                f_feat, jnp.zeros((B, K, W), bool), window,
                gdev.child_states(grammar, g0, self.to_target_ids(params, tok0)))
        parts = [(tok0, score0, logq0, jnp.full((B, K), -1, jnp.int32))]
        if S > 1:
            _, steps = jax.lax.scan(step, init, jnp.arange(1, S))
            # [S-1, B, K*K] -> [B, (S-1) K*K], in pool order.
            parts.append(tuple(jnp.moveaxis(x, 0, 1).reshape(B, -1) for x in steps))
        # The transient KV lived in the loop's window only; the page pool was never written.
        tok, score, logq, par = (jnp.concatenate(x, 1) for x in zip(*parts))
        return CandidatePool(tokens=self.to_target_ids(params, tok), scores=score, logq=logq,
                             parents=par)


def random_recurrent(cls, defaults=lambda target_cfg: {}):
    """A registry ``build`` for a recurrent kind: its one-layer network shaped like the
    target's layers, random weights; ``defaults(target_cfg)`` fills fields not given."""
    def build(target_cfg: LlamaConfig, key, **kw):
        module = cls(draft_layer_config(target_cfg), target_cfg.vocab_size,
                     **{**defaults(target_cfg), **kw})
        return module, module.init_params(key, target_cfg)
    return build
