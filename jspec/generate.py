"""``jspec.generate``: the public entry point.

Everything that can be wrong with a request is checked here, on the host, before
anything is traced or compiled: empty prompts, ids outside the vocabulary, prompts
that do not fit the cache, a KV page budget that cannot hold the batch.

Static shapes are bucketed so that calls of the same batch size, similar prompt
lengths and the same ``max_new_tokens`` reuse one compiled program: the prompt
block is padded up to a multiple of ``prompt_bucket``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import jax
import numpy as np

from jspec.drafters.health import first_step_acceptance, warn_if_collapsed
from jspec.engine import Engine, Request, default_slots
from jspec.plan import KVConfig, plan, prompt_ids, row_limits
from jspec.sampling import SamplingConfig
from jspec.spec_config import SpecConfig
from jspec.target import Target

log = logging.getLogger("jspec")


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]          # generated ids per row (a stop id, when hit, is included)
    stats: list[dict]                # per row: prompt_len, new_tokens, iterations, stop_reason
    text: list[str] | None = None    # decoded continuations, when the target has a tokenizer
    wall_s: float = 0.0              # whole call, including any compilation
    tokens_per_s: float = 0.0        # generated tokens / wall_s
    profile: dict | None = None      # draft / verify / other seconds and shares (profile=True)
    # generate(logprobs=k): per row, a jspec.logprobs.TokenLogprob per generated token
    logprobs: list[list] | None = None

    def summary(self) -> dict:
        return {"num_rows": len(self.tokens), "new_tokens": sum(map(len, self.tokens)),
                "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s}


def generate(target: Target, prompts, *, max_new_tokens: int | Sequence[int] = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             key: jax.Array | None = None, stop_ids=None, max_len: int | None = None,
             page_size: int = 16, num_pages: int | None = None, kv_admission: str = "reserve",
             prompt_bucket: int = 16, prefill_chunk: int | None = None, mesh=None,
             drafter=None,
             spec: SpecConfig | str | None = None,
             forced_accept: float = 0.0, profile: bool = False,
             kernels: str = "auto", slots: int | None = None,
             logprobs: int | None = None, exact_shapes: bool = False,
             response_format=None) -> GenerationResult:
    """Generate continuations of ``prompts``: with the target alone, or speculatively.

    ``prompts``: one prompt or a list; each a string (needs a tokenizer) or token ids.
    ``max_new_tokens``: one limit or one per row. ``stop_ids``: ids that end a row
    (default: the config's EOS ids), or one list per row. ``key`` (or ``seed``) drives
    sampling; each row draws from its own key, so a row samples the same alone or in a batch.
    ``max_len``: KV slots per row (default: padded prompt + max_new_tokens, plus the
    speculative overshoot). ``num_pages``: the page budget (default: enough for every row
    at ``max_len``). ``prefill_chunk``: the prompt is prefilled this many tokens at a time
    (default 512; :mod:`jspec.prefill`), so its memory grows with the prompt, not its
    square. ``kv_admission``: what a budget too small for the batch does.
    ``"reserve"`` (default) reserves every row's pages for its prompt, ``max_new_tokens`` and
    the speculative overshoot up front, and refuses a batch that does not fit with
    :class:`jspec.KVCacheExhaustedError` before compiling. ``"partial"`` gives every row its
    prompt plus one iteration's slots (refused the same way if even that does not fit), then
    hands the pages left to the rows in order, each up to its full need; a row that fills
    its pages mid-run stops with ``stop_reason == "cache_full"`` and keeps the tokens it
    produced (greedy: a prefix of what it would produce with room), and the other rows are
    untouched. A budget that holds every row's need gives the same pages either way.
    ``mesh``: a ``('data', 'model')`` mesh (:func:`jspec.sharding.make_mesh`);
    rows are split over ``data`` and the target should be placed with
    :func:`jspec.target.shard_target`. In a multi-host run (:mod:`jspec.distributed`) the
    mesh spans every process and ``prompts`` are this process's rows (the same count on every
    process); the result holds this process's rows.

    ``drafter``: a :class:`jspec.drafters.Drafter`; the output is exactly what the target
    alone produces (greedy: the same tokens; sampling: the same distribution).
    ``spec``: tree knobs (default: the drafter's, e.g. (5, 4, 8) for EAGLE); ``"auto"``: the
    shape ``python -m jspec tune`` measured and stored beside the drafter checkpoint for this
    device kind and batch size (the drafter's default, with a warning, when there is none).
    ``forced_accept``: benchmark mode that forces this mean accept length (the output is
    then *not* the target's; it measures the plumbing apart from drafter quality).
    ``profile``: run the speculative loop phase by phase from the host and report the
    draft / verify / other time shares in ``result.profile`` (slower; for diagnosis).
    ``kernels``: ``"auto"`` (the Pallas kernels on TPU/GPU when they compile for these shapes,
    else the reference, with a logged reason), ``"reference"`` (XLA), ``"pallas"`` (TPU/GPU
    kernels, an error where they cannot run) or ``"pallas_interpret"`` (the kernels in
    interpret mode, any backend); see :mod:`jspec.kernels`.

    ``logprobs``: None, or k in 0..20: ``result.logprobs`` holds each generated token's
    logprob and top-k alternatives under the target's raw distribution (:mod:`jspec.logprobs`;
    with a drafter, from the verify pass's logits). Prompt logprobs:
    :func:`jspec.scoring.teacher_forced`, or :meth:`jspec.engine.Engine.score`.

    ``response_format``: structured output, one for every row or a list with one per row
    (None: unconstrained): OpenAI's ``{"type": "json_object"}`` and ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}``, and ``{"type": "regex", "regex": ...}``,
    ``{"type": "choice", "choices": [...]}`` (:mod:`jspec.grammar`). The grammar is compiled to
    a token automaton on the device; every token the target decides is drawn from its
    distribution masked by the row's grammar state (renormalized), so speculative output
    equals constrained plain output (greedy: token for token). A row ends on a stop id once
    its grammar is complete. Bad grammars raise :class:`jspec.grammar.GrammarError` first.

    ``exact_shapes``: compile for this call's exact shapes. By default (on one device, without
    ``profile``) the rows, the prompt block and the KV length are rounded up to buckets and the
    sampling settings are runtime values (:mod:`jspec.shape_buckets`), so calls that differ in
    their sizes, ``max_new_tokens`` or sampling settings share compiled programs; the output
    is the same either way. A compile is logged at INFO (``jspec``), and :func:`warmup`
    compiles buckets ahead of time.

    ``slots``: with more prompts than this, the prompts run through a
    :class:`jspec.engine.Engine` of that many slots, refilled as rows finish, instead of one
    batch of every prompt; results come back in input order. Without it, they do when one
    batch's KV pools would pass a memory budget (1 GiB on CPU, a quarter of an accelerator's
    memory; then :func:`jspec.engine.default_slots` slots: 8 on CPU, 64 on accelerators).
    That path is taken when the batch's own knobs are at their defaults (no ``mesh``,
    ``max_len``, ``num_pages``, partial admission, ``profile`` or ``forced_accept``), and it
    samples by position keys: greedy output is the same either way, a sampled row has the
    same distribution (plain decoding: the same tokens).
    """
    engine_slots = _through_engine(target, prompts, slots, max_new_tokens, mesh=mesh,
                                   max_len=max_len, num_pages=num_pages,
                                   kv_admission=kv_admission, profile=profile,
                                   forced_accept=forced_accept, response_format=response_format)
    if engine_slots:
        return _engine_generate(target, prompts, slots=engine_slots,
                                max_new_tokens=max_new_tokens,
                                sampling=SamplingConfig(temperature, top_k, top_p),
                                key=jax.random.key(seed) if key is None else key,
                                stop_ids=stop_ids, page_size=page_size,
                                prompt_bucket=prompt_bucket, drafter=drafter, spec=spec,
                                kernels=kernels, logprobs=logprobs)
    if profile and response_format is not None:
        raise ValueError("profile=True does not support response_format (the profile drives the "
                         "phases from the host, without the grammar)")
    if profile and mesh is not None:
        # The profile drives the phases from the host over one pool; a mesh's pools and page
        # tables are per data shard (jspec.sharding.per_data_shard).
        raise ValueError("profile=True does not support a mesh; profile on one device")
    p = plan(target, prompts, max_new_tokens=max_new_tokens,
             sampling=SamplingConfig(temperature, top_k, top_p), stop_ids=stop_ids,
             kv=KVConfig(page_size, num_pages, max_len, kv_admission, prompt_bucket,
                         prefill_chunk), mesh=mesh,
             drafter=drafter, spec=spec, forced_accept=forced_accept, kernels=kernels,
             logprobs_k=logprobs, exact_shapes=exact_shapes or profile,
             response_format=response_format)
    t0 = time.perf_counter()
    state, prof = p.run(jax.random.key(seed) if key is None else key, profile=profile)
    tokens, stats = p.collect(state)
    wall = time.perf_counter() - t0
    res = finish(p.target, tokens, stats, wall, prof,
                 None if drafter is None or forced_accept else drafter)
    res.logprobs = p.collect_logprobs(state)
    return res


def warmup(target: Target, drafter=None, *, batch_sizes: Sequence[int] = (1,),
           prompt_lengths: Sequence[int] = (16,), max_new_tokens: Sequence[int] = (64,),
           sampled: Sequence[bool] = (False,), spec: SpecConfig | str | None = None,
           logprobs: int | None = None, stop_ids=None, page_size: int = 16,
           prompt_bucket: int = 16, kernels: str = "auto") -> int:
    """Compile ``generate``'s programs ahead of time for every combination of the batch
    sizes, prompt lengths (tokens), ``max_new_tokens`` and greedy/sampled (``sampled``:
    False, True or both) named, with these ``drafter``/``spec``/``logprobs``; later
    ``generate`` calls in the same buckets (:mod:`jspec.shape_buckets`) compile nothing.
    Returns how many programs were compiled here (those already compiled in this process
    are skipped; the persistent cache, :mod:`jspec.compile_cache`, makes the rest fast)."""
    import itertools
    from jspec import executables
    before = executables.count()
    for B, P, N, s in itertools.product(batch_sizes, prompt_lengths, max_new_tokens, sampled):
        if B < 1 or P < 1:
            raise ValueError(f"warmup: batch size {B} and prompt length {P} must be >= 1")
        p = plan(target, [[0] * P] * B, max_new_tokens=N,
                 sampling=SamplingConfig(1.0) if s else SamplingConfig(), stop_ids=stop_ids,
                 kv=KVConfig(page_size, prompt_bucket=prompt_bucket), drafter=drafter,
                 spec=spec, kernels=kernels, logprobs_k=logprobs)
        p.executable()
    return executables.count() - before


def check_acceptance(target, drafter, prompts, new_tokens: int = 48) -> float:
    """Run a short greedy calibration on ``prompts`` and return the first-step acceptance
    (warning as :func:`jspec.drafters.health.warn_if_collapsed` does; ``generate`` itself
    checks the same)."""
    res = generate(target, prompts, max_new_tokens=new_tokens, drafter=drafter)
    return first_step_acceptance(res.stats)[0]


def finish(target: Target, tokens, stats, wall: float, prof=None, drafter=None
           ) -> GenerationResult:
    """A :class:`GenerationResult` of collected rows: per-row rates, warnings for rows whose
    logits went non-finite, and (``drafter``) the acceptance-collapse check."""
    for row in stats:
        # Rows run side by side, so a row's rate is its tokens over the whole call.
        row["tokens_per_s"] = row["new_tokens"] / wall if wall > 0 else 0.0
    bad = [r for r, s in enumerate(stats) if s["stop_reason"] == "nonfinite_logits"]
    if bad:
        log.warning("rows %s stopped early: the target's logits were NaN or inf (after %s new "
                    "tokens). Check the checkpoint's weights and dtype (an fp16 overflow, a "
                    "corrupt tensor); the tokens before that point are kept.", bad,
                    [stats[r]["new_tokens"] for r in bad])
    if drafter is not None:
        warn_if_collapsed(drafter, stats)
    text = None
    if target.tokenizer is not None:
        text = [target.tokenizer.decode(t) for t in tokens]
    total = sum(map(len, tokens))
    return GenerationResult(tokens=tokens, stats=stats, text=text, wall_s=wall,
                            tokens_per_s=total / wall if wall > 0 else 0.0, profile=prof)


# A static batch whose KV pools would pass this is served by the engine instead (CPU; on an
# accelerator, a quarter of the device's memory when it reports it).
STATIC_KV_BUDGET = 1 << 30


def static_kv_budget() -> int:
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    limit = stats.get("bytes_limit")
    return int(limit) // 4 if limit and jax.default_backend() != "cpu" else STATIC_KV_BUDGET


def _through_engine(target, prompts, slots, max_new_tokens, **batch_knobs) -> int | None:
    """The engine's slot count when these prompts go through it, else None: with ``slots``,
    when there are more prompts than slots; without, when one static batch's KV pools would
    pass :func:`static_kv_budget` (then :func:`jspec.engine.default_slots` slots). Only with
    the batch knobs at their defaults (no mesh, max_len, num_pages, partial admission,
    profile, forced_accept or response_format)."""
    if isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
        return None
    if len(prompts) and isinstance(prompts[0], (int, np.integer)):
        return None
    defaults = dict(mesh=None, max_len=None, num_pages=None, kv_admission="reserve",
                    profile=False, forced_accept=0.0, response_format=None)
    if any(batch_knobs[k] != v for k, v in defaults.items()):
        return None
    B = len(prompts)
    if slots is not None:
        return slots if B > slots else None
    c = target.config
    longest = max(len(p) for p in prompts)       # characters for text: an upper bound
    per_row = (longest + int(np.max(max_new_tokens)) + 64) * 2 * c.num_layers * \
        c.num_kv_heads * c.head_dim * np.dtype(c.dtype).itemsize
    return default_slots() if B > default_slots() and B * per_row > static_kv_budget() \
        else None


def _engine_generate(target, prompts, *, slots, max_new_tokens, sampling, key, stop_ids,
                     page_size, prompt_bucket, drafter, spec, kernels, logprobs=None
                     ) -> GenerationResult:
    ids, _ = prompt_ids(target, prompts)
    B = len(ids)
    limits = row_limits(max_new_tokens, B)
    per_row = bool(stop_ids) and isinstance(stop_ids[0], (list, tuple))
    if per_row and len(stop_ids) != B:
        raise ValueError(f"per-row stop_ids has {len(stop_ids)} rows for {B} prompts")
    cap = max(1, int(limits.max()))
    t0 = time.perf_counter()
    eng = Engine(target, drafter, slots=slots, spec=spec, sampling=sampling, max_new_tokens=cap,
                 max_len=None, page_size=page_size, prompt_bucket=prompt_bucket,
                 kernels=kernels, longest_prompt=max(map(len, ids)), logprobs_k=logprobs)
    keys = jax.random.split(key, B)        # row r's key, as in one batch of every prompt
    reqs = [Request(ids[r], int(limits[r]), key=keys[r],
                    stop_ids=stop_ids[r] if per_row else stop_ids, logprobs=logprobs)
            for r in range(B)]
    done = eng.generate(reqs)
    wall = time.perf_counter() - t0
    res = finish(target, [c.tokens for c in done], [c.stats for c in done], wall, None, drafter)
    res.logprobs = None if logprobs is None else [c.logprobs for c in done]
    return res
