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

**On-chip memory.** A program that does not fit fails to compile (found by compiling for the
H200 and TPU v5e/v6e/v5p without them: ``python -m jspec.bench aot-kernels``). GPU: a Triton
program keeps its query rows, ``num_stages`` copies of the K and V blocks and (fp32) a
score-sized buffer in shared memory; :func:`gpu_block_sizes` keeps the keys per block of the
table above, all rows in one program and 2 stages when that fits :data:`GPU_SMEM_BYTES` (head
dim 128, page size 16: up to N * G = 128 fp32 / 512 bf16 rows), and otherwise steps down, in
this order: 1 stage; half the rows per program (``row_block``, a grid axis: rows are
independent); fewer keys per block (fewer pages, then ``page_chunks`` > 1: a block is a
slice of one page), down to 16 rows and 16 keys. TPU: the rows are split into the fewest
equal blocks whose program fits :data:`TPU_VMEM_BYTES` (:func:`tpu_vmem_bytes`). What does
not fit even at the smallest blocks is refused by ``validate``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

TPU_TARGET_KEYS = 128
LANES = 128
# VMEM one TPU program may use: Mosaic's default scoped limit on v5e and v5p (v6e has 32 MiB).
TPU_VMEM_BYTES = 16 * 1024 * 1024
GPU_TARGET_KEYS = 64
GPU_NUM_WARPS = 4
GPU_NUM_STAGES = 2
GPU_MIN_DIM = 16          # Triton's tl.dot: >= 16 on every dim
# Shared memory per block the GPU kernel is built for: sm_90's opt-in limit (H100/H200, 227 KiB).
# GPUs with less (A100: 163 KiB) may refuse the largest blocks at compile time; kernels="auto"
# then falls back to the reference with a warning (jspec.kernels.resolve).
GPU_SMEM_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    pages_per_block: int
    rows: int           # padded N * G
    num_warps: int | None = None
    num_stages: int | None = None
    row_block: int | None = None    # GPU: query rows per program (a power of two dividing rows)
    page_chunks: int = 1            # GPU: key blocks per page (> 1: a block is a slice of a page)


def sublane_tile(dtype) -> int:
    """Rows of one TPU (8, 128) 32-bit tile for ``dtype`` (bf16 packs two rows a sublane)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def tpu_vmem_bytes(keys: int, rows: int, head_dim: int, dtype) -> int:
    """VMEM (bytes) of one program of the Mosaic kernel: double-buffered query, output and
    mask-word blocks (the words padded to 128 lanes), the ``m, l`` and accumulator scratch,
    double-buffered K and V blocks, and four ``[rows, keys]`` fp32 score temporaries. An upper
    bound on what Mosaic allocated in deviceless compiles (``python -m jspec.bench
    aot-kernels``; it reports the size when over the limit: 23.0 MiB against 26 here at
    1024 rows x head dim 1024 fp32, 25.7 against 26.3 at 4096 rows x 128)."""
    item = jnp.dtype(dtype).itemsize
    return (4 * rows * head_dim * item + 4 * rows * LANES * 4 + rows * head_dim * 4
            + 4 * keys * head_dim * item + 4 * rows * keys * 4)


def tpu_block_sizes(page_size: int, max_pages: int, rows: int, dtype,
                    head_dim: int) -> BlockSizes | None:
    """TPU blocks (module doc); the rows split into equal blocks (``row_block``, a grid axis)
    when one program would not fit :data:`TPU_VMEM_BYTES`; None when one tile of rows does
    not fit either."""
    ppb = max(1, TPU_TARGET_KEYS // page_size)
    ppb = min(ppb, max_pages)
    tile = sublane_tile(dtype)
    tiles = -(-rows // tile)
    for n in range(1, tiles + 1):                # row blocks: the fewest that fit
        rb = -(-tiles // n) * tile
        if tpu_vmem_bytes(ppb * page_size, rb, head_dim, dtype) <= TPU_VMEM_BYTES:
            return BlockSizes(pages_per_block=ppb, rows=rb * -(-tiles * tile // rb), row_block=rb)
    return None


def gpu_smem_bytes(keys: int, rows: int, head_dim: int, dtype, stages: int) -> int:
    """Shared memory (bytes) the Triton kernel asks for with ``keys`` keys per block, ``rows``
    query rows per program and ``stages`` pipeline stages: an upper bound fitted to what
    Triton requested in deviceless sm_90 compiles (``python -m jspec.bench aot-kernels``
    with a 1 KiB limit, which reports the request): the resident queries plus ``stages``
    K and V blocks, exact for bf16 at large ``rows`` and above it otherwise; fp32 adds up
    to one ``[rows, keys]`` fp32 buffer (measured 0.5-88% of it)."""
    item = jnp.dtype(dtype).itemsize
    extra = rows * keys * 4 if item == 4 else 0
    return (stages * 2 * keys + rows) * head_dim * item + extra


def gpu_block_sizes(page_size: int, max_pages: int, rows: int, dtype,
                    head_dim: int) -> BlockSizes | None:
    """The GPU blocks (see the module doc), or None when no block fits in shared memory."""
    ppb = max(1, GPU_TARGET_KEYS // page_size)
    # Never more pages than the table has (rounded up to a power of two), but keep >= 16 keys.
    ppb = min(ppb, _pow2_ceil(max_pages))
    ppb = max(ppb, _pow2_ceil(-(-GPU_MIN_DIM // page_size)))
    R = max(GPU_MIN_DIM, _pow2_ceil(rows))
    # (pages per block, chunks per page), most keys first: fewer pages, then slices of a page.
    choices = [(p, 1) for p in _halvings(ppb, lambda p: p * page_size >= GPU_MIN_DIM)]
    if choices[-1][0] == 1:
        choices += [(1, page_size // k)
                    for k in _halvings(page_size, lambda k: k >= GPU_MIN_DIM)[1:]]
    for p, chunks in choices:
        keys = p * page_size // chunks
        for rb in _halvings(R, lambda r: r >= GPU_MIN_DIM):
            for stages in (GPU_NUM_STAGES, 1):
                if gpu_smem_bytes(keys, rb, head_dim, dtype, stages) <= GPU_SMEM_BYTES:
                    return BlockSizes(pages_per_block=p, rows=R, num_warps=GPU_NUM_WARPS,
                                      num_stages=stages, row_block=rb, page_chunks=chunks)
    return None


def _halvings(x: int, keep) -> list[int]:
    """``x, x/2, x/4, ...`` while ``keep`` holds (``x`` itself always)."""
    out = [x]
    while out[-1] % 2 == 0 and keep(out[-1] // 2):
        out.append(out[-1] // 2)
    return out
