"""Log-probabilities of generated (and prompt) tokens under the target.

What is returned is the target's **raw** distribution: ``log_softmax`` of its fp32 logits
at the position before the token, before temperature, top-k or top-p (vLLM's default,
``logprobs_mode="raw_logprobs"``). Under speculation a token's row is the verify pass's
logits of the node before it on the accepted path: the root decides the first accepted draft,
each accepted node the next, the last accepted node the bonus token. Never the drafter's
distribution, nor the residual a rejected draft leaves (the bonus of a sampled row is drawn
from the residual, but its logprob is the target's at that node, as plain decoding's is).

On device a decoder with a static ``logprobs_k`` (None: nothing here is traced) keeps a
:class:`LogprobBuffer` beside its tokens, ``[B, W]`` and ``[B, W, k]``, written at the
same indices (:func:`write`). The token's own logprob and the top-k values are read from
one ``log_softmax`` array, so ``logprob == top[0].logprob`` holds bitwise when the token is
the argmax. On the host, :func:`host_rows` turns a row's slice into :class:`TokenLogprob` s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.shapes import Float, Int
from jspec.topk import top_k as _top_k

MAX_K = 20      # OpenAI's top_logprobs limit (and vLLM's default max_logprobs is 20)


@dataclasses.dataclass
class TokenLogprob:
    """One token's logprob and the ``k`` most likely tokens at its position (descending;
    ties in id order), all under the target's raw distribution (module doc)."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


def check_k(k, name: str = "logprobs_k") -> int | None:
    """``k`` as an int in ``0 .. MAX_K``, or None; ValueError otherwise (before anything
    compiles)."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= MAX_K:
        raise ValueError(f"{name}={k!r}: None (off) or an int in 0..{MAX_K}")
    return int(k)


@struct.dataclass
class LogprobBuffer:
    """Per generated token (or per block of them): the token's logprob, and the top-k ids
    and logprobs. Leading axes like the tokens they describe."""
    token: Float["B W"]
    top_ids: Int["B W k"]
    top: Float["B W k"]


def empty(batch: int, width: int, k: int) -> LogprobBuffer:
    return LogprobBuffer(token=jnp.zeros((batch, width), jnp.float32),
                         top_ids=jnp.zeros((batch, width, k), jnp.int32),
                         top=jnp.zeros((batch, width, k), jnp.float32))


def of_tokens(logits: jax.Array, tokens: jax.Array, k: int) -> LogprobBuffer:
    """``logits [..., V]`` (the rows that decided ``tokens [...]``) -> a block shaped like
    ``tokens``. One ``log_softmax`` array feeds the token's value and the top-k (module doc)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    own = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if k == 0:
        shape = tokens.shape + (0,)
        return LogprobBuffer(own, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32))
    top, ids = _top_k(logp, k)
    return LogprobBuffer(own, ids.astype(jnp.int32), top)


def write(buf: LogprobBuffer, dst: jax.Array, block: LogprobBuffer) -> LogprobBuffer:
    """``block [B, A, ...]`` into ``buf [B, W, ...]`` at columns ``dst [B, A]`` (indices
    ``>= W`` are dropped: the same scatter as the tokens')."""
    rows = jnp.arange(dst.shape[0])[:, None]
    return jax.tree.map(lambda b, x: b.at[rows, dst].set(x.astype(b.dtype), mode="drop"),
                        buf, block)


def maybe_write(state, dst: jax.Array, block: LogprobBuffer | None):
    """``state`` (any decode state with a ``logprobs`` field) with ``block`` written at
    ``dst``; unchanged when it keeps no logprobs or there is no block."""
    buf = getattr(state, "logprobs", None)
    if buf is None or block is None:
        return state
    return state.replace(logprobs=write(buf, dst, block))


def host_rows(token, top_ids, top, tokens, k: int | None = None) -> list[TokenLogprob]:
    """Host arrays of one row's slice (``token [n]``, ``top_ids / top [n, K]``) and the
    ``tokens [n]`` they describe -> :class:`TokenLogprob` s with the first ``k`` (default all
    ``K``) alternatives."""
    token, top_ids, top = np.asarray(token), np.asarray(top_ids), np.asarray(top)
    k = top_ids.shape[-1] if k is None else k
    return [TokenLogprob(int(t), float(token[i]),
                         [(int(a), float(b)) for a, b in zip(top_ids[i, :k], top[i, :k])])
            for i, t in enumerate(tokens)]


def read_rows(buf: LogprobBuffer, rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(token, top_ids, top)`` of ``buf``'s ``rows`` on the host (one transfer)."""
    return jax.device_get((buf.token[rows], buf.top_ids[rows], buf.top[rows]))
