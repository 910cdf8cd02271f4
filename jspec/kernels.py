"""Which implementation runs attention and the verify walk.

``"reference"``: the jnp references (XLA), everywhere. ``"pallas"``: the Pallas kernels for
the backend (Mosaic on TPU, Triton on GPU); on CPU there is no compiled Pallas, so asking for
it there is an error, not a silent fallback. ``"pallas_interpret"`` / ``"pallas_interpret_gpu"``:
the TPU (Mosaic) / GPU (Triton) kernels in Pallas interpret mode, on any backend (tests run
them on CPU this way).

The kernels need lane-friendly head dims (TPU: a multiple of 128; GPU: a power of two >= 16).
A smaller head dim (tiny test models) is zero-padded up to that width here, with the query
pre-scaled so the kernel's ``D_pad ** -0.5`` becomes the model's ``D ** -0.5``; that copies
the layer's page pool each call, which is fine for tests and never happens for real models.

The tree-attention kernel serves every block of at most 64 queries that is a square window
(plain decode, N = 1, and tree verification). Prefill blocks (longer prompts) and a
drafter's tree-loop window (K queries over S*K transient slots) are not what it is for:
those run the XLA attention, by design.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.attention import causal_block_mask, paged_attention_ref
from jspec.spec_config import MAX_TREE_NODES
from jspec.tree.build import pack_mask

MODES = ("reference", "pallas", "pallas_interpret", "pallas_interpret_gpu")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"kernels={mode!r}: choose one of {MODES}")
    if mode == "pallas" and jax.default_backend() not in ("tpu", "gpu"):
        raise ValueError(f"kernels='pallas' needs a TPU or GPU (backend is "
                         f"{jax.default_backend()!r}); use 'pallas_interpret' or 'reference'")


def _backend(mode: str) -> str:
    if mode == "pallas":
        return jax.default_backend()
    return "gpu" if mode == "pallas_interpret_gpu" else "tpu"


def _padded_head_dim(D: int, backend: str) -> int:
    if backend == "tpu":
        return -(-D // 128) * 128
    return max(16, 1 << (D - 1).bit_length())


def attention_fn(mode: str):
    """An ``attention_fn`` for :class:`jspec.llama.Llama` (same signature as the reference)."""
    if mode == "reference":
        return paged_attention_ref
    from pallas_kernels.tree_attention import tree_attention
    backend = _backend(mode)
    interpret = mode != "pallas"

    def attend(q, cache, layer, block_mask=None):
        B, T, H, D = q.shape
        if block_mask is None:
            block_mask = jnp.broadcast_to(causal_block_mask(T), (B, T, T))
        if T > MAX_TREE_NODES or block_mask.shape[-1] != T:
            return paged_attention_ref(q, cache, layer, block_mask)
        k, v = cache.k_pages[layer], cache.v_pages[layer]
        Dp = _padded_head_dim(D, backend)
        if Dp != D:
            pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Dp - D)])
            q, k, v = pad(q * jnp.asarray((Dp / D) ** 0.5, q.dtype)), pad(k), pad(v)
        out = tree_attention(q, k, v, cache.page_table, cache.lengths, pack_mask(block_mask),
                             backend=backend, interpret=interpret)
        return out[..., :D]
    return attend


def walk_impl(mode: str) -> str:
    return {"reference": "reference", "pallas": "auto", "pallas_interpret": "tpu_interpret",
            "pallas_interpret_gpu": "gpu_interpret"}[mode]
