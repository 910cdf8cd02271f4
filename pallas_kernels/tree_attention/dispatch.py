"""Entry point: validate statically, then run the kernel for the backend.

``backend=None`` picks by ``jax.default_backend()``: 'tpu' -> Mosaic kernel,
'gpu' -> Triton kernel, anything else -> the jnp reference; ``interpret=True``
(with no backend) runs the TPU kernel in Pallas interpret mode instead, and with
``backend='gpu'`` the Triton kernel in interpret mode. Unsupported shapes raise
``ValueError`` from :func:`validate`; nothing falls back silently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention.kernel_gpu import tree_attention_gpu
from pallas_kernels.tree_attention.kernel_tpu import tree_attention_tpu
from pallas_kernels.tree_attention.reference import tree_attention_ref
from pallas_kernels.tree_attention.validate import canonical_backend, validate


def resolve_backend(backend: str | None, interpret: bool) -> str:
    if backend is not None:
        return canonical_backend(backend)
    if interpret:
        return "tpu"
    return canonical_backend(jax.default_backend())


def tree_attention(q, k_pages, v_pages, page_table, lengths, mask_bits, layer=None, *,
                   backend: str | None = None, interpret: bool = False) -> jax.Array:
    """``q [B, N, H, D]`` over layer ``layer`` (int32 scalar, traced allowed) of the stacked
    pools ``k_pages/v_pages [L, KVH, P, page_size, D]``, ``page_table [B, max_pages]``
    (unallocated = P), ``lengths [B]`` and packed tree mask ``mask_bits [B, N, W]`` ->
    ``[B, N, H, D]`` in ``q.dtype``. Jit-compatible. The kernels read the layer's pages
    straight from the stacked pools (no per-layer slice is ever materialised).

    One layer's pools ``[KVH, P, page_size, D]`` with ``layer=None`` are accepted too (a
    free leading unit axis is added)."""
    backend = resolve_backend(backend, interpret)
    blocks = validate(q, k_pages, v_pages, page_table, lengths, mask_bits, layer, backend=backend)
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    layer = jnp.asarray(layer, jnp.int32)
    if backend == "reference":
        if interpret:
            raise ValueError("interpret=True needs a kernel backend ('tpu' or 'gpu'), not the reference")
        return tree_attention_ref(q, k_pages, v_pages, page_table, lengths, mask_bits, layer)
    kernel = tree_attention_tpu if backend == "tpu" else tree_attention_gpu
    return kernel(q, k_pages, v_pages, page_table, lengths, mask_bits, layer, blocks=blocks,
                  interpret=interpret)
