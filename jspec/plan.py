"""The seam between a request and a compiled decoder: :func:`plan` -> :class:`Plan`.

Everything host-side that ``generate`` does before it can run a compiled loop lives here,
once: prompts to ids, stop ids, the drafter's spec and overshoot (:func:`resolve_drafting`),
page admission (:func:`jspec.admission.admit`), the bucketed shapes
(:mod:`jspec.shape_buckets`), kernel resolution, and the decoder built with keyword
arguments. Every check runs here, on the host, before anything is traced. The serving
engine (:mod:`jspec.engine`), the tuner and the benchmarks use the same pieces, so a rule
(say, how many slots a speculative row overshoots) is written in one place.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import distributed as dist, executables, position_stats, shape_buckets as buckets
from jspec.grammar import constraint
from jspec.invariant_attention import compiler_options
from jspec.admission import ADMISSIONS, admit
from jspec.decode import STOP_REASONS, PlainDecoder
from jspec.kernels import check_mode as check_kernels, resolve as resolve_kernels
from jspec.logprobs import TokenLogprob, check_k, host_rows
from jspec.sampling import RowSampling, SamplingConfig
from jspec.sharding import batch_sharding
from jspec.spec_config import SpecConfig
from jspec.spec_decode import SpecDecoder
from jspec.target import Target
from jspec.drafters.calibration import check as check_selection
from jspec.tune_store import resolve_spec

log = logging.getLogger("jspec")

# A bucketed sampled batch compiles this config and carries its settings as runtime values
# (jspec.sampling.RowSampling), so one program serves every temperature, top-k and top-p.
RUNTIME_SAMPLING = SamplingConfig(temperature=1.0, per_request=True)


@dataclasses.dataclass(frozen=True)
class KVConfig:
    """The KV knobs that travel together. ``page_size``: slots per page. ``num_pages``: the
    page budget (None: enough for every row at ``max_len``). ``max_len``: slots per row
    (None: padded prompt + new tokens + overshoot). ``admission``: ``"reserve"`` refuses a
    batch whose whole need does not fit, ``"partial"`` admits rows with fewer pages, which
    stop with ``cache_full`` (see :func:`admit`). ``prompt_bucket``: prompts are padded to a
    multiple of it, so similar lengths share one compiled program. ``prefill_chunk``: tokens
    per prefill chunk (:mod:`jspec.prefill`; None: its default, 512), which bounds the
    prefill's temporaries by the chunk instead of the prompt's square."""

    page_size: int = 16
    num_pages: int | None = None
    max_len: int | None = None
    admission: str = "reserve"
    prompt_bucket: int = 16
    prefill_chunk: int | None = None

    def __post_init__(self):
        if self.admission not in ADMISSIONS:
            raise ValueError(f"kv_admission={self.admission!r}: expected one of {ADMISSIONS}")
        if self.page_size < 1 or self.prompt_bucket < 1 or (self.prefill_chunk is not None
                                                            and self.prefill_chunk < 1):
            raise ValueError(f"page_size, prompt_bucket and prefill_chunk must be >= 1, got "
                             f"{self.page_size}, {self.prompt_bucket}, {self.prefill_chunk}")


def prompt_ids(target: Target, prompts) -> tuple[list[list[int]], bool]:
    """``(ids per prompt, whether the prompts were text)``; one prompt or a list, each a
    string (needs a tokenizer) or token ids. Empty prompts and ids outside the vocabulary
    are refused, naming the prompt."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                    and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist() if prompts.ndim == 2 else [prompts.tolist()]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    is_text = isinstance(prompts[0], str)
    if is_text:
        if target.tokenizer is None:
            raise ValueError("text prompts need a target with a tokenizer; pass token ids instead")
        ids = [target.tokenizer.encode(p) for p in prompts]
    else:
        ids = [[int(t) for t in p] for p in prompts]
    V = target.config.vocab_size
    for r, p in enumerate(ids):
        check_prompt(p, V, r)
    return ids, is_text


def check_prompt(ids: Sequence[int], vocab: int, name) -> None:
    if not len(ids):
        raise ValueError(f"prompt {name} is empty: a prompt needs at least one token (e.g. BOS)")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt {name} has token id {bad[0]} outside the vocabulary [0, {vocab})")


