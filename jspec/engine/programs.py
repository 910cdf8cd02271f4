"""The serving engine's compiled programs, over one persistent state of B slots.

- :meth:`Programs.init`: the empty state (pools allocated, every slot free);
- :meth:`Programs.insert`: prefill one request into one slot's pages (one program per
  prompt bucket; the slot, its page table, stop ids, limit and key are traced);
- :meth:`Programs.decode`: up to ``chunk`` iterations for the slots in ``rows`` (one
  program per (mode, bucket of live slots)); the mode is a spec, or :data:`PLAIN`;
- :meth:`Programs.sync`: a drafter that plain chunks left behind caught up with its target
  (one program per bucket), run only before a speculative chunk.

Every program takes the state and gives it back donated, so the pools are updated in
place. Nothing here depends on which request sits in which slot: a row reads the pools
through its own page table, draws with its own key, and rows never see each other.

Sampling is *position keyed* (:attr:`jspec.spec_decode.SpecDecoder.coupled`): output token i
of a request is the draw plain decoding makes with ``fold_in(key, i)``, whatever the spec of
the chunk that decided it. So switching specs between chunks (:mod:`jspec.engine.policy`)
never changes a request's output, greedy or sampled.

Each slot's temperature, top-k and top-p are runtime values in its state
(:class:`jspec.sampling.RowSampling`, written at insert), so greedy and sampled requests share
a batch and every program. Only the static :class:`~jspec.sampling.SamplingConfig` decides
whether sampling is compiled in at all: a greedy config without ``per_request`` traces an
argmax alone, and its slots carry no settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jspec import kernels as kernel_modes, kv_cache as kvc, logprobs, position_stats
from jspec.compiled import compiled
from jspec.config import LlamaConfig
from jspec.decode import (MAX_NEW_TOKENS, RUNNING, TRACE_COUNTS, PlainDecoder, emit_block,
                          finite_rows)
from jspec.engine import rows as R
from jspec.grammar import device as gdev
from jspec.grammar.host import rows_state as ghost_rows
from jspec.llama import forward, logits as lm_logits
from jspec.sampling import SamplingConfig, sample
from jspec.serving_layout import pack_params
from jspec.sharding import constrain_kv
from jspec.shapes import Int
from jspec.spec_config import SpecConfig
from jspec.spec_decode import SpecDecoder, SpecState


PLAIN = "plain"      # the decode mode without speculation (a spec is None for a drafter's default)


@struct.dataclass
class SlotState:
    core: SpecState                 # draft is None without a drafter
    stop_ids: Int["B W"]            # -1 padded
    max_new: Int["B"]
    drafted: Int["B"]               # the target length the drafter has its pairs up to
    # [B, sync_block]: a lazily inserted row's prompt (its drafter starts from nothing and
    # :meth:`Programs.sync` feeds it these tokens too); None when no drafter can be lazy.
    prompt: Any = None
    # [B]: each slot's grammar state in the engine's grammar table (jspec.engine.grammars;
    # 0: free), read by the programs that are given the table.
    grammar_state: Any = None
    # The slots' recent tokens for their host matchers (jspec.grammar.host.HostRows), once
    # the engine has a host session; None before.
    grammar_host: Any = None


@dataclasses.dataclass(frozen=True)
class Programs:
    config: LlamaConfig
    drafter: Any                    # the served drafter's architecture, or None
    sampling: SamplingConfig
    slots: int                      # B
    max_new_tokens: int             # the most new tokens one request may ask for
    max_depth: int                  # the deepest accepted path of any spec served (S)
    max_nodes: int                  # the most verified nodes of any spec served (N)
    page_size: int
    num_pages: int
    max_pages: int                  # page-table width (one row's longest allocation)
    stop_width: int
    chunk: int                      # iterations per decode call
    kernels: str = "reference"      # the target's and the drafter's attention (jspec.kernels)
    mesh: Any = None                # a (1, model) mesh: the target's pools over its KV heads
    prefill_chunk: int | None = None  # insert's prefill chunk (jspec.prefill; None: default)
    sync_block: int = 32            # positions per block forward of :meth:`sync`
    logprobs_k: int | None = None   # static (jspec.logprobs): None computes and keeps none
    # XLA options every program compiles with, as (name, value) pairs (jspec.compiled;
    # a W8A8 target's on CPU: jspec.invariant_attention.compiler_options); (): XLA's defaults.
    compiler_options: tuple = ()

    # ----------------------------------------------------------------- helpers
    def pinned(self, state: SlotState) -> SlotState:
        """The target's pools held sharded over KV heads on the mesh (a no-op off one)."""
        core = state.core
        return state.replace(core=core.replace(cache=constrain_kv(core.cache, self.config,
                                                                    self.mesh)))

    def spec_decoder(self, spec: SpecConfig) -> SpecDecoder:
        return SpecDecoder(config=self.config, drafter=self.drafter, spec=spec,
                           sampling=self.sampling, max_new_tokens=self.max_new_tokens,
                           page_size=self.page_size, num_pages=self.num_pages,
                           kernels=self.kernels, coupled=True,
                           prefill_chunk=self.prefill_chunk, logprobs_k=self.logprobs_k)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return () if self.drafter is None else self.drafter.target_layers

    @property
    def lazy_drafter(self) -> bool:
        """Whether an insert may skip the drafter's prefill (:meth:`insert` ``lazy``): its
        drafter can start from nothing and be caught up by extends alone."""
        return self.drafter is not None and self.drafter.prefill_is_extend

    def _row(self, cache, dstate, first, keys, finite, stops, max_new, drafted=None,
             prompt=None, first_lp=None, rows=None, gstate=None, ghost=None) -> SlotState:
        b = first.shape[0]
        width = self.max_new_tokens + self.max_depth + 1
        s = SpecState(cache=cache, draft=dstate, root=first,
                      tokens=jnp.zeros((b, width), jnp.int32),
                      num_generated=jnp.zeros((b,), jnp.int32), done=max_new <= 0,
                      stop_reason=jnp.where(max_new <= 0, MAX_NEW_TOKENS, RUNNING),
                      iterations=jnp.zeros((b,), jnp.int32),
                      accept_hist=jnp.zeros((b, self.max_depth + 2), jnp.int32), row_keys=keys,
                      accept_by_pos=position_stats.empty(b),
                      logprobs=None if self.logprobs_k is None else
                      logprobs.empty(b, width, self.logprobs_k), sampling=rows)
        s = emit_block(s, first[:, None], finite.astype(jnp.int32), stops, max_new,
                       next_slots=self.max_nodes, finite=finite, lp=first_lp)
        return SlotState(core=s, stop_ids=stops, max_new=max_new,
                         drafted=cache.lengths if drafted is None else drafted, prompt=prompt,
                         grammar_state=jnp.zeros((b,), jnp.int32) if gstate is None else gstate,
                         grammar_host=ghost)

    # ---------------------------------------------------------------- programs
    @compiled()
    def init(self, params, dparams) -> SlotState:
        """Every slot free: no pages, done, nothing generated."""
        c = self.config
        B = self.slots
        table = jnp.full((B, self.max_pages), self.num_pages, jnp.int32)
        cache = kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim, table, self.num_pages,
                               self.page_size, c.dtype)
        dstate = None
        if self.drafter is not None:
            dstate = self.drafter.init_state(B, table, self.num_pages, self.page_size)
        keys = jax.random.split(jax.random.key(0), B)
        stops = jnp.full((B, self.stop_width), -1, jnp.int32)
        zero = jnp.zeros((B,), jnp.int32)
        prompt = jnp.zeros((B, self.sync_block), jnp.int32) if self.lazy_drafter else None
        return self.pinned(self._row(cache, dstate, zero, keys, jnp.ones((B,), bool), stops,
                                     zero, prompt=prompt, rows=self.sampling.rows(B)))

    @compiled(static=("lazy",), donate=("state",))
    def insert(self, params, dparams, state: SlotState, slot, prompt, prompt_len, table, stops,
               max_new, key, sampling=None, lazy: bool = False, grammar=None) -> SlotState:
        """Prefill ``prompt [1, T]`` into the pages of ``table [1, max_pages]`` and make it
        slot ``slot``'s row; ``key [1]``: the request's row key; ``sampling``: its settings
        (a :class:`jspec.sampling.RowSampling` of ``[1]`` runtime values; None: the config's).
        The other slots' KV and drafter state are not touched (the prefill writes only this
        row's pages).

        ``lazy`` (a drafter with :attr:`lazy_drafter`, ``T <= sync_block``): the target alone
        is prefilled and the row's drafter starts from nothing (``drafted`` 0), to be caught
        up by :meth:`sync` from position 0 if the row ever speculates. The engine inserts so
        when its occupancy decodes plain: most such rows finish plain, and a short prompt
        costs the catch-up one block at most. ``grammar``: the engine's grammar table with
        ``state [1]`` the row's initial state (None: no grammar is traced)."""
        TRACE_COUNTS["engine_insert"] += 1
        c = self.config
        # No settings are kept (nor traced) when nothing may sample.
        rows = self.sampling.rows(1) if sampling is None or not self.sampling.may_sample \
            else sampling
        params = pack_params(c, params)
        # A one-row cache over the live pools (its own zero pools are never read: XLA drops
        # them).
        cache = R.with_pools(kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim, table,
                                            self.num_pages, self.page_size, c.dtype),
                             state.core.cache)
        dstate = drafted = kept = None
        if self.drafter is not None:
            fresh = self.drafter.init_state(1, table, self.num_pages, self.page_size)
            dstate = R.with_pools(fresh, state.core.draft)
        if self.lazy_drafter:
            T, G = prompt.shape[1], self.sync_block
            if lazy and T > G:
                raise ValueError(f"a lazy insert takes a prompt bucket of at most "
                                 f"sync_block={G} tokens, got {T}")
            kept = jnp.pad(prompt, ((0, 0), (0, G - T))) if lazy else jnp.zeros((1, G), jnp.int32)
        elif lazy:
            raise ValueError("this engine's drafter cannot skip its prefill (lazy_drafter)")
        if self.drafter is None or lazy:
            dec = PlainDecoder(c, self.sampling, self.max_new_tokens, self.page_size,
                               self.num_pages, prefill_chunk=self.prefill_chunk)
            logits, cache = dec.prefill(params, prompt, prompt_len, cache)
            logits = gdev.mask_rows(grammar, logits)
            first = sample(logits, jax.vmap(jax.random.fold_in)(key, jnp.zeros((1,), jnp.int32)),
                           self.sampling, rows)
            finite = finite_rows(logits)
            drafted = None if dstate is None else jnp.zeros((1,), jnp.int32)
            first_lp = self._logprobs(logits, first)
        else:
            dec = self.spec_decoder(None)
            cache, dstate, first, key, finite, first_lp = dec.prefill_into(
                params, dparams, cache, dstate, prompt, prompt_len, key, rows, grammar)
        g = gdev.advance(grammar, first, finite)
        ghost = None if g is None else g.host
        h = state.grammar_host
        if ghost is None and h is not None:      # warm/scrub: a blank row, no matcher
            ghost = ghost_rows(h.session, slot[None], h.recent.shape[1], [False])
        row = self._row(cache, dstate, first, key, finite, stops, max_new, drafted, kept,
                        first_lp, rows, None if g is None else g.state, ghost)
        return self.pinned(R.put(state, row, slot[None], self.slots))

    @compiled(static=("spec",), donate=("state",))
    def decode(self, params, dparams, state: SlotState, rows, spec: SpecConfig | str | None = PLAIN,
               grammar=None) -> SlotState:
        """Up to ``chunk`` iterations (fewer when every row in ``rows`` is done) for slots
        ``rows [b]`` (distinct; free slots may pad the bucket: they are done and write
        nothing). ``spec``: a SpecConfig, None (the drafter's default tree) or :data:`PLAIN`,
        plain decoding (a drafter's state then lags: :meth:`sync` it before speculating;
        unsynced, speculation stays exact but its drafts are poor). ``grammar``: the engine's
        grammar table (its ``state`` replaced by the rows'); None: no grammar is traced."""
        TRACE_COUNTS["engine_decode"] += 1
        params = pack_params(self.config, params)
        sub = R.take(state, rows, self.slots)
        if grammar is not None:
            sub = sub.replace(core=sub.core.replace(grammar=grammar.replace(
                state=sub.grammar_state, host=sub.grammar_host)))
        if spec == PLAIN:
            core = self.plain_chunk(params, sub)
            drafted = sub.drafted
        else:
            dec = self.spec_decoder(spec)
            core = self._loop(lambda s: dec.iterate(params, dparams, s, sub.stop_ids,
                                                    sub.max_new), sub.core, lambda s: s.done)
            drafted = core.cache.lengths                 # speculation keeps the drafter current
        # A finished row gives its pages back after this call (the host frees them), so it
        # must write nothing more while it rides along in later chunks.
        core = R.release(core, core.done)
        if grammar is not None:
            sub = sub.replace(grammar_state=core.grammar.state, grammar_host=core.grammar.host)
            core = core.replace(grammar=None)
        return self.pinned(R.put(state, sub.replace(core=core, drafted=drafted), rows,
                                 self.slots))

    def _loop(self, step, carry, done):
        """``step`` up to ``chunk`` times, fewer when every row is ``done(carry)``."""
        def cond(c):
            return (c[0] < self.chunk) & ~jnp.all(done(c[1]))

        return jax.lax.while_loop(cond, lambda c: (c[0] + 1, step(c[1])),
                                  (jnp.zeros((), jnp.int32), carry))[1]

    def plain_chunk(self, params, sub: SlotState) -> SpecState:
        """Plain steps, the drafter left alone: a row's drafter then lags its target
        (``SlotState.drafted``) until :meth:`sync` catches it up, which the engine does only
        before a speculative chunk. Keeping the drafter current in every plain chunk (one
        drafter block forward and the target's features per step) cost the shipped model's
        16-slot engine 17% against plain decoding without a drafter, and most rows decoded
        plain (at high occupancy) finish plain."""
        step = lambda s: self.plain_iteration(params, s, sub.stop_ids, sub.max_new)
        return self._loop(step, sub.core, lambda s: s.done)

    @compiled(donate=("state",))
    def sync(self, params, dparams, state: SlotState, rows) -> SlotState:
        """Catch the drafter of slots ``rows [b]`` up with their target: for each position
        a plain chunk decoded, the target's features are recomputed (a block forward over
        the committed tokens that reads the KV already written and writes none, so the
        target's cache and output are untouched) and given to the drafter's ``extend``,
        ``sync_block`` positions per step, as the per-step extends would have. A row in
        step (or done) costs nothing but its share of the block. A lazily inserted row
        (:meth:`insert`) is caught up from position 0, its prompt included."""
        TRACE_COUNTS["engine_sync"] += 1
        params = pack_params(self.config, params)
        sub = R.take(state, rows, self.slots)
        c, s, G = self.config, sub.core, self.sync_block
        first = s.cache.lengths - s.num_generated + 1        # the prompt's length
        last = s.tokens.shape[1] - 1
        j = jnp.arange(G, dtype=jnp.int32)[None]

        def token_at(pos):
            """The committed token at ``pos``: generated, or a lazy row's prompt token."""
            at = pos - first[:, None]                        # index into the generated tokens
            tok = jnp.take_along_axis(s.tokens, jnp.clip(at, 0, last), 1)
            if sub.prompt is None:                           # a row is never behind its prompt
                return tok
            kept = jnp.take_along_axis(sub.prompt, jnp.clip(pos, 0, G - 1), 1)
            return jnp.where(at < 0, kept, tok)

        def lag(carry):
            s, drafted = carry
            return jnp.where(s.done, 0, s.cache.lengths - drafted)

        def step(carry):
            s, drafted = carry
            n = jnp.minimum(lag(carry), G)
            pos = drafted[:, None] + j
            toks, nxt = token_at(pos), token_at(pos + 1)
            # lengths = drafted: the block's queries see exactly the positions before them;
            # no write (valid all False), so they read the KV the plain steps wrote.
            hidden, aux, cache = forward(c, params, toks, pos, s.cache.replace(lengths=drafted),
                                         valid=jnp.zeros(toks.shape, bool),
                                         aux_layers=self.aux_layers,
                                         attention_fn=kernel_modes.attention_fn(self.kernels))
            feats = self.drafter.features(hidden, aux, toks)
            draft = self.drafter.extend(dparams, (c, params), s.draft, feats, nxt, n,
                                        kernels=self.kernels)
            return s.replace(cache=cache.replace(lengths=s.cache.lengths), draft=draft), \
                drafted + n

        s, drafted = jax.lax.while_loop(lambda c: jnp.any(lag(c) > 0), step, (s, sub.drafted))
        return self.pinned(R.put(state, sub.replace(core=s, drafted=drafted), rows, self.slots))

    def plain_iteration(self, params, s: SpecState, stop_ids, max_new):
        """One target step per live row: the root's KV written, the next token drawn with its
        position's key."""
        c = self.config
        live = ~s.done
        hidden, _, cache = forward(c, params, s.root[:, None], s.cache.lengths[:, None],
                                   s.cache, valid=live[:, None],
                                   attention_fn=kernel_modes.attention_fn(self.kernels))
        logits = lm_logits(c, params, hidden[:, 0])
        finite = finite_rows(logits)
        g = s.grammar
        logits = gdev.mask_rows(g, logits)
        tok = sample(logits, jax.vmap(jax.random.fold_in)(s.row_keys, s.num_generated),
                     self.sampling, s.sampling)
        n = live.astype(jnp.int32)
        hist = s.accept_hist.at[jnp.arange(tok.shape[0]), n].add(n)
        s = s.replace(cache=kvc.advance(cache, n), root=jnp.where(live, tok, s.root),
                      grammar=gdev.advance(g, tok, live),
                      iterations=s.iterations + n, accept_hist=hist,
                      accept_by_pos=position_stats.record(s.accept_by_pos, s.cache.lengths, n,
                                                          live))
        return emit_block(s, tok[:, None], (finite & live).astype(jnp.int32), stop_ids, max_new,
                          next_slots=self.max_nodes, finite=finite,
                          lp=self._logprobs(logits, tok))

    def _logprobs(self, logits, tok):
        """The ``[b, 1, ...]`` logprob block of ``tok [b]`` drawn from ``logits [b, V]``;
        None without :attr:`logprobs_k`."""
        if self.logprobs_k is None:
            return None
        return logprobs.of_tokens(logits[:, None], tok[:, None], self.logprobs_k)
