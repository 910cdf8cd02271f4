"""Teacher-forced logprobs of a given token sequence under the target (prompt logprobs,
OpenAI's ``echo``; lm-eval's loglikelihood).

- :class:`Scorer`: the serving program, target only. The padded sequence goes through the
  chunked prefill (:mod:`jspec.prefill`, so memory grows with the chunk, not the square of
  the length) into a scratch cache of its own; each chunk's logits give the next tokens'
  logprobs (:func:`jspec.logprobs.of_tokens`). Compiled once per (length bucket, k).
- :func:`teacher_forced`: the reference, one plain causal forward over the whole sequence,
  what the tests compare the decoders and the scorer against.

Both return one entry per token, the first None (nothing precedes it), as OpenAI's
``echo`` does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec import kernels as kernel_modes, kv_cache as kvc, logprobs as L, prefill as chunked
from jspec.compiled import compiled
from jspec.config import LlamaConfig
from jspec.llama import forward, logits as lm_logits
from jspec.serving_layout import pack_params


def _scratch_cache(c: LlamaConfig, length: int, page_size: int) -> kvc.PagedKVCache:
    pages = kvc.pages_needed(length, page_size)
    return kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim,
                          jnp.arange(pages, dtype=jnp.int32)[None], pages, page_size, c.dtype)


@dataclasses.dataclass(frozen=True)
class Scorer:
    """Static settings of the scoring program (hashable: equal scorers share a program)."""
    config: LlamaConfig
    k: int                              # top-k alternatives per token (0: just the token's)
    page_size: int = 16
    prefill_chunk: int | None = None
    kernels: str = "reference"          # a concrete jspec.kernels mode
    compiler_options: tuple = ()        # XLA options (jspec.compiled.options_for the params)

    @compiled()
    def run(self, params, prompt, prompt_lens) -> L.LogprobBuffer:
        """``prompt [B, T]`` right-padded, ``prompt_lens [B]`` -> a buffer ``[B, T']``
        (``T' >= T``) whose column ``p`` is token ``p + 1``'s logprob under the logits at
        ``p`` (columns from ``len - 1`` on are meaningless)."""
        c = self.config
        params = pack_params(c, params)
        B, T = prompt.shape
        n, C = chunked.chunk_plan(T, self.prefill_chunk)
        if B != 1:
            raise ValueError("Scorer.run takes one sequence at a time (B = 1)")
        cache = _scratch_cache(c, n * C, self.page_size)
        attend = kernel_modes.prefill_attention_fn(self.kernels, c, self.page_size)

        def step(carry, chunk, first):
            cache, buf = carry
            hidden, _, cache = chunked.target_chunk(c, params, cache, chunk, attention_fn=attend)
            block = L.of_tokens(lm_logits(c, params, hidden), chunk.next_tokens, self.k)
            return cache, L.write(buf, chunk.positions, block)

        _, buf = chunked.run(prompt, prompt_lens, self.prefill_chunk, step,
                             (cache, L.empty(B, n * C, self.k)))
        return buf


def score_host(buf: L.LogprobBuffer, ids, k: int) -> list[L.TokenLogprob | None]:
    """A one-row :meth:`Scorer.run` output on the device -> the entries of ``ids``."""
    n = len(ids)
    token, top_ids, top = L.read_rows(buf, 0)
    return [None] + L.host_rows(token[:n - 1], top_ids[:n - 1], top[:n - 1], ids[1:], k)


@functools.partial(jax.jit, static_argnames=("config", "k", "page_size"))
def _full_forward(config, params, tokens, k: int, page_size: int = 16) -> L.LogprobBuffer:
    T = tokens.shape[1]
    cache = _scratch_cache(config, T, page_size)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    hidden, _, _ = forward(config, pack_params(config, params), tokens, pos, cache)
    logits = lm_logits(config, pack_params(config, params), hidden)
    return L.of_tokens(logits[:, :-1], tokens[:, 1:], k)


def teacher_forced(target, ids, k: int = 0) -> list[L.TokenLogprob | None]:
    """The reference: every token of ``ids`` (a prompt, or prompt + output) scored by one
    plain causal forward of the target over the whole sequence (fp32 logits, raw
    distribution); the first entry is None."""
    k = L.check_k(k, "k")
    ids = [int(t) for t in ids]
    if len(ids) < 1:
        raise ValueError("teacher_forced needs at least one token")
    if len(ids) == 1:
        return [None]
    buf = _full_forward(target.config, target.serving_params,
                        jnp.asarray(np.asarray(ids, np.int32)[None]), k)
    token, top_ids, top = L.read_rows(buf, 0)
    return [None] + L.host_rows(token, top_ids, top, ids[1:], k)
