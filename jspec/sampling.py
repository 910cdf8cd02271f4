"""Token selection: greedy, or sampling with temperature, top-k and top-p.

:func:`target_probs` is the one place that turns logits into the distribution a
sampler draws from; speculative verification must compare drafts against exactly
this distribution, so it reuses it rather than re-deriving the filters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
        kth = jax.lax.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if s.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        p = jax.nn.softmax(sorted_x, axis=-1)
        # Keep a token if the mass strictly before it is below top_p (so the top token always stays).
        keep_sorted = (jnp.cumsum(p, axis=-1) - p) < s.top_p
        keep = jnp.zeros_like(keep_sorted).at[
            tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
        x = jnp.where(keep, x, -jnp.inf)
    return x


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
