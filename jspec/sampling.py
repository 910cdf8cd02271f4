"""Token selection: greedy, or sampling with temperature, top-k and top-p.

:func:`target_probs` is the one place that turns logits into the distribution a
sampler draws from; speculative verification must compare drafts against exactly
this distribution, so it reuses it rather than re-deriving the filters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import topk


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static (hashable) sampling settings. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0        # 0: no top-k filter
    top_p: float = 1.0    # 1.0: no nucleus filter

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def filtered_logits(logits: jax.Array, s: SamplingConfig) -> jax.Array:
    """Temperature-scaled fp32 logits with filtered-out tokens at -inf. ``[..., V]``."""
    x = logits.astype(jnp.float32) / s.temperature
    V = x.shape[-1]
    if 0 < s.top_k < V:
        kth = topk.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if s.top_p < 1.0:
        x = jnp.where(_top_p_keep(x, s.top_p, s.top_k), x, -jnp.inf)
    return x


# Top-p looks at a candidate set first (the top-k when a top-k filter is on, else the best
# TOP_P_CANDIDATES): when the nucleus ends inside it, as it nearly always does, nothing is
# sorted over the whole vocabulary; otherwise a full sort decides, so the result is exact.
TOP_P_CANDIDATES = 256


def _top_p_keep(x: jax.Array, top_p: float, top_k: int) -> jax.Array:
    """Which tokens the nucleus keeps: in descending order, a token stays while the mass
    strictly before it is below ``top_p`` (so the best token always stays); tokens tied
    with the last one kept stay too."""
    V = x.shape[-1]
    logz = jax.nn.logsumexp(x, axis=-1, keepdims=True)

    def threshold(vals):                 # vals: sorted descending, a prefix of all logits
        p = jnp.exp(vals - logz)
        n = jnp.sum((jnp.cumsum(p, axis=-1) - p) < top_p, axis=-1, keepdims=True)
        return jnp.take_along_axis(vals, n - 1, axis=-1), n

    C = min(V, top_k if 0 < top_k < V else TOP_P_CANDIDATES)
    vals = topk.top_k(x, C)[0]
    thr, n = threshold(vals)
    if C < V:
        # The nucleus is inside the candidates when it stops before their end, or when they
        # hold every finite logit (the top-k filter already dropped the rest).
        inside = (n < C) | (jnp.isfinite(x).sum(-1, keepdims=True) <= C)
        full = lambda: threshold(-jnp.sort(-x, axis=-1))[0]
        thr = jax.lax.cond(jnp.all(inside), lambda: thr, full)
    return x >= thr


def target_probs(logits: jax.Array, s: SamplingConfig) -> jax.Array:
    """The distribution tokens are drawn from; one-hot of the argmax when greedy."""
    if s.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(filtered_logits(logits, s), axis=-1)


def sample(logits: jax.Array, keys: jax.Array, s: SamplingConfig) -> jax.Array:
    """One token per row. ``logits: [B, V]``, ``keys: [B]`` (one PRNG key per row)."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = filtered_logits(logits, s)
    return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