def stop_table(target: Target, stop_ids, B: int, width: int | None = None) -> np.ndarray:
    """``[B, W]`` stop ids padded with -1 (default: the config's EOS ids); ``stop_ids`` is
    one list for every row or one list per row. ``W`` is a multiple of 8 (or ``width``), so
    a changing number of stop ids keeps the compiled shape."""
    if stop_ids is None:
        stop_ids = list(target.config.eos_token_ids)
    if stop_ids and isinstance(stop_ids[0], (list, tuple)):
        if len(stop_ids) != B:
            raise ValueError(f"per-row stop_ids has {len(stop_ids)} rows for {B} prompts")
        rows = [list(r) for r in stop_ids]
    else:
        rows = [list(stop_ids)] * B
    longest = max(len(r) for r in rows)
    if width is None:
        width = 8 * max(1, math.ceil(longest / 8))
    elif longest > width:
        raise ValueError(f"{longest} stop ids for one row; at most {width} fit")
    out = np.full((B, width), -1, np.int32)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out


@dataclasses.dataclass(frozen=True)
class Drafting:
    """A drafter checked against its target with one spec: ``S`` the deepest accepted path,
    ``N`` the verified nodes, ``overshoot`` the KV slots a row needs past its committed
    length (a verify writes N slots, a row may commit up to S past its limit, and the
    drafter's own loop needs :meth:`cache_slots`)."""

    drafter: Any
    spec: SpecConfig | None
    S: int
    N: int
    overshoot: int


def resolve_drafting(target: Target, drafter, spec, batch: int,
                     forced_accept: float = 0.0) -> Drafting:
    """Check ``drafter`` (a :class:`jspec.drafters.Drafter`) and ``spec`` (a SpecConfig, None
    for the drafter's default, or ``"auto"`` for the tuner's stored pick at ``batch``)."""
    spec = resolve_spec(drafter, spec, batch)
    spec = spec if spec is not None else drafter.default_spec
    drafter.module.validate(target.config, drafter.params)
    check_selection(drafter, spec)
    drafter.module.check_spec(spec)
    S, N = drafter.module.tree_shape(spec)
    if forced_accept and not 1.0 <= forced_accept <= S + 1:
        raise ValueError(f"forced_accept={forced_accept} must be in [1, S+1={S + 1}]")
    overshoot = max(N, drafter.module.cache_slots(spec)) + S + 1
    return Drafting(drafter, spec, S, N, overshoot)


def row_limits(max_new_tokens, B: int) -> np.ndarray:
    limits = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (B,)).astype(np.int32)
    if np.any(limits < 0):
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return limits


