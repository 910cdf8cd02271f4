"""Chunked prefill: a prompt goes through the model C tokens at a time.

A whole-prompt prefill's attention holds ``[B, H, T, S]`` scores (S >= T the row's KV
length), so its temporaries grow as T^2: the 8B program at 8k context needed 94.5 GB of them
on one v6e chip. Chunk i instead writes its C tokens' KV after the ``min(len, i C)`` already
committed for each row and attends to those pages and, causally, to itself: exactly a verify
block with a causal mask. Its attention (:mod:`jspec.prefill_attention`: jax's kernels, or
XLA's online softmax over key blocks) never holds more than one key block's scores, so the
temporaries stay bounded by the chunk whatever the context.

Chunk 0 is traced on its own (the drafters' ``prefill`` starts their state; see
:class:`jspec.drafters.protocol.DraftModule`) and chunks 1..n-1 run in one ``lax.scan``
(their ``extend`` appends), so the program's size does not grow with the prompt. A prompt
no longer than C is one chunk of its own padded length: the same program as an unchunked
prefill.

:data:`DEFAULT_CHUNK` is 512 tokens on every backend: 512 rows make the projections
compute bound on TPUs and GPUs (their ridge points are a few hundred flops per weight byte
in bf16), so smaller chunks would reread the weights for little gain in memory, and larger
ones grow the activations ([B, C, 14336] per MLP at 8B).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import struct

from jspec.attention import paged_attention_ref
from jspec.llama import forward
from jspec.shapes import Bool, Int

#: ``JSPEC_PREFILL_CHUNK`` overrides it: e.g. to run a whole exactness suite with every
#: prompt cut into many chunks.
DEFAULT_CHUNK = int(os.environ.get("JSPEC_PREFILL_CHUNK", 512))


def chunk_plan(T: int, chunk: int | None) -> tuple[int, int]:
    """``(n, C)``: a padded prompt of ``T`` tokens as ``n`` chunks of ``C`` tokens (one
    chunk of ``T`` when it fits in one)."""
    chunk = DEFAULT_CHUNK if chunk is None else int(chunk)
    if chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {chunk}")
    if T <= chunk:
        return 1, T
    return -(-T // chunk), chunk


@struct.dataclass
class Chunk:
    """One chunk of a right-padded prompt ``[B, T]`` with lengths ``lens [B]``.
    ``next_tokens``: the prompt's token at position + 1 (0 past its end), the drafters'
    (feature, next token) pairs; ``has_last``: the row's last prompt position is in this
    chunk, at index ``last`` (clipped into the chunk)."""
    start: Int[""]
    tokens: Int["B C"]
    positions: Int["B C"]
    valid: Bool["B C"]
    next_tokens: Int["B C"]
    committed: Int["B"]
    has_last: Bool["B"]
    last: Int["B"]

    @property
    def count(self) -> jax.Array:
        """``[B]`` valid tokens in the chunk."""
        return jnp.sum(self.valid, axis=1).astype(jnp.int32)

    def take_last(self, x: jax.Array) -> jax.Array:
        """``x [B, C, ...]`` at each row's last prompt position (meaningful where
        :attr:`has_last`)."""
        return jnp.take_along_axis(x, self.last[:, None, None], axis=1)[:, 0]


def chunks(prompt: jax.Array, lens: jax.Array, chunk: int | None):
    """``(n, at)``: the number of chunks and ``at(i) -> Chunk`` (``i`` may be traced)."""
    B, T = prompt.shape
    n, C = chunk_plan(T, chunk)
    padded = jnp.pad(prompt, ((0, 0), (0, n * C - T + 1)))      # +1: the pair past the end
    lens = lens.astype(jnp.int32)

    def at(i) -> Chunk:
        start = jnp.asarray(i, jnp.int32) * C
        pos = start + jnp.arange(C, dtype=jnp.int32)[None]
        last = lens - 1 - start
        return Chunk(start=start,
                     tokens=jax.lax.dynamic_slice_in_dim(padded, start, C, 1),
                     positions=jnp.broadcast_to(pos, (B, C)), valid=pos < lens[:, None],
                     next_tokens=jax.lax.dynamic_slice_in_dim(padded, start + 1, C, 1)
                     * (pos + 1 < lens[:, None]),
                     committed=jnp.minimum(lens, start),
                     has_last=(last >= 0) & (last < C), last=jnp.clip(last, 0, C - 1))

    return n, at


def run(prompt: jax.Array, lens: jax.Array, chunk: int | None, step, carry=None):
    """Fold ``step(carry, chunk, first) -> carry`` over the prompt's chunks: chunk 0 with
    ``first=True`` (and ``carry`` as given, e.g. None), the rest in one ``lax.scan``."""
    n, at = chunks(prompt, lens, chunk)
    carry = step(carry, at(0), True)
    if n > 1:
        def body(c, i):
            # Chunk i's tokens wait for everything chunk i-1 computed. Nothing else orders
            # its first KV write after chunk i-1's last attention read of the same pool, and
            # where XLA unrolls the scan (XLA:GPU, one trip) it copied the pool instead: 69.6
            # GB for the 8B engine's insert of two chunks on an H200 (docs/serving.md).
            c, i = jax.lax.optimization_barrier((c, i))
            return step(c, at(i), False), None

        carry, _ = jax.lax.scan(body, carry, jnp.arange(1, n, dtype=jnp.int32))
    return carry


def keep_last(chunk: Chunk, new, old):
    """Per row, ``new`` where the row's last prompt position is in ``chunk``, else ``old``
    (``new`` itself for the first chunk, ``old`` None)."""
    if old is None:
        return new
    return jax.tree.map(lambda a, b: jnp.where(
        chunk.has_last.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old)


def target_chunk(cfg, params, cache, chunk: Chunk, aux_layers=(),
                 attention_fn=paged_attention_ref):
    """The target forward over one chunk (packed ``params``): its KV written after each
    row's committed prefix. ``(hidden, aux, cache)``; the cache's lengths are the chunk's
    committed ones (the caller sets the prompt's lengths when all chunks are in).
    ``attention_fn``: :func:`jspec.kernels.prefill_attention_fn` of the decoder's mode."""
    return forward(cfg, params, chunk.tokens, chunk.positions,
                   cache.replace(lengths=chunk.committed), valid=chunk.valid,
                   aux_layers=aux_layers, attention_fn=attention_fn)
