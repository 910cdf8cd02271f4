"""The engine's host side of logprobs (:mod:`jspec.logprobs`): checking what a request asks
for, reading each chunk's new logprobs back beside its tokens, and prompt scoring.

Reading back: the decode state keeps ``[B, W]`` and ``[B, W, k]`` buffers beside the tokens.
Copying them whole after every chunk would move ``B * W * k`` entries (64 slots of a
4k-token row at k = 20: 42 MB) for the few new columns, so :class:`WindowReader` gathers
each slot's window of new columns on device, one fixed shape compiled once (a chunk adds at
most ``1 + chunk * (S + 1)`` tokens to a row), and copies that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec import logprobs as L
from jspec.logprobs import check_k  # noqa: F401  (re-exported for the engine)

from jspec.engine.buckets import bucket_of
from jspec.scoring import Scorer, score_host


def check_request(req, engine_k: int | None) -> None:
    """ValueError when ``req`` asks for logprobs this engine does not keep."""
    if req.logprobs is not None:
        k = L.check_k(req.logprobs, f"request {req.id}: logprobs")
        if engine_k is None:
            raise ValueError(f"request {req.id}: logprobs={k}, but this engine keeps none; make "
                             f"it with Engine(..., logprobs_k=K) for some K >= {k}")
        if k > engine_k:
            raise ValueError(f"request {req.id}: logprobs={k} is more than the engine's "
                             f"logprobs_k={engine_k}")
    if not isinstance(req.prompt_logprobs, (bool, np.bool_)):
        raise ValueError(f"request {req.id}: prompt_logprobs must be a bool, got "
                         f"{req.prompt_logprobs!r}")


@functools.partial(jax.jit, static_argnames=("width",))
def _window(buf: L.LogprobBuffer, starts, width: int):
    """Columns ``starts[b] .. starts[b] + width - 1`` of every row (clipped at the end)."""
    W = buf.token.shape[1]
    cols = jnp.minimum(starts[:, None] + jnp.arange(width, dtype=jnp.int32)[None], W - 1)
    take = lambda x: jnp.take_along_axis(x, cols.reshape(cols.shape + (1,) * (x.ndim - 2)), 1)
    return jax.tree.map(take, buf)


class WindowReader:
    """Each slot's new logprobs after a chunk (module doc)."""

    def __init__(self, width: int):
        self.width = int(width)

    def read(self, buf: L.LogprobBuffer, starts: np.ndarray) -> "Window":
        return Window(buf, np.asarray(starts, np.int64),
                      jax.device_get(_window(buf, jnp.asarray(starts, jnp.int32), self.width)))


class Window:
    """Host copies of every slot's window of a buffer, starting at ``starts[slot]``."""

    def __init__(self, buf, starts, host):
        self.buf, self.starts, self.host = buf, starts, host

    def entries(self, slot: int, start: int, stop: int, tokens, k: int
                ) -> list[L.TokenLogprob]:
        """Slot ``slot``'s columns ``start .. stop - 1`` (``tokens``: their ids), with ``k``
        alternatives each. Columns outside the window (more new tokens than it holds) are
        read from the device buffer instead (one more fixed-shape gather)."""
        lo = start - int(self.starts[slot])
        if lo < 0 or stop - self.starts[slot] > self.host.token.shape[1]:
            W = self.buf.token.shape[1]
            whole = jax.device_get(_window(self.buf, jnp.zeros((self.starts.size,), jnp.int32),
                                           W))
            self.host, self.starts, lo = whole, np.zeros_like(self.starts), start
        hi = lo + (stop - start)
        h = self.host
        return L.host_rows(h.token[slot, lo:hi], h.top_ids[slot, lo:hi], h.top[slot, lo:hi],
                           tokens, k)


