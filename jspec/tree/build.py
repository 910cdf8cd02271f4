"""From parent pointers to everything verification needs.

A draft tree has N nodes per row, root = node 0 (the last emitted token, whose KV is
not yet cached), nodes in topological order (parent index < child index) and
siblings in the order the walk should try them. From ``parents`` alone we derive:

- ``depths``: root 0; RoPE positions are ``seq_len + depth`` (siblings share one);
- the tree mask restricted to the N tree columns (node i sees its ancestors and
  itself; prefix columns are implicitly visible, so nothing prefix x N exists);
  bit-packed, one row per node in ``words`` unsigned integers of the narrowest
  width of 8/16/32 bits that holds N (N <= 32: one word; 33..64: two uint32 words,
  low bits first, standing in for a uint64 that JAX has only under x64);
- ``first_child`` / ``next_sibling`` (-1 for none) for the verify walk.

The accepted path is read off the walk itself (it records the nodes it keeps), so no
per-node root path table is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.shapes import Int


@struct.dataclass
class DraftTree:
    tokens: Int["B N"]
    parents: Int["B N"]        # -1 for the root (and for a node whose parent was dropped)
    depths: Int["B N"]
    first_child: Int["B N"]
    next_sibling: Int["B N"]
    mask_bits: Int["B N W"]    # packed rows of the ancestor mask; see module doc

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def mask(self) -> jax.Array:
        """Boolean ancestor-or-self mask ``[B, N, N]`` (for the reference attention)."""
        return unpack_mask(self.mask_bits, self.num_nodes)


def mask_dtype(n: int):
    """(dtype, words) of the packed mask for ``n`` nodes."""
    for bits, dt in ((8, jnp.uint8), (16, jnp.uint16), (32, jnp.uint32)):
        if n <= bits:
            return dt, 1
    if n <= 64:
        return jnp.uint32, 2
    raise ValueError(f"a packed tree mask holds at most 64 nodes, got {n}")


def pack_mask(mask: jax.Array) -> jax.Array:
    """``[..., N, N]`` bool -> ``[..., N, W]`` packed (bit j of a row = column j)."""
    n = mask.shape[-1]
    dt, words = mask_dtype(n)
    bits = jnp.iinfo(dt).bits
    pad = words * bits - n
    m = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)])
    m = m.reshape(*mask.shape[:-1], words, bits).astype(dt)
    weights = (jnp.ones((), dt) << jnp.arange(bits, dtype=dt))
    return jnp.sum(m * weights, axis=-1, dtype=dt)


def unpack_mask(packed: jax.Array, n: int) -> jax.Array:
    bits = jnp.iinfo(packed.dtype).bits
    shifts = jnp.arange(bits, dtype=packed.dtype)
    m = (packed[..., None] >> shifts) & jnp.ones((), packed.dtype)
    return m.reshape(*packed.shape[:-1], -1)[..., :n].astype(bool)


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """``x[b, idx[b, i]]`` with -1 -> -1 (per-row gather along axis 1)."""
    safe = jnp.clip(idx, 0, x.shape[1] - 1)
    out = jnp.take_along_axis(x, safe, axis=1)
    return jnp.where(idx < 0, -1, out)


def build_tree(tokens: jax.Array, parents: jax.Array, max_depth: int) -> DraftTree:
    """``tokens, parents: [B, N]`` (root parent -1) -> :class:`DraftTree`.

    ``max_depth`` (S) bounds the depth statically: it fixes the number of
    pointer-chasing rounds.
    """
    B, N = parents.shape
    parents = parents.astype(jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    # Walk up S levels: ancestor[k] = k-th ancestor (0 = self); -1 past the root.
    anc = [idx]
    for _ in range(max_depth):
        anc.append(_gather_rows(parents, anc[-1]))
    anc = jnp.stack(anc, axis=-1)                           # [B, N, S+1]
    depths = jnp.sum(anc >= 0, axis=-1).astype(jnp.int32) - 1
    mask = jnp.any(anc[..., :, None] == jnp.arange(N)[None, None, None, :], axis=2)  # [B,N,N]

    is_child = parents[:, None, :] == idx[:, :, None]       # [B, parent i, child j]
    first_child = jnp.where(jnp.any(is_child, -1), jnp.argmax(is_child, -1), -1).astype(jnp.int32)
    same_parent = (parents[:, :, None] == parents[:, None, :]) & (idx[:, None, :] > idx[:, :, None])
    same_parent &= (parents >= 0)[:, :, None]
    next_sibling = jnp.where(jnp.any(same_parent, -1), jnp.argmax(same_parent, -1), -1).astype(jnp.int32)
    return DraftTree(tokens=tokens.astype(jnp.int32), parents=parents, depths=depths,
                     first_child=first_child, next_sibling=next_sibling,
                     mask_bits=pack_mask(mask))


def chain_parents(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)