@dataclasses.dataclass(frozen=True)
class Plan:
    """One batch, checked and shaped: the compiled decoder (``decoder``: a frozen
    :class:`~jspec.decode.PlainDecoder` or :class:`~jspec.spec_decode.SpecDecoder`) and its
    per-request arguments on device. :meth:`run` runs it, :meth:`collect` turns its final
    state into a :class:`jspec.generate.GenerationResult`'s fields, :meth:`lower` lowers it
    with abstract arguments (AOT compiles, HLO analysis)."""

    target: Target
    decoder: Any
    drafter: Any                     # the served drafter (None: plain decoding)
    ids: list                        # prompt ids per row
    is_text: bool
    args: tuple                      # device arrays: prompt, lens, page_table, stops, limits
    mesh: Any = None
    multi: bool = False
    # Bucketed shapes (jspec.shape_buckets): the rows' sampling settings as runtime values
    # (None: the decoder's static config), and the compiled (rows, prompt block, KV length).
    rows: RowSampling | None = None
    bucketed: bool = False
    shape: tuple = ()
    # The rows' grammars on device (jspec.grammar.device.GrammarState; None: unconstrained).
    grammar: Any = None

    @property
    def batch(self) -> int:
        return len(self.ids)

    def call_args(self, key):
        """The decoder's arguments, in its ``run`` order, for ``key``. Bucketed, the rows'
        keys are split here for the real rows (so a row draws what it would in a batch of
        exactly these rows) and the padding rows reuse the first."""
        prompt, lens, table, stops, limits = self.args
        if self.bucketed:
            keys = jax.random.split(key, self.batch)
            pad = prompt.shape[0] - self.batch
            key = jnp.concatenate([keys, jnp.repeat(keys[:1], pad)]) if pad else keys
        params = self.target.serving_params
        if self.drafter is None:
            return (params, prompt, lens, table, stops, limits, key)
        return (params, self.drafter.params, prompt, lens, table, table, stops, limits, key)

    def run(self, key: jax.Array, profile: bool = False):
        """``(final state, profile dict or None)``."""
        if profile and self.drafter is not None:     # plain decoding has no phases to split
            return self.decoder.profile(*self.call_args(key))
        args, out = self.call_args(key), None
        try:
            if not self.bucketed:
                kw = {} if self.grammar is None else {"grammar": self.grammar}
                out = self.decoder.run(*args, **kw)
            else:
                out = self.executable(args)(*args, **self.runtime_kwargs)
        finally:                 # a host grammar's matchers serve one run, failed or not
            constraint.close(self.grammar, out)
        return out, None

    @property
    def runtime_kwargs(self) -> dict:
        """The decoder's runtime keyword arguments: sampling settings, and the grammars when
        there are any (left out otherwise, as every other caller of ``run`` leaves them)."""
        return {"rows": self.rows, **({} if self.grammar is None else {"grammar": self.grammar})}

    def executable(self, args=None):
        """The compiled decoder for these shapes (:mod:`jspec.executables`: once a process)."""
        args = self.call_args(jax.random.key(0)) if args is None else args
        B, T, L = self.shape
        what = (f"{'plain' if self.drafter is None else 'speculative'} decoding "
                f"({'sampled' if self.decoder.sampling.may_sample else 'greedy'}) for batch "
                f"{B}, prompt {T}, KV {L}")
        # W8A8 on CPU: the XLA options under which its verify rows keep their 1-token step's
        # bits inside the loop (jspec.invariant_attention.compiler_options).
        return executables.get(self.decoder, args, self.runtime_kwargs, what,
                               compiler_options(args))

    def lower(self, key: jax.Array | None = None):
        """The decoder's whole program lowered with abstract arguments (nothing runs)."""
        key = jax.random.key(0) if key is None else key
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=getattr(x, "sharding",
                                                                                None)),
                                self.call_args(key))
        return self.decoder.run.trace(self.decoder, *abstract, **self.runtime_kwargs).lower()

    def collect(self, state) -> tuple[list[list[int]], list[dict]]:
        """``(tokens per row, stats per row)`` of a final state, this process's rows."""
        spec = self.drafter is not None
        out = (state.tokens, state.num_generated, state.stop_reason,
               state.iterations if spec else state.num_generated,
               state.accept_hist if spec else None, state.accept_by_pos if spec else None)
        if self.multi:                      # this process's rows of the global arrays
            out = tuple(None if x is None else dist.local_rows(self.mesh, x) for x in out)
        toks, n, reasons, iters, hist, by_pos = jax.device_get(out)
        lens = np.asarray([len(p) for p in self.ids])
        tokens = [toks[r, :n[r]].tolist() for r in range(self.batch)]
        stats = [row_stats(int(lens[r]), int(n[r]), int(iters[r]), int(reasons[r]),
                           None if hist is None else hist[r],
                           None if by_pos is None else by_pos[r]) for r in range(self.batch)]
        return tokens, stats

    def collect_logprobs(self, state) -> list[list[TokenLogprob]] | None:
        """Each row's generated tokens' :class:`jspec.logprobs.TokenLogprob` s (aligned with
        :meth:`collect`'s tokens), or None when the decoder keeps none (``logprobs_k``)."""
        if state.logprobs is None:
            return None
        out = (state.tokens, state.num_generated, state.logprobs)
        if self.multi:
            out = jax.tree.map(lambda x: dist.local_rows(self.mesh, x), out)
        toks, n, buf = jax.device_get(out)
        return [host_rows(buf.token[r, :n[r]], buf.top_ids[r, :n[r]], buf.top[r, :n[r]],
                          toks[r, :n[r]]) for r in range(self.batch)]


def row_stats(prompt_len: int, new_tokens: int, iterations: int, reason: int, hist,
              by_pos=None) -> dict:
    """A row's stats as ``generate`` and the engine report them; ``by_pos``: the row's
    :mod:`jspec.position_stats` table, reported as ``accept_by_position``."""
    row = {"prompt_len": prompt_len, "new_tokens": new_tokens, "iterations": iterations,
           "stop_reason": STOP_REASONS[reason]}
    if hist is not None:
        h = np.asarray(hist)
        row["accept_hist"] = h.tolist()   # [n] = verify passes that emitted n tokens
        row["mean_accept_len"] = float((h * np.arange(len(h))).sum() / max(1, h.sum()))
    if by_pos is not None:
        row["accept_by_position"] = position_stats.summary(by_pos)
    return row


def _data_shards(mesh, multi: bool, B: int) -> int:
    if mesh is None:
        return 1
    # Multi-host: this process's prompts fill the data shards on its own devices.
    shards = dist.check_mesh(mesh) if multi else mesh.shape["data"]
    if B % shards:
        raise ValueError(f"batch of {B} rows does not split over the mesh's data axis of size "
                         f"{shards}" + (" on this process" if multi else ""))
    return shards


