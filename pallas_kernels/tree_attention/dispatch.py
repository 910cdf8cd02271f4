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

from pallas_kernels.tree_attention import layout
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


def row_inputs(q, k_pages, page_table, mask_bits, *, backend: str | None = None,
               interpret: bool = False) -> layout.RowInputs | None:
    """The kernel's layer-independent inputs for a block of queries shaped like ``q`` (an
    array or ShapeDtypeStruct) over pools shaped like ``k_pages``: build them once per
    forward and pass them to every layer's :func:`tree_attention` as ``prepared``. None
    for the reference backend, which needs none."""
    backend = resolve_backend(backend, interpret)
    layer = 0 if k_pages.ndim == 5 else None
    lengths = jax.ShapeDtypeStruct(page_table.shape[:1], jnp.int32)
    blocks = validate(q, k_pages, k_pages, page_table, lengths, mask_bits, layer, backend=backend)
    if backend == "reference":
        return None
    KVH, P = k_pages.shape[-4:-2]
    return layout.row_inputs(page_table, mask_bits, P, q.shape[2] // KVH, blocks)


def tree_attention(q, k_pages, v_pages, page_table, lengths, mask_bits, layer=None, *,
                   backend: str | None = None, interpret: bool = False,
                   prepared: layout.RowInputs | None = None,
                   grouped: jax.Array | None = None, return_lse: bool = False):
    """``q [B, N, H, D]`` over layer ``layer`` (int32 scalar, traced allowed) of the stacked
    pools ``k_pages/v_pages [L, KVH, P, page_size, D]``, ``page_table [B, max_pages]``
    (unallocated = P), ``lengths [B]`` and packed tree mask ``mask_bits [B, N, W]`` ->
    ``[B, N, H, D]`` in ``q.dtype``. Jit-compatible. The kernels read the layer's pages
    straight from the stacked pools (no per-layer slice is ever materialised).

    One layer's pools ``[KVH, P, page_size, D]`` with ``layer=None`` are accepted too (a
    free leading unit axis is added). ``prepared``: :func:`row_inputs` of the same call.
    ``grouped`` (TPU kernel only; see :func:`kernel_tpu.tree_attention_tpu`): ``q`` already
    grouped by KV head. ``return_lse``: ``(out, log-sum-exp [B, N, H] fp32)``, for merging
    with attention over keys elsewhere (a drafter's tree-loop window)."""
    backend = resolve_backend(backend, interpret)
    blocks = validate(q, k_pages, v_pages, page_table, lengths, mask_bits, layer, backend=backend)
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    layer = jnp.asarray(layer, jnp.int32)
    if backend == "reference":
        if interpret:
            raise ValueError("interpret=True needs a kernel backend ('tpu' or 'gpu'), not the reference")
        return tree_attention_ref(q, k_pages, v_pages, page_table, lengths, mask_bits, layer,
                                  return_lse=return_lse)
    if backend == "tpu":
        return tree_attention_tpu(q, k_pages, v_pages, page_table, lengths, mask_bits, layer,
                                  blocks=blocks, interpret=interpret, prepared=prepared,
                                  grouped=grouped, return_lse=return_lse)
    return tree_attention_gpu(q, k_pages, v_pages, page_table, lengths, mask_bits, layer,
                              blocks=blocks, interpret=interpret, prepared=prepared,
                              return_lse=return_lse)
