"""Rotary position embeddings, Llama-3 scaling included, bit for bit as transformers computes
the frequencies. A forward builds the tables once (:func:`rope_tables`) and every layer
rotates with them (:func:`rotate`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies, computed in float32 exactly as transformers does."""
    inv = (1.0 / (np.float32(rope.theta) ** (np.arange(0, head_dim, 2, dtype=np.int64)
                                              .astype(np.float32) / np.float32(head_dim))))
    inv = inv.astype(np.float32)
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wl = old / rope.low_freq_factor
        high_wl = old / rope.high_freq_factor
        wavelen = (2 * np.pi / inv).astype(np.float32)
        scaled = np.where(wavelen > low_wl, inv / rope.factor, inv).astype(np.float32)
        smooth = ((old / wavelen - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / rope.factor + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``(cos, signed sin)``, each ``[B, T, 1, D]`` fp32, for ``positions: [B, T]``: the sin's
    first half negated, so :func:`rotate` needs no negation. The same for every layer, so a
    forward computes them once (see :func:`forward`)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    half = freqs.shape[-1]
    sign = jnp.asarray(np.r_[-np.ones(half), np.ones(half)].astype(np.float32))
    return jnp.cos(emb), jnp.sin(emb) * sign


def rotate(x: jax.Array, cos: jax.Array, signed_sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of ``x: [B, T, H, D]`` with :func:`rope_tables`: ``x cos +
    (x2, x1) * (-sin, sin)``, the halves swapped by one roll."""
    xf = x.astype(jnp.float32)
    return (xf * cos + jnp.roll(xf, x.shape[-1] // 2, axis=-1) * signed_sin).astype(x.dtype)


def roll_matrix(head_dim: int, dtype) -> jax.Array:
    """``[D, D]`` permutation with ``x @ R == roll(x, D // 2)``: one product instead of
    the slices and concatenation XLA makes of a roll along the lane axis."""
    return jnp.asarray(np.roll(np.eye(head_dim, dtype=np.float32), head_dim // 2, axis=1), dtype)


def rotate_by_product(x: jax.Array, cos: jax.Array, signed_sin: jax.Array) -> jax.Array:
    """:func:`rotate` with the roll done as ``x @ R`` (:func:`roll_matrix`): every output is
    one input times 1 summed with zeros, in fp32, so finite values match :func:`rotate` bit
    for bit (a non-finite element spreads over its head, which is non-finite already).

    On TPU the product is one small MXU kernel that XLA fuses with the projection's
    epilogue; a roll along the lane axis was slices, a concatenation and relayouts, about
    eight kernels per layer (deviceless compile, 8B shape). XLA:CPU never fuses a dot, so
    the target rotates by :func:`rotate` there (:func:`jspec.llama.shared_inputs`)."""
    R = roll_matrix(x.shape[-1], x.dtype)
    rolled = jnp.einsum("...d,de->...e", x, R, preferred_element_type=jnp.float32,
                        precision=jax.lax.Precision.HIGHEST)
    return (x.astype(jnp.float32) * cos + rolled * signed_sin).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. ``x: [B, T, H, D]``, ``positions: [B, T]``."""
    return rotate(x, *rope_tables(positions, inv_freq))
