"""Validation of tree-attention calls: static (shapes/dtypes, at trace time) and dynamic
(concrete values, host side) checks, kept apart like JAX's ops.

Static constraints (``validate``); every violation is a ``ValueError``, never a fallback:

| what               | all backends                          | TPU (Mosaic)               | GPU (Triton)                  |
| ------------------ | ------------------------------------- | -------------------------- | ----------------------------- |
| q                  | ``[B, N, H, D]``, fp32 or bf16        |                            |                               |
| k_pages, v_pages   | ``[L, KVH, P, page_size, D]`` (all    |                            |                               |
|                    | layers), q's dtype; or one layer's    |                            |                               |
|                    | ``[KVH, P, page_size, D]``            |                            |                               |
| layer              | int32 scalar (traced allowed) with    |                            |                               |
|                    | 5-D pools; None with 4-D pools        |                            |                               |
| N (tree nodes)     | 1 <= N <= 64                          |                            |                               |
| GQA                | H % KVH == 0                          |                            |                               |
| head_dim D         |                                       | D % 128 == 0; one tile of  | power of two, >= 16; the      |
|                    |                                       | rows fits VMEM (D <= 4096  | smallest blocks fit shared    |
|                    |                                       | fp32 at page_size <= 128)  | memory (D <= 1024 fp32, 2048  |
|                    |                                       |                            | bf16)                         |
| page_size          |                                       | multiple of 8 (fp32),      | power of two                  |
|                    |                                       | 16 (bf16): sublane tile    |                               |
| page_table         | ``[B, max_pages]`` int32              |                            |                               |
| lengths            | ``[B]`` int32                         |                            |                               |
| mask_bits          | ``[B, N, W]`` uint8/16/32 with        |                            |                               |
|                    | W = ceil(N / bits) (W <= 2)           |                            |                               |

Dynamic conditions (``check_dynamic``, host side on concrete arrays; inside jit they
cannot be checked and are the caller's contract): ``0 <= lengths``; every position
``< lengths[b] + N`` lies in an allocated page (entry in ``[0, P)``) of the table;
entries are in ``[0, P]`` (P = unallocated); every node sees itself (bit i of row i);
``0 <= layer < L`` (an out-of-range traced layer is clamped by the TPU pipeline's DMA
bounds, not checked).
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from pallas_kernels.tree_attention import block_sizes as bs

MAX_NODES = 64
BACKENDS = ("tpu", "gpu", "reference")
_MASK_DTYPES = (jnp.uint8, jnp.uint16, jnp.uint32)


def canonical_backend(backend: str) -> str:
    b = {"cuda": "gpu", "rocm": "gpu", "cpu": "reference", "ref": "reference"}.get(backend, backend)
    if b not in BACKENDS:
        raise ValueError(f"unknown tree-attention backend {backend!r}; expected one of {BACKENDS}")
    return b


def validate(q, k_pages, v_pages, page_table, lengths, mask_bits, layer=None, *,
             backend: str) -> bs.BlockSizes | None:
    """Static checks (shapes and dtypes only; arrays or ShapeDtypeStructs). Returns the
    block sizes the chosen kernel will use (None for the reference)."""
    backend = canonical_backend(backend)
    if q.ndim != 4:
        raise ValueError(f"q must be [B, N, H, D], got shape {q.shape}")
    B, N, H, D = q.shape
    if k_pages.shape != v_pages.shape or k_pages.ndim not in (4, 5):
        raise ValueError(f"k_pages and v_pages must both be [L, KVH, P, page_size, D] (with a layer "
                         f"index) or [KVH, P, page_size, D] (one layer), got {k_pages.shape} and "
                         f"{v_pages.shape}")
    if k_pages.ndim == 5:
        if layer is None:
            raise ValueError(f"stacked pools {k_pages.shape} ([L, KVH, P, page_size, D]) need a layer index")
        if tuple(getattr(layer, "shape", ())) != () or not jnp.issubdtype(
                getattr(layer, "dtype", jnp.int32), jnp.integer):
            raise ValueError(f"layer must be an integer scalar, got "
                             f"{getattr(layer, 'dtype', type(layer).__name__)}{getattr(layer, 'shape', '')}")
        if isinstance(layer, (int, np.integer)) and not 0 <= layer < k_pages.shape[0]:
            raise ValueError(f"layer {layer} out of range for {k_pages.shape[0]} stacked layers")
    elif layer is not None:
        raise ValueError(f"a layer index needs stacked pools [L, KVH, P, page_size, D], got one "
                         f"layer's {k_pages.shape}")
    KVH, P, ps, Dk = k_pages.shape[-4:]
    if Dk != D:
        raise ValueError(f"head_dim of q ({D}) and of the KV pages ({Dk}) differ")
    if H % KVH:
        raise ValueError(f"num_heads {H} is not a multiple of num_kv_heads {KVH} (GQA needs H = KVH * G)")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"tree attention supports float32 and bfloat16 inputs, got q dtype {q.dtype}")
    if jnp.dtype(k_pages.dtype) != jnp.dtype(q.dtype) or jnp.dtype(v_pages.dtype) != jnp.dtype(q.dtype):
        raise ValueError(f"q, k_pages and v_pages must share one dtype, got {q.dtype}, {k_pages.dtype}, "
                         f"{v_pages.dtype}")
    if not 1 <= N <= MAX_NODES:
        raise ValueError(f"tree attention supports 1 <= N <= {MAX_NODES} tree nodes (packed mask), got N={N}")
    if page_table.ndim != 2 or page_table.shape[0] != B or jnp.dtype(page_table.dtype) != jnp.int32:
        raise ValueError(f"page_table must be int32 [B={B}, max_pages], got {page_table.dtype}{page_table.shape}")
    if lengths.shape != (B,) or jnp.dtype(lengths.dtype) != jnp.int32:
        raise ValueError(f"lengths must be int32 [B={B}], got {lengths.dtype}{lengths.shape}")
    if mask_bits.ndim != 3 or mask_bits.shape[:2] != (B, N):
        raise ValueError(f"mask_bits must be [B={B}, N={N}, W], got shape {mask_bits.shape}")
    if jnp.dtype(mask_bits.dtype) not in [jnp.dtype(d) for d in _MASK_DTYPES]:
        raise ValueError(f"mask_bits must be uint8, uint16 or uint32 words, got {mask_bits.dtype}")
    bits = jnp.iinfo(mask_bits.dtype).bits
    W = mask_bits.shape[2]
    if W != -(-N // bits):
        raise ValueError(f"mask_bits has W={W} {mask_bits.dtype} words per row but N={N} nodes need "
                         f"exactly {-(-N // bits)}")
    max_pages = page_table.shape[1]
    rows = N * (H // KVH)
    if backend == "tpu":
        tile = bs.sublane_tile(q.dtype)
        if ps % tile:
            raise ValueError(f"TPU tree attention needs page_size to be a multiple of the {q.dtype} "
                             f"sublane tile ({tile} rows), got page_size={ps}")
        if D % 128:
            raise ValueError(f"TPU tree attention needs head_dim to be a multiple of 128 (lane width), got {D}")
        blocks = bs.tpu_block_sizes(ps, max_pages, rows, q.dtype, D)
        if blocks is None:
            raise ValueError(f"TPU tree attention: head_dim {D} in {q.dtype} with page_size {ps} "
                             f"does not fit VMEM even at one tile of rows (over the "
                             f"{bs.TPU_VMEM_BYTES} bytes it is built for)")
        return blocks
    if backend == "gpu":
        if D < 16 or D & (D - 1):
            raise ValueError(f"GPU (Triton) tree attention needs head_dim to be a power of two >= 16, got {D}")
        if ps & (ps - 1):
            raise ValueError(f"GPU (Triton) tree attention needs page_size to be a power of two, got {ps}")
        blocks = bs.gpu_block_sizes(ps, max_pages, rows, q.dtype, D)
        if blocks is None:
            need = bs.gpu_smem_bytes(bs.GPU_MIN_DIM, bs.GPU_MIN_DIM, D, q.dtype, 1)
            raise ValueError(f"GPU (Triton) tree attention: head_dim {D} in {q.dtype} needs {need} "
                             f"bytes of shared memory even at the smallest blocks (16 keys, 16 "
                             f"rows), over the {bs.GPU_SMEM_BYTES} it is built for")
        return blocks
    return None


def check_dynamic(page_table, lengths, mask_bits, *, num_pages: int, page_size: int) -> None:
    """Host-side checks of concrete values (see module doc); raises ``ValueError``."""
    from pallas_kernels.tree_attention.layout import unpack_words32

    pt = np.asarray(page_table)
    ln = np.asarray(lengths)
    N = np.asarray(mask_bits).shape[1]
    if (ln < 0).any():
        raise ValueError(f"negative lengths: {ln}")
    if ((pt < 0) | (pt > num_pages)).any():
        raise ValueError(f"page_table entries must lie in [0, {num_pages}] ({num_pages} = unallocated)")
    need = -(-(ln + N) // page_size)
    for b in range(pt.shape[0]):
        if need[b] > pt.shape[1] or (pt[b, : need[b]] >= num_pages).any():
            raise ValueError(f"row {b}: positions < lengths + N = {ln[b] + N} need {need[b]} allocated pages "
                             f"but its page table has {int((pt[b] < num_pages).sum())}")
    diag = np.asarray(unpack_words32(jnp.asarray(mask_bits), N))[:, np.arange(N), np.arange(N)]
    if not diag.all():
        raise ValueError("every tree node must see itself (bit i of mask row i)")
