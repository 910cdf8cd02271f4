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
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import distributed as dist
from jspec import kv_cache as kvc
from jspec.decode import STOP_REASONS, PlainDecoder
from jspec.kernels import check_mode as check_kernels, resolve as resolve_kernels
from jspec.sampling import SamplingConfig
from jspec.spec_config import SpecConfig
from jspec.spec_decode import SpecDecoder, tree_shape
from jspec.sharding import batch_sharding
from jspec.target import Target
from jspec.tree.calibration import check as check_selection

log = logging.getLogger("jspec")


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]          # generated ids per row (a stop id, when hit, is included)
    stats: list[dict]                # per row: prompt_len, new_tokens, iterations, stop_reason
    text: list[str] | None = None    # decoded continuations, when the target has a tokenizer
    wall_s: float = 0.0              # whole call, including any compilation
    tokens_per_s: float = 0.0        # generated tokens / wall_s
    profile: dict | None = None      # draft / verify / other seconds and shares (profile=True)

    def summary(self) -> dict:
        return {"num_rows": len(self.tokens), "new_tokens": sum(map(len, self.tokens)),
                "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s}


def _as_id_lists(target: Target, prompts) -> tuple[list[list[int]], bool]:
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                    and isinstance(prompts[0], int)):
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
        if not p:
            raise ValueError(f"prompt {r} is empty: a prompt needs at least one token (e.g. BOS)")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt {r} has token id {bad[0]} outside the vocabulary [0, {V})")
    return ids, is_text


def _stop_ids(target: Target, stop_ids, B: int) -> np.ndarray:
    if stop_ids is None:
        stop_ids = list(target.config.eos_token_ids)
    if stop_ids and isinstance(stop_ids[0], (list, tuple)):
        if len(stop_ids) != B:
            raise ValueError(f"per-row stop_ids has {len(stop_ids)} rows for {B} prompts")
        rows = [list(r) for r in stop_ids]
    else:
        rows = [list(stop_ids)] * B
    # A fixed bucket of 8 keeps the compiled shape when the number of stop ids changes.
    width = 8 * max(1, math.ceil(max(len(r) for r in rows) / 8))
    out = np.full((B, width), -1, np.int32)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out


ADMISSIONS = ("reserve", "partial")


def _admit(lens, limits, overshoot, prompt_bucket, max_len, page_size, num_pages, shards=1,
           agreed=None, admission="reserve"):
    """Static shapes and pages for a batch: ``(T, cap_new, num_pages, page_table)``.

    A row needs its prompt, its new tokens and the speculative overshoot (the prefill
    writes only real prompt positions; padding is masked). ``admission="reserve"`` refuses
    a batch whose needs do not all fit; ``"partial"`` refuses only one whose minimums do not
    (prompt plus one iteration's slots) and gives the rest out in row order
    (:func:`jspec.kv_cache.partial_page_table`).
    ``shards`` > 1 (a mesh's data axis): rows split into that many contiguous groups, each
    with a pool of its own; ``num_pages`` (given: the total) is then one shard's pool and
    the table holds page ids local to each row's shard. ``agreed``: (longest prompt, most new
    tokens) over every process of a multi-host run, so all compile the same shapes.
    """
    if admission not in ADMISSIONS:
        raise ValueError(f"kv_admission={admission!r}: expected one of {ADMISSIONS}")
    B = len(lens)
    top_len, top_new = agreed if agreed is not None else (int(lens.max()), int(limits.max()))
    cap_new = max(1, top_new)
    T = int(math.ceil(top_len / prompt_bucket) * prompt_bucket)
    if max_len is None:
        max_len = T + cap_new + overshoot
    for r in range(B):
        if lens[r] + limits[r] + overshoot > max_len:
            extra = f" plus {overshoot} slots of speculative overshoot" if overshoot else ""
            raise ValueError(
                f"prompt {r} has {lens[r]} tokens and asks for {limits[r]} new ones{extra}, more "
                f"than the cache length max_len={max_len}")
    max_pages = kvc.pages_needed(max_len, page_size)
    if num_pages is None:
        num_pages = B * max_pages
    local = num_pages // shards
    need = [int(lens[r] + limits[r] + overshoot) for r in range(B)]
    # One iteration writes `overshoot` slots past the committed length (plain decoding: 1).
    floor = [min(need[r], int(lens[r]) + max(overshoot, 1)) for r in range(B)]
    rows = B // shards
    tables = []
    for sh in range(shards):
        part = slice(sh * rows, (sh + 1) * rows)
        try:
            if admission == "partial":
                table = kvc.partial_page_table(floor[part], need[part], page_size, local,
                                               max_pages)
            else:
                table = kvc.allocate_page_table(need[part], page_size, local, max_pages)
        except kvc.KVCacheExhaustedError as e:
            where = f" (data shard {sh}: rows {sh * rows}..{(sh + 1) * rows - 1}, {local} pages)" \
                if shards > 1 else ""
            raise kvc.KVCacheExhaustedError(f"{e}{where}") from None
        tables.append(table)
    return T, cap_new, local, np.concatenate(tables)


