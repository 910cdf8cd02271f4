"""The speculative driver: prefill, then one ``lax.while_loop`` of
{draft, verify with tree attention, walk or sample, commit, draft extend}.

Like :class:`~jspec.decode.PlainDecoder`, :class:`SpecDecoder` holds only static,
hashable settings (target config, drafter spec, tree knobs, whether rows may sample) and
is jitted with ``static_argnames=('self',)``; each row's temperature, top-k and top-p are
runtime values in the state (:mod:`jspec.sampling`). Every row accepts its own number of tokens per
iteration; a row that is done (stop id, its own limit, or a full cache) keeps riding
along without committing anything.

Per iteration, for the target: the N tree nodes are written to N slots after each
row's committed length (positions ``length + depth``), the walk picks the accepted
path, :func:`~jspec.verify.commit_accepted` moves its KV to the front and advances
the length. The emitted tokens are the accepted drafts plus the bonus token; the
bonus becomes the next tree's root (its KV is written by the next verify).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from jspec import kernels, kv_cache as kvc, logprobs, position_stats, prefill as chunked
from jspec.config import LlamaConfig
from jspec.grammar import device as grammar
from jspec.decode import MAX_NEW_TOKENS, RUNNING, TRACE_COUNTS, emit_block, finite_rows
from jspec.llama import forward, logits as lm_logits
from jspec.platform import target_platform
from jspec.serving_layout import pack_params
from jspec.sampling import SamplingConfig, sample, target_probs
from jspec.sharding import constrain_kv, per_data_shard
from jspec.shapes import Bool, Int, Key
from jspec.spec_config import SpecConfig
from jspec.verify import commit_accepted, emitted_tokens, greedy_walk, tree_sample_walk
from pallas_kernels.verify_walk import verify_walk_greedy, verify_walk_sample


def tree_shape(drafter, spec: SpecConfig | None) -> tuple[int, int]:
    """``(S, N)``: max tree depth and node count for this drafter (architecture) and knobs."""
    return drafter.tree_shape(spec)


@struct.dataclass
class SpecState:
    cache: kvc.PagedKVCache
    draft: Any                       # the drafter's own state pytree
    root: Int["B"]                   # last emitted token: the next tree's root
    tokens: Int["B out"]             # generated ids (out = max_new + S + 1 for overflow)
    num_generated: Int["B"]
    done: Bool["B"]
    stop_reason: Int["B"]
    iterations: Int["B"]             # verify passes while the row was live
    accept_hist: Int["B A1"]         # accept_hist[b, n] = iterations that emitted n tokens
    row_keys: Key["B"]
    accept_by_pos: Int["B P 2"]      # per context-position bucket (jspec.position_stats)
    # Beside ``tokens`` (jspec.logprobs), with a static ``logprobs_k``; None: none kept.
    logprobs: Any = None
    # Each row's settings (runtime values, jspec.sampling.RowSampling); None when the static
    # sampling config never samples (then the walk is greedy and nothing else is traced).
    sampling: Any = None
    # The rows' grammars and states after every emitted token, the root included
    # (jspec.grammar.device.GrammarState); None: unconstrained, nothing of it traced.
    grammar: Any = None


def verify_padding(batch: int, nodes: int) -> int:
    """Dummy tokens appended to a verify block on TPU/GPU so that ``nodes`` is a multiple of 8
    when ``batch > 1``: with, say, 8 rows of 5 nodes, XLA:TPU lays the [B * N] projection
    rows out batch-minor and relays every layer's q, k, v and attention output (13 more
    kernels in an 8B layer). The dummies are never written to the KV cache, no real node sees
    them, and their outputs are dropped. CPU: none (there t_V grows with the rows)."""
    if target_platform() == "cpu" or batch == 1:
        return 0
    return -nodes % 8


@dataclasses.dataclass(frozen=True)
class SpecDecoder:
    config: LlamaConfig
    drafter: Any                     # the drafter's architecture (jspec.drafters.DraftModule)
    spec: SpecConfig | None
    sampling: SamplingConfig
    max_new_tokens: int
    page_size: int
    num_pages: int
    forced_accept: float = 0.0       # > 0: benchmark mode, force this mean accept length
    mesh: Any = None
    # See jspec.kernels. One attention implementation for the target and the drafter: the
    # drafter's calls get it as kernels= (its committed blocks are square windows the
    # tree-attention kernel serves; its tree loop's wider window stays on XLA).
    kernels: str = "reference"
    # Sampling by position-keyed draws (the serving engine): each node's target token is
    # drawn with the key of the output position it decides, fold_in(row key, position), the
    # draw plain decoding makes there, and the walk keeps drafts equal to those draws. The
    # output is then plain sampling's token for token, whatever the tree shape, the batch or
    # the neighbours, and it accepts as often as tree rejection sampling for the
    # deterministic (top-K) drafts every kind makes: P(some child kept) = sum of p(children).
    coupled: bool = False
    prefill_chunk: int | None = None  # tokens per prefill chunk (None: jspec.prefill's default)
    # Static: each emitted token's logprob and top-k under the target's verify logits
    # (jspec.logprobs) kept beside the tokens; None: nothing is computed or stored.
    logprobs_k: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tree_shape(self.drafter, self.spec)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.drafter.target_layers

    # --------------------------------------------------------------- phases
    def prefill(self, params, dparams, prompt, prompt_lens, page_table, draft_table, key,
                rows=None, grammar_state=None):
        c = self.config
        cache = kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim, page_table,
                               self.num_pages, self.page_size, c.dtype)
        cache = constrain_kv(cache, c, self.mesh)
        dstate = self.drafter.init_state(prompt.shape[0], draft_table, self.num_pages,
                                         self.page_size)
        return self.prefill_into(params, dparams, cache, dstate, prompt, prompt_lens, key, rows,
                                 grammar_state)

    def prefill_into(self, params, dparams, cache, dstate, prompt, prompt_lens, key, rows=None,
                     grammar_state=None):
        """Prefill ``prompt [B, T]`` into a given cache and drafter state (fresh ones, or,
        in the serving engine, one row's pages of the live pools), chunk by chunk
        (:mod:`jspec.prefill`): each chunk through the target, then its (feature, next
        token) pairs into the drafter (``prefill`` for the first chunk, ``extend`` after).
        A row's last pair takes the first generated token, sampled in the chunk that holds
        the row's last prompt position, with the rows' settings ``rows``
        (:class:`jspec.sampling.RowSampling`; None: greedy, or the config's), masked by the
        rows' grammars (``grammar_state``, :mod:`jspec.grammar.device`; None: none). Returns
        ``(cache, drafter state, first token, row keys, finite, first token's logprob block
        [B, 1, ...] or None)``."""
        c, d = self.config, self.drafter
        params = pack_params(c, params)
        B = prompt.shape[0]
        # One key (split per row here) or the rows' keys (split before a data-sharded loop).
        row_keys = key if key.shape else jax.random.split(key, B)
        keys0 = jax.vmap(jax.random.fold_in)(row_keys, jnp.zeros(B, jnp.int32))
        attend = kernels.prefill_attention_fn(self.kernels, c, self.page_size)

        def step(carry, chunk, first_chunk):
            cache, dstate, last = carry
            hidden, aux, cache = chunked.target_chunk(c, params, cache, chunk, self.aux_layers,
                                                      attend)
            logits = lm_logits(c, params, chunk.take_last(hidden))
            g = grammar_state
            logits = grammar.mask_rows(g, logits)
            # (logits, first token) of the rows whose last prompt position is in this chunk.
            last = chunked.keep_last(chunk, (logits, sample(logits, keys0, self.sampling, rows)),
                                     last)
            nxt = jnp.where(chunk.positions == (prompt_lens - 1)[:, None], last[1][:, None],
                            chunk.next_tokens)
            feed = d.prefill if first_chunk else d.extend
            dstate = feed(dparams, (c, params), dstate, d.features(hidden, aux, chunk.tokens),
                          nxt, chunk.count, kernels=self.kernels)
            return cache, dstate, last

        cache, dstate, (logits, first) = chunked.run(prompt, prompt_lens, self.prefill_chunk,
                                                     step, (cache, dstate, None))
        return (cache.replace(lengths=prompt_lens.astype(jnp.int32)), dstate, first, row_keys,
                finite_rows(logits), self.path_logprobs(logits[:, None], first[:, None]))

    def verify(self, params, cache, tree):
        pos = cache.lengths[:, None] + tree.depths
        params = pack_params(self.config, params)
        tokens, mask, valid = tree.tokens, tree.mask(), None
        B, N = tokens.shape
        pad = verify_padding(B, N)
        if pad:     # dummies: copies of the last node, seeing only themselves, never written
            tokens, pos = (jnp.pad(a, ((0, 0), (0, pad)), mode="edge") for a in (tokens, pos))
            real = jnp.arange(N + pad) < N
            mask = (jnp.pad(mask, ((0, 0), (0, pad), (0, pad)))
                    | (jnp.eye(N + pad, dtype=bool) & ~real[:, None])[None])
            valid = jnp.broadcast_to(real, (B, N + pad))
        hidden, aux, cache = forward(self.config, params, tokens, pos, cache,
                                     block_mask=mask, valid=valid, aux_layers=self.aux_layers,
                                     attention_fn=kernels.attention_fn(self.kernels))
        hidden, aux = hidden[:, :N], tuple(a[:, :N] for a in aux)
        logits = lm_logits(self.config, params, hidden)
        return logits, self.drafter.features(hidden, aux, tree.tokens), cache

    def walk(self, tree, logits, keys, choice=None, rows=None):
        """``(accept_index, accept_len, bonus)``. ``choice [B, N]`` (optional): the target's
        token after each node, drawn already (:attr:`coupled`); the greedy walk keeps drafts
        equal to it. Otherwise greedy takes the argmax and sampling runs tree rejection
        sampling with ``keys``, each row by its settings ``rows`` (a greedy row's one-hot
        distribution keeps exactly the greedy path)."""
        S, _ = self.shape
        argmax = jnp.argmax(logits, -1).astype(jnp.int32) if choice is None else choice
        greedy = not self.sampling.may_sample or choice is not None
        if greedy and self.kernels == "reference":
            return greedy_walk(tree, argmax, S)
        impl = kernels.walk_impl(self.kernels)
        # The walk kernel on every device of a model axis (its inputs are small; per_device).
        if greedy:
            args = (tree.tokens, tree.first_child, tree.next_sibling, argmax)
            return kernels.per_device(lambda *a: verify_walk_greedy(*a, max_depth=S, impl=impl),
                                      args, (P(),) * len(args), P())
        probs = target_probs(logits, self.sampling, rows)
        ka, kb = jax.vmap(jax.random.split, out_axes=1)(keys)
        u_acc = jax.vmap(lambda k: jax.random.uniform(k, (tree.num_nodes,)))(ka)
        u_bonus = jax.vmap(jax.random.uniform)(kb)
        if self.kernels == "reference":
            return tree_sample_walk(tree, probs, u_acc, u_bonus, S)
        args = (tree.tokens, tree.first_child, tree.next_sibling, probs, u_acc, u_bonus)
        return kernels.per_device(lambda *a: verify_walk_sample(*a, max_depth=S, impl=impl),
                                  args, (P(),) * len(args), P())

    def force_accept(self, tree, logits, keys):
        """Benchmark mode: accept a forced number of nodes per iteration (mean
        ``forced_accept``), whatever the drafts are. Nodes 0..n-1 are taken as a path (a random
        drafter's tree is often shallower), so the work per iteration (commit, extend, emission)
        is a real accept of length n's. The output is *not* the target's (plumbing, not quality)."""
        S, N = self.shape
        B = tree.tokens.shape[0]
        base = int(self.forced_accept)
        extra = jax.vmap(jax.random.uniform)(keys) < (self.forced_accept - base)
        n = jnp.clip(base + extra.astype(jnp.int32), 1, min(S + 1, N))
        k = jnp.arange(S + 1, dtype=jnp.int32)[None]
        idx = jnp.where(k < n[:, None], k, -1)
        last = n - 1
        return idx, n, jnp.argmax(logits[jnp.arange(B), last], -1).astype(jnp.int32)

    @staticmethod
    def finite_prefix(logits, idx, n):
        """``(n', finite)``: the walk read the logits of the path's nodes ``idx[:, :n]`` (each
        decided the next token); if one of them holds NaN or inf, only the tokens decided
        before it are kept (``n'``) and the row is not ``finite``, as plain decoding stops
        at the first position whose logits are not finite. Nodes off the path do not count."""
        ok = jnp.take_along_axis(jnp.all(jnp.isfinite(logits), -1), jnp.maximum(idx, 0), 1)
        k = jnp.arange(idx.shape[1])[None]
        first_bad = jnp.min(jnp.where(~ok & (k < n[:, None]), k, idx.shape[1]), axis=1)
        finite = first_bad >= n
        return jnp.where(finite, n, first_bad), finite

    def position_draws(self, s: SpecState, tree, logits):
        """``[B, N]`` (:attr:`coupled` sampling; None otherwise): the target's draw after each
        node, with the key plain decoding uses for that output position."""
        if not self.coupled or not self.sampling.may_sample:
            return None
        at = s.num_generated[:, None] + tree.depths
        node_keys = jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)))(s.row_keys, at)
        return sample(logits, node_keys, self.sampling, s.sampling)     # [B, N, V]: per row

    def path_logprobs(self, logits, toks):
        """The logprob block of ``toks [B, A]`` decided by ``logits [B, A, V]``, or None
        without :attr:`logprobs_k`."""
        if self.logprobs_k is None:
            return None
        return logprobs.of_tokens(logits, toks, self.logprobs_k)

    def emit(self, s: SpecState, toks, n, stop_ids, max_new, finite, lp=None) -> SpecState:
        _, N = self.shape
        # The next verify writes N slots.
        return emit_block(s, toks, n, stop_ids, max_new, next_slots=N, finite=finite, lp=lp)

    def draft_phase(self, params, dparams, s: SpecState):
        """The drafter's tree; under a grammar, of allowed tokens (a ``masks_drafts`` drafter),
        with the stretches the grammar forces filled in (:func:`grammar.force_tree`)."""
        kw = {"grammar": s.grammar} if s.grammar is not None and getattr(
            self.drafter, "masks_drafts", False) else {}
        tree = self.drafter.propose(dparams, (self.config, params), s.draft, s.root, self.spec,
                                    kernels=self.kernels, **kw)
        return grammar.force_tree(s.grammar, tree, self.shape[0])

    def finish_phase(self, params, dparams, s: SpecState, tree, logits, feats, cache, stop_ids,
                     max_new, node_states=None) -> SpecState:
        """Walk or sample, commit the accepted path, extend the drafter, emit tokens.
        ``node_states [B, N]``: each node's grammar state (``logits`` are masked by them
        already), from which the rows' states advance by what they accept."""
        live = ~s.done
        keys = jax.vmap(jax.random.fold_in)(s.row_keys, s.iterations + 1)
        with jax.named_scope("walk"):
            if self.forced_accept:
                idx, n, bonus = self.force_accept(tree, logits, keys)
            else:
                idx, n, bonus = self.walk(tree, logits, keys, self.position_draws(s, tree, logits),
                                         s.sampling)
        n = jnp.where(live, n, 0)
        toks, _ = emitted_tokens(tree, idx, jnp.maximum(n, 1), bonus)
        # Emitted token j was decided at the path's node j (the root decides the first
        # accepted draft, the last accepted node the bonus): its logits row gives the logprob.
        lp = None if self.logprobs_k is None else self.path_logprobs(
            jnp.take_along_axis(logits, jnp.maximum(idx, 0)[:, :, None], axis=1), toks)
        n, finite = self.finite_prefix(logits, idx, n)      # cut where the logits were not finite
        S, N = self.shape
        # A chain's accepted nodes are 0 .. n-1, and so are forced accepts: no KV moves.
        with jax.named_scope("commit"):
            cache, acc_feats = commit_accepted(cache, feats, idx, n,
                                               contiguous=N == S + 1 or bool(self.forced_accept))
        with jax.named_scope("extend"):
            dstate = self.drafter.extend(dparams, (self.config, params), s.draft, acc_feats,
                                         toks, n, kernels=self.kernels)
        hist = s.accept_hist.at[jnp.arange(toks.shape[0]), n].add(live.astype(jnp.int32))
        g = grammar.after_accept(s.grammar, node_states, idx, n, bonus, live, toks)
        s = s.replace(cache=cache, draft=dstate, root=jnp.where(live, bonus, s.root), grammar=g,
                      iterations=s.iterations + live.astype(jnp.int32), accept_hist=hist,
                      accept_by_pos=position_stats.record(s.accept_by_pos, s.cache.lengths, n,
                                                          live))
        return self.emit(s, toks, n, stop_ids, max_new, finite, lp)

    def iterate(self, params, dparams, s: SpecState, stop_ids, max_new) -> SpecState:
        # Named scopes put the phase into every op's metadata, so a profile of the compiled
        # loop can be split into draft / verify / finish without host round trips.
        with jax.named_scope("draft"):
            tree = self.draft_phase(params, dparams, s)
        with jax.named_scope("verify"):
            logits, feats, cache = self.verify(params, s.cache, tree)
        with jax.named_scope("grammar"):
            logits, node_states = grammar.mask_tree(s.grammar, tree, logits, self.shape[0])
        with jax.named_scope("finish"):
            return self.finish_phase(params, dparams, s, tree, logits, feats, cache, stop_ids,
                                     max_new, node_states)

    # ------------------------------------------------------------------ run
    def initial_state(self, params, dparams, prompt, prompt_lens, page_table, draft_table, stop_ids,
                      max_new, key, rows=None, grammar_state=None) -> SpecState:
        S, _ = self.shape
        B = prompt.shape[0]
        rows = self.sampling.rows(B) if rows is None else rows
        cache, dstate, first, row_keys, finite, first_lp = self.prefill(
            params, dparams, prompt, prompt_lens, page_table, draft_table, key, rows,
            grammar_state)
        s = SpecState(
            cache=cache, draft=dstate, root=first,
            tokens=jnp.zeros((B, self.max_new_tokens + S + 1), jnp.int32),
            num_generated=jnp.zeros((B,), jnp.int32), done=max_new <= 0,
            stop_reason=jnp.where(max_new <= 0, MAX_NEW_TOKENS, RUNNING),
            iterations=jnp.zeros((B,), jnp.int32), accept_hist=jnp.zeros((B, S + 2), jnp.int32),
            row_keys=row_keys, accept_by_pos=position_stats.empty(B),
            logprobs=None if self.logprobs_k is None else
            logprobs.empty(B, self.max_new_tokens + S + 1, self.logprobs_k), sampling=rows,
            grammar=grammar.advance(grammar.widened(grammar_state, S + 1), first, finite))
        return self.emit(s, first[:, None], finite.astype(jnp.int32), stop_ids, max_new, finite,
                         first_lp)

    @functools.partial(jax.jit, static_argnames=("self",))
    def run(self, params, dparams, prompt, prompt_lens, page_table, draft_table, stop_ids, max_new,
            key, rows=None, grammar=None) -> SpecState:
        """As :meth:`jspec.decode.PlainDecoder.run` (``key``: one key or the rows' keys;
        ``rows``: runtime sampling settings; ``grammar``: the rows' grammars), with the
        drafter's params and page table."""
        TRACE_COUNTS["spec"] += 1
        params = pack_params(self.config, params)   # a no-op for packed (serving) params
        # The same keys on any mesh.
        row_keys = key if key.shape else jax.random.split(key, prompt.shape[0])
        args = (params, dparams, prompt, prompt_lens, page_table, draft_table, stop_ids,
                max_new, row_keys)
        if self.mesh is None:
            return self._loop(*args, rows, grammar)
        return per_data_shard(self.mesh, self._loop, 2)(*args)

    def _loop(self, params, dparams, prompt, prompt_lens, page_table, draft_table, stop_ids,
              max_new, row_keys, rows=None, grammar_state=None) -> SpecState:
        s = self.initial_state(params, dparams, prompt, prompt_lens, page_table, draft_table,
                               stop_ids, max_new, row_keys, rows, grammar_state)
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                                  lambda s: self.iterate(params, dparams, s, stop_ids, max_new), s)

    def profile(self, params, dparams, prompt, prompt_lens, page_table, draft_table, stop_ids,
                max_new, key) -> tuple[SpecState, dict]:
        """The same computation driven from the host one phase at a time, to measure where
        the time goes: seconds in draft / verify / other (walk, commit, extend, emit).
        Each phase is compiled once; warm-up (compilation) is excluded from the shares."""
        init = jax.jit(self.initial_state)
        draft = jax.jit(self.draft_phase)
        verify = jax.jit(self.verify)
        finish = jax.jit(self.finish_phase)
        args = (params, dparams, prompt, prompt_lens, page_table, draft_table, stop_ids, max_new, key)
        times = {"draft": 0.0, "verify": 0.0, "other": 0.0}

        def timed(name, f, *a):
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(*a))
            if name:
                times[name] += time.perf_counter() - t0
            return out

        for warm in (True, False):
            s = timed(None if warm else "other", init, *args)
            while not bool(jnp.all(s.done)):
                tree = timed(None if warm else "draft", draft, params, dparams, s)
                logits, feats, cache = timed(None if warm else "verify", verify, params, s.cache, tree)
                s = timed(None if warm else "other", finish, params, dparams, s, tree, logits, feats,
                          cache, stop_ids, max_new)
                if warm:
                    break
        total = sum(times.values())
        return s, {**{f"{k}_s": v for k, v in times.items()},
                   **{f"{k}_share": v / total for k, v in times.items()}}