def _place(rows: list, mesh, multi: bool) -> list:
    if multi:
        return [dist.global_rows(mesh, x) for x in rows]
    if mesh is not None:
        return [jax.device_put(x, batch_sharding(mesh, x.ndim)) for x in rows]
    return [jnp.asarray(x) for x in rows]


def plan(target: Target, prompts, *, max_new_tokens: int | Sequence[int] = 64,
         sampling: SamplingConfig = SamplingConfig(), stop_ids=None, kv: KVConfig = KVConfig(),
         mesh=None, drafter=None, spec: SpecConfig | str | None = None,
         forced_accept: float = 0.0, kernels: str = "auto", logprobs_k: int | None = None,
         exact_shapes: bool = False, response_format=None) -> Plan:
    """Check a request and build its compiled decoder; see :func:`jspec.generate` for the
    arguments. Every error a request can have is raised here, before anything compiles.
    Shapes are bucketed (:mod:`jspec.shape_buckets`) on one device unless ``exact_shapes``."""
    check_kernels(kernels)
    logprobs_k = check_k(logprobs_k, "logprobs")
    ids, is_text = prompt_ids(target, prompts)
    B = len(ids)
    lens = np.array([len(p) for p in ids], np.int32)
    limits = row_limits(max_new_tokens, B)
    drafting = None
    if drafter is not None:
        drafting = resolve_drafting(target, drafter, spec, B, forced_accept)
    agreed, multi = None, dist.is_multiprocess(mesh)
    shards = _data_shards(mesh, multi, B)
    stops = stop_table(target, stop_ids, B)
    if multi:
        *agreed, width = dist.agree(B, [lens.max(), limits.max(), stops.shape[1]])
        stops = np.pad(stops, ((0, 0), (0, width - stops.shape[1])), constant_values=-1)
    # Bucketed shapes (jspec.shape_buckets) on one device. Rows are not padded under a page
    # budget the caller set (theirs to spend) or for a drafter with a row of parameters per
    # batch row (the oracle's known answers).
    bucketed = not exact_shapes and mesh is None
    per_row = drafter is not None and getattr(drafter.module, "per_row_params", False)
    Bc = buckets.rows(B) if bucketed and kv.num_pages is None and not per_row else B
    grammar_state = constraint.plan_grammar(target, response_format, stops, B, Bc,
                                            mesh=mesh, forced_accept=forced_accept)
    lens, limits, stops = buckets.pad_rows(Bc, lens, limits, stops)
    T, cap_new, num_pages, page_table = admit(
        lens, limits, drafting.overshoot if drafting else 0, kv.prompt_bucket, kv.max_len,
        kv.page_size, kv.num_pages, shards, agreed, kv.admission, bucketed,
        target.config.max_position_embeddings)
    kernels = resolve_kernels(kernels, target.config, page_size=kv.page_size,
                              num_nodes=drafting.N if drafting else 1,
                              max_depth=drafting.S if drafting else None,
                              greedy=sampling.greedy, batch=Bc, max_pages=page_table.shape[1],
                              num_pages=num_pages, mesh=mesh)
    prompt = np.zeros((Bc, T), np.int32)
    for r, p in enumerate(ids):
        prompt[r, :len(p)] = p
    rows_sampling = None
    if bucketed and sampling.may_sample and not sampling.per_request:
        rows_sampling, sampling = sampling.rows(Bc), RUNTIME_SAMPLING
    rows = _place([prompt, lens, page_table, stops, limits], mesh, multi)
    common = dict(config=target.config, sampling=sampling, max_new_tokens=cap_new,
                  page_size=kv.page_size, num_pages=num_pages, mesh=mesh, kernels=kernels,
                  prefill_chunk=kv.prefill_chunk, logprobs_k=logprobs_k)
    served = None
    if drafting is None:
        decoder = PlainDecoder(**common)
    else:
        # Validated above in its checkpoint layout; on a mesh, sharded like the target's layers.
        served = drafter.serving if mesh is None else drafter.on_mesh(target.config, mesh)
        decoder = SpecDecoder(drafter=served.module, spec=drafting.spec,
                              forced_accept=float(forced_accept), **common)
    return Plan(target=target, decoder=decoder, drafter=served, ids=ids, is_text=is_text,
                args=tuple(rows), mesh=mesh, multi=multi, rows=rows_sampling,
                bucketed=bucketed, shape=(Bc, T, page_table.shape[1] * kv.page_size),
                grammar=grammar_state)
