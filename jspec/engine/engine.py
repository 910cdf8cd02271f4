"""The serving engine: a fixed number of slots, refilled as requests finish.

:class:`Engine` is made once (target, optional drafter, slots, KV budget, kernels) and
serves any number of :class:`Request` s: :meth:`Engine.stream` yields :class:`Delta` s as
tokens are accepted, :meth:`Engine.generate` returns :class:`Completion` s in input order.

The host loop, between compiled calls:

1. admit: while a slot is free and the page budget holds the next request's whole need
   (prompt, its ``max_new_tokens`` and the speculative overshoot), give it pages and prefill
   it into the slot (:meth:`Programs.insert`); requests are admitted in order. A short
   prompt joining an occupancy that decodes plain skips the drafter's prefill (a lazy
   insert: its drafter is caught up from nothing if it ever speculates);
2. decode: run up to ``chunk`` iterations on the live slots, gathered into the smallest
   bucket (1, 2, 4, ..., slots) that holds them, with the spec the policy gives that bucket
   (:mod:`jspec.engine.policy`; plain decoding included). Plain chunks leave a drafter
   alone; before a speculative chunk, rows that plain chunks left behind have their
   drafter caught up (:meth:`Programs.sync`);
3. read back lengths and tokens, emit deltas, free the pages of finished rows.

The programs are compiled once per prompt bucket (insert; twice for the short buckets
when lazy inserts can happen), per (spec, bucket) (decode) and per bucket (sync), so a
stream of any length and mix compiles a small fixed set. Output never depends on the
neighbours: a request's greedy tokens equal ``generate`` of it alone, and its samples
depend only on its own settings and key (position-keyed sampling; see
:mod:`jspec.engine.programs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jspec import kv_cache as kvc
from jspec.compiled import options_for
from jspec.engine.grammars import SlotGrammars, automaton_for, grammar_kw, insert_grammar
from jspec.engine.live import Checked, LiveEngine
from jspec.engine.logprob_host import EngineLogprobs, check_k, check_request as check_logprobs
from jspec.engine.pages import PagePool
from jspec.engine.requests import Completion, Delta, Request, prompt_ids, row_key
from jspec.engine.buckets import bucket_of, buckets_for, prompt_buckets
from jspec.engine.policy import Policy, mode_label, resolve_policy
from jspec.engine.programs import PLAIN, Programs
from jspec.engine.stop_strings import FINISH_REASONS, TextStream, check_stop, match_tokens, stable
from jspec.kernels import check_mode as check_kernels, resolve as resolve_kernels
from jspec.plan import check_prompt, row_stats, stop_table
from jspec.sampling import SamplingConfig
from jspec.target import Target

log = logging.getLogger("jspec")


@dataclasses.dataclass
class _Live:
    req: Request
    index: int
    ids: list[int]
    pages: list[int]
    sent: int = 0                   # tokens already streamed
    first_s: float | None = None
    logprobs: list | None = None    # its tokens' TokenLogprobs so far (Request.logprobs)
    t0: float = 0.0                 # when its latencies start (the stream's start, or submit)
    out: TextStream | None = None   # its text streamed so far (stop strings held back)


DEFAULT_MAX_LEN = 4096


def default_slots() -> int:
    """Slots when none are given: 8 on CPU (a 2-core host is busy at 8 rows of the shipped
    model), 64 on accelerators (a v5e/H200 decode step is memory bound well past that)."""
    return 8 if jax.default_backend() == "cpu" else 64


class Engine(LiveEngine):
    """A continuous-batching engine; see the module doc (live use: :mod:`jspec.engine.live`).

    ``target``, ``drafter`` (optional: a :class:`jspec.drafters.Drafter`), ``slots`` (B;
    default :func:`default_slots`), ``policy``: which spec each bucket of live slots runs
    (:class:`jspec.engine.policy.Policy`, ``"auto"`` for the picks ``python -m jspec tune
    --occupancy`` stored beside the drafter, or None: ``spec`` (default: the drafter's) at
    every occupancy). ``sampling``: the requests' default settings (a request's own
    ``temperature``, ``top_k`` and ``top_p`` are runtime values of its slot); greedy without
    ``per_request=True`` compiles greedy decoding alone (the fastest), and a request asking to
    sample is then refused. ``max_new_tokens``: the default and the most any request may ask
    for. A request's ``response_format`` is served from one grammar table
    (:mod:`jspec.engine.grammars`). ``max_len``: KV slots per row (default: room for a prompt
    of ``longest_prompt`` tokens, else of ``min(max_position_embeddings, 4096)``, plus
    ``max_new_tokens`` and the speculative overshoot; the reference attention on CPU reads a
    row's whole allocation, so size it to the work); ``num_pages``: the page budget
    (default: every slot can hold a ``max_len`` row; with fewer, requests wait for pages).
    ``chunk``: iterations per decode call, between which rows are refilled and output streams. ``mesh``: a
    ``(1, model)`` mesh (:func:`jspec.sharding.make_mesh`) for tensor parallelism within a
    host, the target placed on it (``jspec.load_target(path, mesh=mesh)``); data parallelism
    is one engine per host (``python -m jspec run --distributed``). ``prefill_chunk``: an
    inserted prompt is prefilled this many tokens at a time (:mod:`jspec.prefill`; default
    512), so a long prompt's insert needs memory for a chunk, not the prompt's square.
    """

    def __init__(self, target: Target, drafter=None, *, slots: int | None = None, spec=None,
                 policy: Policy | str | None = None,
                 sampling: SamplingConfig = SamplingConfig(), max_new_tokens: int = 256,
                 max_len: int | None = None, page_size: int = 16, num_pages: int | None = None,
                 chunk: int = 8, prompt_bucket: int = 16, stop_width: int = 8,
                 kernels: str = "auto", longest_prompt: int | None = None, mesh=None,
                 prefill_chunk: int | None = None, logprobs_k: int | None = None):
        check_kernels(kernels)
        self.logprobs_k = check_k(logprobs_k)        # static (jspec.logprobs); None: off
        B = default_slots() if slots is None else int(slots)
        if B < 1 or chunk < 1 or max_new_tokens < 1:
            raise ValueError(f"slots, chunk and max_new_tokens must be >= 1, got {B}, {chunk}, "
                             f"{max_new_tokens}")
        if mesh is not None and mesh.shape.get("data", 1) != 1:
            raise ValueError(f"the engine shards over a (1, model) mesh (tensor parallelism); "
                             f"this one has data={mesh.shape['data']}: run one engine per host "
                             f"(python -m jspec run --distributed) for data parallelism")
        self.mesh = mesh
        self.target, self.slots, self.sampling, self.chunk = target, B, sampling, chunk
        self.max_new_tokens = int(max_new_tokens)
        self.buckets = buckets_for(B)
        self.policy, S, N, overshoot = resolve_policy(target, drafter, policy, spec,
                                                      self.buckets, B)
        self.overshoot = overshoot
        if max_len is None:
            top = longest_prompt or min(target.config.max_position_embeddings, DEFAULT_MAX_LEN)
            max_len = -(-top // prompt_bucket) * prompt_bucket + self.max_new_tokens + overshoot
        self.max_len = int(max_len)
        if self.max_len < 1 + self.max_new_tokens + overshoot:
            raise ValueError(f"max_len={self.max_len} cannot hold a 1-token prompt, "
                             f"max_new_tokens={self.max_new_tokens} and {overshoot} slots of "
                             f"speculative overshoot")
        max_pages = kvc.pages_needed(self.max_len, page_size)
        num_pages = B * max_pages if num_pages is None else int(num_pages)
        self.pages = PagePool(num_pages, page_size, max_pages)
        self.prompt_buckets = prompt_buckets(prompt_bucket, self.max_len - overshoot - 1)
        self.drafter = None if drafter is None else \
            drafter.serving if mesh is None else drafter.on_mesh(target.config, mesh)
        kernels = resolve_kernels(kernels, target.config, page_size=page_size,
                                  num_nodes=max(N, 1), max_depth=S if drafter else None,
                                  greedy=True, batch=B, max_pages=max_pages, num_pages=num_pages,
                                  mesh=mesh)
        self.programs = Programs(
            config=target.config, drafter=None if drafter is None else self.drafter.module,
            sampling=sampling, slots=B, max_new_tokens=self.max_new_tokens, max_depth=S,
            max_nodes=max(N, 1), page_size=page_size, num_pages=num_pages, max_pages=max_pages,
            stop_width=stop_width, chunk=chunk, kernels=kernels, mesh=mesh,
            prefill_chunk=prefill_chunk, logprobs_k=self.logprobs_k,
            compiler_options=options_for(target.serving_params))
        self._lp = EngineLogprobs(self.programs, self.prompt_buckets, self.logprobs_k,
                                  lambda: (self.target.serving_params, self._on_mesh()))
        self._dparams = None if drafter is None else self.drafter.params
        self.state = None
        self.chunk_log: list[tuple[int, int, str]] = []   # (live, bucket, mode) per decode call
        self.syncs = 0                  # drafter catch-ups run (Programs.sync)
        self.lazy_inserts = 0           # inserts without the drafter's prefill (_lazy)
        self._behind: set[int] = set()  # slots whose drafter plain chunks left behind
        self.grammars = SlotGrammars(target.config.vocab_size, B, S + 1)  # response_format
        self._live_init()

    # ------------------------------------------------------------------ requests
    def _request(self, r, index: int) -> tuple[Request, list[int]]:
        req = r if isinstance(r, Request) else Request(prompt=r)
        if req.id is None:
            req = dataclasses.replace(req, id=index)
        req, ids = prompt_ids(req, self.target)
        req = dataclasses.replace(req, stop=check_stop(req.stop, req.id, self.target.tokenizer))
        check_prompt(ids, self.target.config.vocab_size, req.id)
        check_logprobs(req, self.logprobs_k)
        automaton_for(self.target, req)         # a bad format fails here, before any compile
        n = self.max_new_tokens if req.max_new_tokens is None else int(req.max_new_tokens)
        if not 0 <= n <= self.max_new_tokens:
            raise ValueError(f"request {req.id}: max_new_tokens={n} outside [0, "
                             f"{self.max_new_tokens}] (the engine's max_new_tokens)")
        if len(ids) > self.prompt_buckets[-1]:
            raise ValueError(f"request {req.id}: its prompt has {len(ids)} tokens; this engine "
                             f"takes at most {self.prompt_buckets[-1]} (max_len={self.max_len} "
                             f"less {self.overshoot + 1} slots for decoding)")
        # None takes the engine's default; checked here, written into the slot at insert.
        sampling = self.sampling.resolve(req.temperature, req.top_k, req.top_p,
                                         f"request {req.id}")
        return dataclasses.replace(req, max_new_tokens=n, **sampling), ids

    def check(self, request) -> None:
        """Raise ``ValueError`` for a request this engine cannot serve (nothing runs)."""
        self._request(request, 0)

    def score(self, ids, k: int = 0) -> list:
        """Prompt logprobs (echo): :meth:`jspec.engine.logprob_host.EngineLogprobs.score`."""
        return self._lp.score(ids, k)

    # ------------------------------------------------------------------ running
    def _on_mesh(self):
        """Programs are traced with the mesh set, so the kernels run per device
        (:func:`jspec.kernels.per_device`) and the pools stay sharded."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _ensure_state(self):
        self._not_running()              # the live loop owns the state while it runs
        if self.state is None:
            with self._on_mesh():
                self.state = self.programs.init(self.target.serving_params, self._dparams)

    def _lazy(self, n_tokens: int, live_slots: int) -> bool:
        """Skip the drafter's prefill (:meth:`Programs.insert` ``lazy``) when the occupancy
        the row joins decodes plain (where rows mostly finish plain) and a catch-up from
        nothing would cost one more block at most."""
        if not self.programs.lazy_drafter:
            return False
        T = bucket_of(self.prompt_buckets, n_tokens)
        bucket = bucket_of(self.buckets, live_slots)
        return T <= self.programs.sync_block and self.policy[bucket] == PLAIN

    def _insert(self, slot: int, live: _Live, lazy: bool = False):
        ids = live.ids
        T = bucket_of(self.prompt_buckets, len(ids))
        prompt = np.zeros((1, T), np.int32)
        prompt[0, :len(ids)] = ids
        table = np.full((1, self.pages.max_pages), self.pages.num_pages, np.int32)
        table[0, :len(live.pages)] = live.pages
        stops = stop_table(self.target, live.req.stop_ids, 1, self.programs.stop_width)
        (self._behind.add if lazy else self._behind.discard)(slot)
        self.lazy_inserts += lazy
        grammar, self.state = insert_grammar(self.grammars, slot,
                                             automaton_for(self.target, live.req), self.state)
        with self._on_mesh():
            self.state = self.programs.insert(
                self.target.serving_params, self._dparams, self.state, jnp.int32(slot),
                jnp.asarray(prompt), jnp.asarray([len(ids)], jnp.int32), jnp.asarray(table),
                jnp.asarray(stops), jnp.asarray([live.req.max_new_tokens], jnp.int32),
                row_key(live.req),
                self.sampling.row(live.req.temperature, live.req.top_k, live.req.top_p), lazy=lazy,
                **grammar_kw(grammar))

    def warm(self, longest_prompt: int | None = None, buckets=None) -> None:
        """Compile every program now: insert for each prompt bucket up to ``longest_prompt``
        (default: all), decode for each (mode, bucket) of the policy (``buckets``: only
        these buckets of live slots). Nothing changes: the
        warm insert has no pages (its row is done at once) and the decode calls run on free
        slots (no iteration). Call it between streams, not during one."""
        self._ensure_state()
        top = longest_prompt or self.prompt_buckets[-1]
        lazy = [False, True] if any(self._lazy(1, b) for b in self.buckets) else [False]
        for T in self.prompt_buckets:
            if T > top and T != self.prompt_buckets[0]:
                break
            for z in lazy:
                if not z or T <= self.programs.sync_block:
                    self._insert(0, _Live(Request([0] * T, 1), 0, [0] * T, pages=[]), lazy=z)
        self._behind.clear()
        self.lazy_inserts = 0
        modes = {mode_label(m): m for m in self.policy.picks.values()}.values()
        switches = self.drafter is not None and PLAIN in modes and len(modes) > 1
        with self._on_mesh():
            for b in self.buckets if buckets is None else buckets:
                rows = jnp.arange(b, dtype=jnp.int32)
                if switches and self.policy[b] != PLAIN:
                    self.state = self.programs.sync(self.target.serving_params, self._dparams,
                                                    self.state, rows)
                for mode in modes:
                    self.state = self.programs.decode(self.target.serving_params,
                                                      self._dparams, self.state, rows,
                                                      spec=mode)
        jax.block_until_ready(self.state)

    def stream(self, requests: Iterable, order: str = "arrival") -> Iterator[Delta]:
        """Serve ``requests`` (:class:`Request` s, or prompts), yielding :class:`Delta` s as
        tokens are accepted; each request's last delta carries its :class:`Completion`.
        ``order``: ``"arrival"`` admits requests as given (requests are then checked as they
        are admitted: a bad one raises ``ValueError`` naming it; :meth:`check` them first to
        skip instead); ``"longest"`` admits the longest (prompt + ``max_new_tokens``) first,
        which for a whole dataset leaves short requests for the end, where few slots are
        live (longest-processing-time-first scheduling), and checks every request up front."""
        self._ensure_state()
        pending = deque(enumerate(requests))
        if order == "longest":
            size = {i: len(ids) + req.max_new_tokens
                    for i, (req, ids) in ((i, self._request(r, i)) for i, r in pending)}
            pending = deque(sorted(pending, key=lambda p: -size[p[0]]))
        elif order != "arrival":
            raise ValueError(f"order={order!r}: 'arrival' or 'longest'")
        slots: list[_Live | None] = [None] * self.slots
        t0 = time.perf_counter()
        while pending or any(slots):
            yield from self._step(pending, slots, t0)

    def _step(self, pending: deque, slots: list, t0: float | None) -> Iterator[Delta]:
        """One chunk boundary (stream's and the live loop's): admit from ``pending`` (``(index,
        request or Checked)``; ``t0``: when the former's latencies start), decode, deltas."""
        self._admit(pending, slots, t0)
        live = [s for s in range(self.slots) if slots[s] is not None]
        if live:
            self._decode(live, slots)
            yield from self._deltas(live, slots, time.perf_counter())

    def _admit(self, pending: deque, slots: list, t0: float | None) -> None:
        """Fill free slots from the front of ``pending`` while the pages last (in order: a
        request that does not fit yet waits, and so do the ones behind it); then prefill
        them, knowing the occupancy they join (:meth:`_lazy`)."""
        new = []
        for slot in range(self.slots):
            if slots[slot] is not None or not pending:
                continue
            index, raw = pending[0]
            req, ids, t = raw if isinstance(raw, Checked) else (*self._request(raw, index), t0)
            need = len(ids) + req.max_new_tokens + self.overshoot
            pages = self.pages.take(need)
            if pages is None:
                if not any(slots):
                    raise kvc.KVCacheExhaustedError(
                        f"request {req.id} needs {self.pages.needed(need)} pages and the whole "
                        f"budget is {self.pages.num_pages}")
                break                           # wait for a finished row's pages
            pending.popleft()
            slots[slot] = _Live(req, index, ids, pages, t0=t, out=TextStream(req.stop))
            new.append(slot)
        live = sum(s is not None for s in slots)
        for slot in new:
            self._insert(slot, slots[slot], self._lazy(len(slots[slot].ids), live))

    def _decode(self, live: list[int], slots: list) -> None:
        """One chunk for the live slots, padded with free ones to their bucket."""
        self._scrub(slots)
        bucket = bucket_of(self.buckets, len(live))
        free = [s for s in range(self.slots) if slots[s] is None]
        rows = np.asarray(live + free[:bucket - len(live)], np.int32)
        mode = self.policy[bucket]
        self.chunk_log.append((len(live), bucket, mode_label(mode)))
        with self._on_mesh():
            if self.drafter is not None and mode == PLAIN:
                self._behind.update(live)
            elif self._behind.intersection(live):
                # Plain chunks left these rows' drafter behind: catch it up first.
                self.state = self.programs.sync(self.target.serving_params, self._dparams,
                                                self.state, jnp.asarray(rows))
                self._behind.difference_update(live)
                self.syncs += 1
            self.state = self.programs.decode(self.target.serving_params, self._dparams,
                                              self.state, jnp.asarray(rows), spec=mode,
                                              **grammar_kw(self.grammars.tables))

    def _deltas(self, live: list[int], slots: list, now: float) -> Iterator[Delta]:
        """What the chunk added to each live slot; finished rows complete and free their slot."""
        core = self.state.core
        done, n, reason, iters, hist, by_pos, toks = jax.device_get(
            (core.done, core.num_generated, core.stop_reason, core.iterations, core.accept_hist,
             core.accept_by_pos, core.tokens))
        window = self._lp.window(core, live, slots)
        tok = self.target.tokenizer
        for s in live:
            lv = slots[s]
            m = int(n[s])
            # A stop string ends the request at the token completing it (stop_strings).
            hit = match_tokens(tok, toks[s, :m], lv.sent, lv.req.stop)
            m = m if hit is None else hit[0]
            new = toks[s, lv.sent:m].tolist()
            lps = self._lp.new(window, s, lv, m, new)
            if new and lv.first_s is None:
                lv.first_s = now - lv.t0
            end = bool(done[s]) or hit is not None
            # Streamed text holds back an incomplete character and a stop string's start.
            text = None if tok is None else lv.out.step(
                stable(tok, toks[s, :m]) if hit is None else hit[1], end)
            lv.sent = m
            if not end:
                if new:
                    yield Delta(lv.req.id, lv.index, new, text, logprobs=lps)
                continue
            spec = self.drafter is not None
            stats = row_stats(len(lv.ids), m, int(iters[s]), int(reason[s]),
                              hist[s] if spec else None, by_pos[s] if spec else None)
            why = "stop" if hit is not None else FINISH_REASONS[int(reason[s])]
            stats.update(latency_s=now - lv.t0, first_token_s=lv.first_s)
            if hit is not None:
                stats["stop_reason"] = "stop_string"
            out = toks[s, :m].tolist()
            full = None if tok is None else hit[1] if hit is not None else tok.decode(out)
            self._release(s, slots, dirty=not done[s])
            lp_out, lp_prompt = self._lp.completion(lv, len(out))
            yield Delta(lv.req.id, lv.index, new, text, done=True, finish_reason=why,
                        logprobs=lps,
                        completion=Completion(lv.req.id, lv.index, lv.ids, out, full, stats,
                                              finish_reason=why, logprobs=lp_out,
                                              prompt_logprobs=lp_prompt))

    def generate(self, requests: Iterable, order: str = "longest") -> list[Completion]:
        """Serve every request (longest first by default, see :meth:`stream`); completions
        in input order."""
        out = {}
        for d in self.stream(requests, order=order):
            if d.done:
                out[d.index] = d.completion
        return [out[i] for i in sorted(out)]
