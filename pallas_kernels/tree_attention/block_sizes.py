"""Block sizes for the tree-attention kernels (static, by page size), like JAX's ops folders.

``pages_per_block``: pages streamed per KV block. TPU: one grid step per block of
``pages_per_block * page_size`` keys, aiming at 128 keys (one lane width, so the
``q @ k.T`` scores fill whole vregs). GPU: one ``fori_loop`` iteration per block,
aiming at 64 keys (Triton's ``tl.dot`` needs >= 16 on every dim).

| page_size | TPU pages/block (keys) | GPU pages/block (keys) |
| --------- | ---------------------- | ---------------------- |
| 8         | 16 (128)               | 8 (64)                 |
| 16        | 8 (128)                | 4 (64)                 |
| 32        | 4 (128)                | 2 (64)                 |
| 64        | 2 (128)                | 1 (64)                 |
| >= 128    | 1 (page_size)          | 1 (page_size)          |

Rows (``N * G`` query rows of one KV head) are padded with zero rows: TPU to the
sublane tile (8 rows fp32, 16 rows bf16), GPU to a power of two >= 16.
The block never exceeds the table: ``pages_per_block <= max_pages`` (rounded to a
power of two on GPU, where shapes must be powers of two).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

TPU_TARGET_KEYS = 128
GPU_TARGET_KEYS = 64
GPU_NUM_WARPS = 4
GPU_NUM_STAGES = 2


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    pages_per_block: int
    rows: int           # padded N * G
    num_warps: int | None = None
    num_stages: int | None = None


def sublane_tile(dtype) -> int:
    """Rows of one TPU (8, 128) 32-bit tile for ``dtype`` (bf16 packs two rows a sublane)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def tpu_block_sizes(page_size: int, max_pages: int, rows: int, dtype) -> BlockSizes:
    ppb = max(1, TPU_TARGET_KEYS // page_size)
    ppb = min(ppb, max_pages)
    tile = sublane_tile(dtype)
    return BlockSizes(pages_per_block=ppb, rows=-(-rows // tile) * tile)


def gpu_block_sizes(page_size: int, max_pages: int, rows: int, dtype) -> BlockSizes:
    del dtype
    ppb = max(1, GPU_TARGET_KEYS // page_size)
    # Never more pages than the table has (rounded up to a power of two), but keep >= 16 keys.
    ppb = min(ppb, _pow2_ceil(max_pages))
    ppb = max(ppb, _pow2_ceil(-(-16 // page_size)))
    return BlockSizes(pages_per_block=ppb, rows=max(16, _pow2_ceil(rows)),
                      num_warps=GPU_NUM_WARPS, num_stages=GPU_NUM_STAGES)