def generate(target: Target, prompts, *, max_new_tokens: int | Sequence[int] = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             key: jax.Array | None = None, stop_ids=None, max_len: int | None = None,
             page_size: int = 16, num_pages: int | None = None, kv_admission: str = "reserve",
             prompt_bucket: int = 16, mesh=None, drafter=None,
             spec: SpecConfig | str | None = None,
             forced_accept: float = 0.0, profile: bool = False,
             kernels: str = "auto") -> GenerationResult:
    """Generate continuations of ``prompts``: with the target alone, or speculatively.

    ``prompts``: one prompt or a list; each a string (needs a tokenizer) or token ids.
    ``max_new_tokens``: one limit or one per row. ``stop_ids``: ids that end a row
    (default: the config's EOS ids), or one list per row. ``key`` (or ``seed``) drives
    sampling; each row draws from its own key, so a row samples the same alone or in a batch.
    ``max_len``: KV slots per row (default: padded prompt + max_new_tokens, plus the
    speculative overshoot). ``num_pages``: the page budget (default: enough for every row
    at ``max_len``). ``kv_admission``: what a budget too small for the batch does.
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
    :func:`jspec.sharding.shard_target`. In a multi-host run (:mod:`jspec.distributed`) the
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
    """
    check_kernels(kernels)
    if profile and mesh is not None:
        # The profile drives the phases from the host over one pool; a mesh's pools and page
        # tables are per data shard (jspec.sharding.per_data_shard).
        raise ValueError("profile=True does not support a mesh; profile on one device")
    sampling = SamplingConfig(temperature, top_k, top_p)
    ids, is_text = _as_id_lists(target, prompts)
    B = len(ids)
    lens = np.array([len(p) for p in ids], np.int32)
    limits = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (B,)).astype(np.int32)
    if np.any(limits < 0):
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    overshoot = 0
    if drafter is not None:
        from jspec.tune_store import resolve_spec
        spec = resolve_spec(drafter, spec, B)
        spec = spec if spec is not None else drafter.default_spec
        drafter.module.validate(target.config, drafter.params)
        check_selection(drafter, spec)
        drafter.module.check_spec(spec)
        S, N = tree_shape(drafter.module, spec)
        if forced_accept and not 1.0 <= forced_accept <= S + 1:
            raise ValueError(f"forced_accept={forced_accept} must be in [1, S+1={S + 1}]")
        # A verify writes N slots past the committed length; a row may commit up to S
        # tokens past its limit before it stops; the drafter's loop needs its own slots.
        overshoot = max(N, drafter.module.cache_slots(spec)) + S + 1
    shards, agreed, multi = 1, None, dist.is_multiprocess(mesh)
    if mesh is not None:
        # Multi-host: this process's prompts fill the data shards on its own devices.
        shards = dist.check_mesh(mesh) if multi else mesh.shape["data"]
        if B % shards:
            raise ValueError(f"batch of {B} rows does not split over the mesh's "
                             f"data axis of size {shards}" +
                             (" on this process" if multi else ""))
    stops = _stop_ids(target, stop_ids, B)
    if multi:
        *agreed, width = dist.agree(B, [lens.max(), limits.max(), stops.shape[1]])
        stops = np.pad(stops, ((0, 0), (0, width - stops.shape[1])), constant_values=-1)
    T, cap_new, num_pages, page_table = _admit(lens, limits, overshoot, prompt_bucket, max_len,
                                               page_size, num_pages, shards, agreed, kv_admission)
    kernels = resolve_kernels(kernels, target.config, page_size=page_size,
                              num_nodes=1 if drafter is None else N,
                              max_depth=None if drafter is None else S,
                              greedy=sampling.greedy, batch=B, max_pages=page_table.shape[1],
                              num_pages=num_pages, mesh=mesh)
    prompt = np.zeros((B, T), np.int32)
    for r, p in enumerate(ids):
        prompt[r, :len(p)] = p
    if key is None:
        key = jax.random.key(seed)

    rows = [prompt, lens, page_table, stops, limits]
    if multi:
        rows = [dist.global_rows(mesh, x) for x in rows]
    elif mesh is not None:
        rows = [jax.device_put(x, batch_sharding(mesh, x.ndim)) for x in rows]
    else:
        rows = [jnp.asarray(x) for x in rows]
    prompt_d, lens_d, table_d, stop_d, limits_d = rows

    prof = None
    t0 = time.perf_counter()
    if drafter is None:
        dec = PlainDecoder(target.config, sampling, cap_new, page_size, num_pages, mesh, kernels)
        state = dec.run(target.serving_params, prompt_d, lens_d, table_d, stop_d, limits_d, key)
        iters = state.num_generated
        hist = None
    else:
        # Validated above in its checkpoint layout; on a mesh, sharded like the target's layers.
        served = drafter.serving if mesh is None else drafter.on_mesh(target.config, mesh)
        dec = SpecDecoder(target.config, served.module, spec, sampling, cap_new, page_size,
                          num_pages, float(forced_accept), mesh, kernels)
        args = (target.serving_params, served.params, prompt_d, lens_d, table_d, table_d, stop_d,
                limits_d, key)
        if profile:
            state, prof = dec.profile(*args)
        else:
            state = dec.run(*args)
        iters, hist = state.iterations, state.accept_hist
    out = (state.tokens, state.num_generated, state.stop_reason, iters, hist)
    if multi:                      # this process's rows of the global arrays
        out = tuple(None if x is None else dist.local_rows(mesh, x) for x in out)
    toks, n, reasons, iters, hist = jax.device_get(out)
    wall = time.perf_counter() - t0

    tokens = [toks[r, :n[r]].tolist() for r in range(B)]
    stats = []
    for r in range(B):
        row = {"prompt_len": int(lens[r]), "new_tokens": int(n[r]), "iterations": int(iters[r]),
               "stop_reason": STOP_REASONS[int(reasons[r])],
               # Rows run side by side, so a row's rate is its tokens over the whole call.
               "tokens_per_s": float(n[r] / wall) if wall > 0 else 0.0}
        if hist is not None:
            h = hist[r]
            row["accept_hist"] = h.tolist()   # [n] = verify passes that emitted n tokens
            row["mean_accept_len"] = float((h * np.arange(len(h))).sum() / max(1, h.sum()))
        stats.append(row)
    bad = [r for r in range(B) if stats[r]["stop_reason"] == "nonfinite_logits"]
    if bad:
        log.warning("rows %s stopped early: the target's logits were NaN or inf (after %s new "
                    "tokens). Check the checkpoint's weights and dtype (an fp16 overflow, a "
                    "corrupt tensor); the tokens before that point are kept.", bad,
                    [stats[r]["new_tokens"] for r in bad])
    if drafter is not None and not forced_accept:
        from jspec.drafters.health import warn_if_collapsed
        warn_if_collapsed(drafter, stats)
    text = None
    if target.tokenizer is not None:
        text = [target.tokenizer.decode(t) for t in tokens]
    total = int(n.sum())
    return GenerationResult(tokens=tokens, stats=stats, text=text, wall_s=wall,
                            tokens_per_s=total / wall if wall > 0 else 0.0, profile=prof)