class PromptScorer:
    """:meth:`score` for an engine: one :class:`jspec.scoring.Scorer` program per (length
    bucket, k); ``k`` is raised to the engine's ``logprobs_k`` so that every request's
    prompt scoring shares one program per bucket."""

    def __init__(self, config, buckets: list[int], page_size: int, prefill_chunk, kernels: str,
                 logprobs_k: int | None, compiler_options: tuple = ()):
        self.config, self.buckets = config, buckets
        self.page_size, self.prefill_chunk, self.kernels = page_size, prefill_chunk, kernels
        self.logprobs_k, self.compiler_options = logprobs_k, compiler_options

    def score(self, params, ids, k: int) -> list[L.TokenLogprob | None]:
        k = L.check_k(k, "k")
        if k is None:
            raise ValueError("score: k must be an int in 0..20")
        ids = [int(t) for t in ids]
        if not ids or len(ids) > self.buckets[-1]:
            raise ValueError(f"score: {len(ids)} tokens; this engine scores 1 .. "
                             f"{self.buckets[-1]}")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"score: token ids must be in [0, {vocab})")
        if len(ids) == 1:
            return [None]
        T = bucket_of(self.buckets, len(ids))
        prompt = np.zeros((1, T), np.int32)
        prompt[0, :len(ids)] = ids
        scorer = Scorer(self.config, max(k, self.logprobs_k or 0), self.page_size,
                        self.prefill_chunk, self.kernels, self.compiler_options)
        buf = scorer.run(params, jnp.asarray(prompt), jnp.asarray([len(ids)], jnp.int32))
        return score_host(buf, ids, k)


class EngineLogprobs:
    """An engine's logprobs on the host: after each chunk, the new tokens' entries of the
    requests that asked (accumulated on their live record for the completion), and prompt
    scoring. ``logprobs_k`` None: requests asking for token logprobs are refused
    (:func:`check_request`) and nothing is read back."""

    def __init__(self, programs, prompt_buckets: list[int], logprobs_k: int | None,
                 context):
        self.k = logprobs_k
        self.context = context          # () -> (the target's serving params, its mesh context)
        p = programs
        # A chunk adds at most 1 (an insert's first token) + chunk * (S + 1) tokens to a row.
        self.reader = WindowReader(min(1 + p.chunk * (p.max_depth + 1),
                                       p.max_new_tokens + p.max_depth + 1))
        self.scorer = PromptScorer(p.config, prompt_buckets, p.page_size, p.prefill_chunk,
                                   p.kernels, logprobs_k, p.compiler_options)

    def window(self, core, live: list[int], slots: list) -> Window | None:
        """Every slot's new columns (from what it has sent), or None when no live request
        asked for logprobs."""
        if core.logprobs is None or all(slots[s].req.logprobs is None for s in live):
            return None
        starts = np.zeros((len(slots),), np.int64)
        for s in live:
            starts[s] = slots[s].sent
        return self.reader.read(core.logprobs, starts)

    def new(self, window: Window | None, slot: int, lv, stop: int, tokens) -> list | None:
        """Entries of ``lv``'s tokens ``lv.sent .. stop - 1`` (``tokens``), also appended to
        ``lv.logprobs`` for its completion; None when it asked for none."""
        if window is None or lv.req.logprobs is None:
            return None
        got = window.entries(slot, lv.sent, stop, tokens, lv.req.logprobs)
        lv.logprobs = (lv.logprobs or []) + got
        return got

    def completion(self, lv, n_tokens: int) -> tuple[list | None, list | None]:
        """``(logprobs of its n_tokens tokens, prompt logprobs)``, each None when not asked
        (prompt logprobs with the request's k alternatives, 0 without token logprobs)."""
        toks = None if lv.req.logprobs is None else (lv.logprobs or [])[:n_tokens]
        prompt = self.score(lv.ids, lv.req.logprobs or 0) if lv.req.prompt_logprobs else None
        return toks, prompt

    def score(self, ids, k: int) -> list[L.TokenLogprob | None]:
        """Prompt logprobs (OpenAI's echo): each of ``ids`` scored by the target, teacher
        forced (:mod:`jspec.scoring`), with ``k`` alternatives; the first entry is None.
        A target-only program per prompt bucket; it does not touch the slots."""
        params, on_mesh = self.context()
        with on_mesh:
            return self.scorer.score(params, ids, k)
