"""Plain (non-speculative) decoding: prefill + decode as one compiled program.

:class:`PlainDecoder` holds only static, hashable settings and is jitted with
``static_argnames=('self',)``: two equal decoders share one compiled program, so a
second ``generate`` call with the same static shapes does not recompile. Every
per-request value (prompts, lengths, stop ids, limits, keys) is a traced argument; the static
:class:`~jspec.sampling.SamplingConfig` decides only whether sampling is traced at all, each
row's settings being runtime values in the state (:mod:`jspec.sampling`).

The decode loop is one ``lax.while_loop`` that stops when every row is done; a row
is done on a stop id, at its own ``max_new`` limit, or when its KV allocation is
full. Done rows ride along without writing to the cache or emitting tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from jspec import kernels, kv_cache as kvc, logprobs, prefill as chunked
from jspec.grammar import device as grammar
from jspec.config import LlamaConfig
from jspec.llama import forward, logits as lm_logits
from jspec.serving_layout import pack_params
from jspec.sampling import SamplingConfig, sample
from jspec.shapes import Bool, Int, Key
from jspec.sharding import constrain_kv, per_data_shard

# Incremented at trace time: tests read it to prove that calls do not recompile.
TRACE_COUNTS: collections.Counter = collections.Counter()

RUNNING, STOP_TOKEN, MAX_NEW_TOKENS, CACHE_FULL, NONFINITE = 0, 1, 2, 3, 4
STOP_REASONS = {RUNNING: "running", STOP_TOKEN: "stop_token",
                MAX_NEW_TOKENS: "max_new_tokens", CACHE_FULL: "cache_full",
                NONFINITE: "nonfinite_logits"}


def finite_rows(logits: jax.Array) -> jax.Array:
    """``[B]``: every logit of the row is finite. A NaN or inf from the target (a corrupt
    checkpoint, an overflow) would otherwise be sampled or argmaxed into a token id that
    looks like any other; the row stops with ``nonfinite_logits`` instead."""
    return jnp.all(jnp.isfinite(logits), axis=tuple(range(1, logits.ndim)))


@struct.dataclass
class DecodeState:
    cache: kvc.PagedKVCache
    tokens: Int["B max_new"]        # generated ids; entries past num_generated are 0
    num_generated: Int["B"]
    last_token: Int["B"]            # the next token to feed
    done: Bool["B"]
    stop_reason: Int["B"]           # one of STOP_REASONS
    row_keys: Key["B"]              # one PRNG key per row: a row samples the same alone or batched
    step: Int[""]
    # Beside ``tokens`` (jspec.logprobs), with a static ``logprobs_k``; None: none kept.
    logprobs: Any = None
    # Each row's settings (runtime values, jspec.sampling.RowSampling); None when the static
    # config never samples (then an argmax alone is traced).
    sampling: Any = None
    # The rows' grammars and states (jspec.grammar.device.GrammarState); None: unconstrained
    # (then nothing grammar-related is traced).
    grammar: Any = None


def emit_block(s, toks, n, stop_ids, max_new, next_slots: int, finite=None, lp=None):
    """Append up to ``n [B]`` of ``toks [B, A]`` to every running row of a decode state
    (any state with ``tokens, num_generated, done, stop_reason, cache``), cut at the first
    stop id (which is kept) and at the row's ``max_new``, and mark rows done. A row whose
    cache cannot take ``next_slots`` more positions stops with ``CACHE_FULL``. A row that is
    not ``finite [B]`` (its next logits were NaN or inf) stops with ``NONFINITE`` after its
    ``n`` tokens (the callers count only tokens decided by finite logits).
    Shared by plain decoding (one token, one slot) and the speculative driver (a block).
    ``lp``: the block's :class:`jspec.logprobs.LogprobBuffer` ``[B, A, ...]``, written where
    the tokens are (when the state keeps logprobs).
    """
    B, A = toks.shape
    live = ~s.done
    j = jnp.arange(A)[None]
    is_stop = jnp.any(toks[:, :, None] == stop_ids[:, None, :], -1) & (j < n[:, None])
    first_stop = jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1) + 1, A + 1)
    budget = max_new - s.num_generated
    m = jnp.where(live, jnp.minimum(jnp.minimum(n, budget), first_stop), 0)
    dst = jnp.where(j < m[:, None], s.num_generated[:, None] + j, s.tokens.shape[1])
    tokens = s.tokens.at[jnp.arange(B)[:, None], dst].set(toks, mode="drop")
    s = logprobs.maybe_write(s, dst, lp)
    num = s.num_generated + m
    full = s.cache.lengths + next_slots > s.cache.capacity
    hit = live & (first_stop <= m)
    reason = jnp.where(hit, STOP_TOKEN, jnp.where(num >= max_new, MAX_NEW_TOKENS,
                                                  jnp.where(full, CACHE_FULL, RUNNING)))
    if finite is not None:
        reason = jnp.where((reason == RUNNING) & ~finite, NONFINITE, reason)
    reason = jnp.where(live, reason, s.stop_reason)
    return s.replace(tokens=tokens, num_generated=num, done=s.done | (reason != RUNNING),
                     stop_reason=reason)


def emit(state: DecodeState, tok: jax.Array, stop_ids: jax.Array, max_new: jax.Array,
         finite=None, lp=None) -> DecodeState:
    """Append ``tok`` to every running row; it becomes the row's next token to feed.
    ``lp``: its logprobs (a ``[B, 1, ...]`` block, see :func:`emit_block`)."""
    live = ~state.done
    n = jnp.ones_like(tok) if finite is None else finite.astype(tok.dtype)
    state = emit_block(state, tok[:, None], n, stop_ids, max_new, next_slots=1, finite=finite,
                       lp=lp)
    return state.replace(last_token=jnp.where(live, tok, state.last_token))


def row_step_keys(state: DecodeState) -> jax.Array:
    return jax.vmap(jax.random.fold_in)(state.row_keys, state.num_generated)


@dataclasses.dataclass(frozen=True)
class PlainDecoder:
    config: LlamaConfig
    sampling: SamplingConfig
    max_new_tokens: int   # static width of the output buffer
    page_size: int
    num_pages: int
    mesh: Mesh | None = None  # shard the KV pool over KV heads on this mesh
    kernels: str = "reference"  # see jspec.kernels
    prefill_chunk: int | None = None  # tokens per prefill chunk (None: jspec.prefill's default)
    # Static: each token's logprob and top-k under the target (jspec.logprobs) kept beside
    # the tokens; None: nothing is computed or stored.
    logprobs_k: int | None = None

    def token_logprobs(self, logits, tok):
        """The ``[B, 1, ...]`` logprob block of ``tok [B]`` drawn from ``logits [B, V]``, or
        None without :attr:`logprobs_k`."""
        if self.logprobs_k is None:
            return None
        return logprobs.of_tokens(logits[:, None], tok[:, None], self.logprobs_k)

    def prefill(self, params, prompt, prompt_lens, cache):
        """Run the padded prompt in chunks (:mod:`jspec.prefill`); returns last-position
        logits and the cache."""
        attend = kernels.prefill_attention_fn(self.kernels, self.config, self.page_size)

        def step(carry, chunk, first):
            cache, last = carry
            hidden, _, cache = chunked.target_chunk(self.config, params, cache, chunk,
                                                    attention_fn=attend)
            return cache, chunked.keep_last(chunk, chunk.take_last(hidden), last)

        cache, last = chunked.run(prompt, prompt_lens, self.prefill_chunk, step, (cache, None))
        logits = lm_logits(self.config, params, last)
        return logits, cache.replace(lengths=prompt_lens.astype(jnp.int32))

    @functools.partial(jax.jit, static_argnames=("self",))
    def run(self, params, prompt, prompt_lens, page_table, stop_ids, max_new, key,
            rows=None, grammar=None) -> DecodeState:
        """``params``: packed (:attr:`jspec.target.Target.serving_params`) or checkpoint
        layout (then packed inside, once per call). ``prompt [B, T]`` right-padded;
        ``page_table [B, max_pages]``; ``stop_ids [B, S]``
        padded with -1; ``max_new [B]``; ``key`` one PRNG key (split into the rows' keys
        here) or the rows' keys ``[B]``; ``rows``: each row's sampling settings as runtime
        values (:class:`jspec.sampling.RowSampling`; None: the static config's); ``grammar``:
        the rows' grammar automata and initial states (:mod:`jspec.grammar.device`; None:
        unconstrained), every token drawn from the target masked by its row's state. On a mesh
        the loop runs per data shard (:func:`jspec.sharding.per_data_shard`): ``num_pages``
        is one shard's pool and the page table holds shard-local page ids."""
        TRACE_COUNTS["plain"] += 1
        params = pack_params(self.config, params)      # a no-op for packed (serving) params
        # The same keys on any mesh.
        row_keys = key if key.shape else jax.random.split(key, prompt.shape[0])
        if self.mesh is None:
            return self._loop(params, prompt, prompt_lens, page_table, stop_ids, max_new,
                              row_keys, rows, grammar)
        return per_data_shard(self.mesh, self._loop, 1)(params, prompt, prompt_lens, page_table,
                                                         stop_ids, max_new, row_keys)

    def _loop(self, params, prompt, prompt_lens, page_table, stop_ids, max_new, row_keys,
              rows=None, grammar_state=None):
        c = self.config
        B = prompt.shape[0]
        cache = kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim, page_table,
                               self.num_pages, self.page_size, c.dtype)
        cache = constrain_kv(cache, c, self.mesh)
        logits, cache = self.prefill(params, prompt, prompt_lens, cache)
        state = DecodeState(
            cache=cache, tokens=jnp.zeros((B, self.max_new_tokens), jnp.int32),
            num_generated=jnp.zeros((B,), jnp.int32), last_token=jnp.zeros((B,), jnp.int32),
            done=max_new <= 0, stop_reason=jnp.where(max_new <= 0, MAX_NEW_TOKENS, RUNNING),
            row_keys=row_keys, step=jnp.zeros((), jnp.int32),
            logprobs=None if self.logprobs_k is None else
            logprobs.empty(B, self.max_new_tokens, self.logprobs_k),
            sampling=self.sampling.rows(B) if rows is None else rows, grammar=grammar_state)
        state = self.draw(state, logits, stop_ids, max_new)

        def cond(s):
            return ~jnp.all(s.done)

        return jax.lax.while_loop(cond, lambda s: self.step(params, s, stop_ids, max_new), state)

    def step(self, params, s: DecodeState, stop_ids, max_new) -> DecodeState:
        """One decode step for every running row (the while body; the anatomy bench
        compiles it on its own)."""
        live = ~s.done
        tok = s.last_token[:, None]
        pos = s.cache.lengths[:, None]
        params = pack_params(self.config, params)
        hidden, _, cache = forward(self.config, params, tok, pos, s.cache, valid=live[:, None],
                                   attention_fn=kernels.attention_fn(self.kernels))
        logits = lm_logits(self.config, params, hidden[:, 0])
        s = s.replace(cache=kvc.advance(cache, live.astype(jnp.int32)), step=s.step + 1)
        return self.draw(s, logits, stop_ids, max_new)

    def draw(self, s: DecodeState, logits, stop_ids, max_new) -> DecodeState:
        """Pick each running row's next token from ``logits [B, V]`` (masked by its grammar
        state, if any: the renormalized allowed distribution) and emit it."""
        finite = finite_rows(logits)
        g = s.grammar
        logits = grammar.mask_rows(g, logits)
        tok = sample(logits, row_step_keys(s), self.sampling, s.sampling)
        s = s.replace(grammar=grammar.advance(g, tok, ~s.done))
        return emit(s, tok, stop_ids, max_new, finite, self.token_logprobs(logits, tok))
