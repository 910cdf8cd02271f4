"""N-gram (prompt lookup) drafting: propose what followed the latest earlier occurrence of the
text's last tokens. No weights, any target; strong where text repeats (code, extraction,
editing). Fully on device inside the compiled loop, static shapes.

State: the row's token history ``[B, max_len]`` (the prompt from its second token on, then
every emitted token; the last one is the tree's root) and its length.

Matching: for every earlier position j, the match length is how many tokens ending at j equal
the history's last tokens (at most ``max_n``); positions with at least ``min_n`` are
candidates, ranked by match length, then by recency. The best candidate's continuation
``history[j+1 : j+1+S]`` is a chain; with ``topk`` K > 1 the K best candidates with distinct
first tokens are K branches under the root, kept best-first by :func:`select_tree` until the
tree has N nodes (ancestor-closed). Continuations that run past the history, and rows
without any match, draft filler that is never accepted (the output stays exact).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct

from jspec.drafters.base import DrafterMismatchError
from jspec.drafters.protocol import DraftModuleDefaults
from jspec.drafters.registry import DrafterKind, register
from jspec.shapes import Int
from jspec.spec_config import SpecConfig, SpecConfigError
from jspec.tree.select import select_tree


@struct.dataclass
class NGramState:
    history: Int["B T"]
    length: Int["B"]


@dataclasses.dataclass(frozen=True)
class NGram(DraftModuleDefaults):
    vocab: int
    min_n: int = 1
    max_n: int = 4
    kind = "ngram"

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram drafter needs 1 <= min_n <= max_n, got min_n={self.min_n}, "
                             f"max_n={self.max_n}")

    def validate(self, target_cfg, params=None) -> None:
        if target_cfg.vocab_size != self.vocab:
            raise DrafterMismatchError(f"ngram drafter was made for a vocabulary of {self.vocab} "
                                       f"tokens, the target has {target_cfg.vocab_size}")

    def cache_slots(self, spec) -> int:
        return 0

    def check_spec(self, spec: SpecConfig) -> None:
        """Its pool holds K branches of S nodes: refuse a wider N before compiling."""
        super().check_spec(spec)
        if spec.num_draft_tokens - 1 > spec.topk * spec.num_steps:
            raise SpecConfigError(
                f"an ngram tree has topk={spec.topk} branches of num_steps={spec.num_steps} "
                f"nodes: at most {spec.topk * spec.num_steps + 1} nodes, got "
                f"num_draft_tokens={spec.num_draft_tokens}")

    def init_state(self, batch, page_table, num_pages, page_size) -> NGramState:
        T = page_table.shape[1] * page_size          # the longest a row can grow
        return NGramState(history=jnp.zeros((batch, T), jnp.int32),
                          length=jnp.zeros((batch,), jnp.int32))

    def _append(self, state: NGramState, tokens, n) -> NGramState:
        B, W = tokens.shape
        T = state.history.shape[1]
        pos = state.length[:, None] + jnp.arange(W)[None]
        pos = jnp.where(jnp.arange(W)[None] < n[:, None], pos, T)      # out of range: dropped
        hist = state.history.at[jnp.arange(B)[:, None], pos].set(tokens.astype(jnp.int32),
                                                                 mode="drop")
        return NGramState(history=hist, length=jnp.minimum(state.length + n, T))

    # kernels=: the protocol's attention mode; n-gram lookup does not attend.
    def prefill(self, params, target, state, feats, next_tokens, lens, *,
                kernels: str = "reference"):
        # next_tokens: the prompt shifted by one, then the first generated token (the root).
        return self._append(state, next_tokens, lens.astype(jnp.int32))

    def extend(self, params, target, state, feats, next_tokens, n, *, kernels: str = "reference"):
        return self._append(state, next_tokens, n.astype(jnp.int32))

    def candidates(self, state: NGramState, K: int):
        """``(ends [B, K], ok [B, K])``: the K best match positions with distinct next tokens."""
        hist, L = state.history, state.length
        B, T = hist.shape
        j = jnp.arange(T)[None]
        run = jnp.ones((B, T), bool)
        mlen = jnp.zeros((B, T), jnp.int32)
        for k in range(self.max_n):
            a = jnp.take_along_axis(hist, jnp.clip(j - k, 0, T - 1), 1)
            b = jnp.take_along_axis(hist, jnp.clip(L[:, None] - 1 - k, 0, T - 1), 1)
            run = run & (j - k >= 0) & (L[:, None] - 1 - k >= 0) & (a == b)
            mlen = mlen + run.astype(jnp.int32)
        # Earlier positions only (j < L-1: the suffix itself always matches), with a next token.
        ok = (j < L[:, None] - 1) & (mlen >= self.min_n)
        score = jnp.where(ok, mlen * T + j, -1)
        nxt = jnp.take_along_axis(hist, jnp.clip(j + 1, 0, T - 1), 1)
        ends, oks = [], []
        for _ in range(K):               # K rounds of arg-max, each dropping that next token
            best = jnp.argmax(score, axis=1)
            good = jnp.take_along_axis(score, best[:, None], 1)[:, 0] >= 0
            ends.append(best)
            oks.append(good)
            tok = jnp.take_along_axis(nxt, best[:, None], 1)
            score = jnp.where(nxt == tok, -1, score)
        return jnp.stack(ends, 1).astype(jnp.int32), jnp.stack(oks, 1)

    def propose(self, params, target, state: NGramState, root, spec: SpecConfig, *,
                kernels: str = "reference"):
        S, K, N = spec.num_steps, spec.topk, spec.num_draft_tokens
        hist, L = state.history, state.length
        B, T = hist.shape
        ends, ok = self.candidates(state, K)                              # [B, K]
        s = jnp.arange(S)
        pos = ends[:, :, None] + 1 + s[None, None]                        # [B, K, S]
        toks = jnp.take_along_axis(hist, jnp.clip(pos, 0, T - 1).reshape(B, -1), 1)
        real = ok[:, :, None] & (pos < L[:, None, None])
        # Pool: branch k's node at depth s+1 has pool index k*S + s and parent k*S + s - 1.
        # Scores keep every real node before any filler, better branches first, and a parent
        # before its child, so the top N-1 are ancestor-closed.
        k = jnp.arange(K)[:, None]
        score = jnp.where(real, -(k * S + s[None]).astype(jnp.float32), -1e9 - (k * S + s[None]))
        parents = jnp.where(s[None] == 0, -1, k * S + s[None] - 1)
        parents = jnp.broadcast_to(parents.reshape(1, -1), (B, K * S))
        tree, _ = select_tree(root, toks.reshape(B, K * S), score.reshape(B, K * S), parents, N, S)
        return tree


def _build(target_cfg, key=None, min_n: int = 1, max_n: int = 4):
    return NGram(target_cfg.vocab_size, min_n, max_n), {}


ENTRY = register(DrafterKind(
    name="ngram", module=NGram, default_spec=SpecConfig.chain(4), build=_build,
    modes={"chain": SpecConfig.chain(4), "default": SpecConfig(4, 2, 8),
           "wide": SpecConfig(6, 8, 32)},
    features="none", needs_weights=False, saveable=False,
    from_arg=lambda args, target: _build(target.config, None,
                                         *(int(x) for x in args.split(":") if x))))
