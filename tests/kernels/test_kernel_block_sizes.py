"""Block sizes that fit the accelerator's on-chip memory (pallas_kernels/tree_attention/
block_sizes.py): where one program's blocks would not fit GPU shared memory or TPU VMEM, the
kernels split the query rows over a grid axis (and the Triton kernel reads slices of a page).
Compiling for the H200 and TPU v5e without them (``python -m jspec.bench aot-kernels``)
found the shapes that did not fit; here a small budget forces the splits at test shapes,
run in interpret mode against the reference."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.tree_attention import block_sizes, validate
from test_kernel_tree_attention import _shapes, check


@pytest.mark.parametrize("budget,ps,want", [
    (12288, 64, dict(pages_per_block=1, num_stages=1, row_block=16, page_chunks=2)),
    pytest.param(24576, 16, dict(pages_per_block=4, num_stages=1, row_block=16, page_chunks=1),
                 marks=pytest.mark.slow),       # (the first case splits the rows too)
])
def test_gpu_blocks_that_fit_shared_memory(monkeypatch, budget, ps, want):
    """Where the whole block does not fit the GPU's shared memory, the Triton kernel splits
    the query rows over a third grid axis and reads slices of a page (found by compiling for
    the H200: ``python -m jspec.bench aot-kernels``). A small budget forces both here."""
    monkeypatch.setattr(block_sizes, "GPU_SMEM_BYTES", budget)
    M = -(-(20 + 16) // ps) + 1
    b = validate(*_shapes(N=16, H=4, KVH=2, D=32, ps=ps, M=M, mask=(jnp.uint16, 1)), backend="gpu")
    assert b.rows == 32 and {k: getattr(b, k) for k in want} == want
    jax.clear_caches()                 # the blocks are chosen at trace time
    try:
        check("gpu", N=16, ps=ps, G=2, D=32, max_pages=M, B=2, KVH=1, seed=5)
    finally:
        jax.clear_caches()


def test_tpu_rows_split_to_fit_vmem(monkeypatch):
    """The Mosaic kernel splits the query rows over a grid axis when one program's blocks
    would not fit VMEM (found compiling N = 64 with 64 query heads per KV head for v5e)."""
    M = -(-(20 + 16) // 16) + 1
    shapes = _shapes(N=16, H=4, KVH=2, D=128, ps=16, M=M, mask=(jnp.uint16, 1))
    keys = validate(*shapes, backend="tpu").pages_per_block * 16
    monkeypatch.setattr(block_sizes, "TPU_VMEM_BYTES",
                        block_sizes.tpu_vmem_bytes(keys, 16, 128, jnp.float32))
    b = validate(*shapes, backend="tpu")
    assert (b.rows, b.row_block) == (32, 16)
    jax.clear_caches()                 # the blocks are chosen at trace time
    try:
        check("tpu", N=16, ps=16, G=2, D=128, max_pages=M, B=2, KVH=1, seed=6)
    finally:
        jax.clear_caches()
