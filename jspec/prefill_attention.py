"""A prefill chunk's attention through jax's own kernels.

A chunk (:mod:`jspec.prefill`) has its C tokens' KV written after each row's ``committed``
prefix; query t attends to every position up to ``committed + t``. The reference
materialises ``[B, H, C, S]`` fp32 scores for that, which on the 8B program at 8k context
made one chunk move 74.7 GB against a plain step's 16.1 GB (deviceless v6e). jax ships
flash kernels that never write the scores, so the chunk uses them where they serve:

- **TPU**: ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, the paged attention
  of mixed prefill and decode batches (JetStream's and tpu-inference's). Its causal rule is
  ours: a sequence's ``q_len`` queries end at its ``kv_len``. Its KV layout is one pool
  ``[pages, page_size, 2 KVH, D]`` with keys and values interleaved by head, not jspec's
  ``[L, KVH, P, page_size, D]`` pair, so each layer's call reads the rows' pages into that
  layout first (O(context) bytes, no scores). The flash-attention and splash kernels take
  a causal offset only as a static value, and the chunk's offset is the scan's counter.
- **GPU**: ``jax.nn.dot_product_attention`` with ``implementation="cudnn"`` (cuDNN's flash
  attention) over the rows' keys read contiguous, with the causal-with-offset rule as its
  boolean mask. cuDNN takes fp16 and bf16 only (fp32 models take the CPU path). jax's
  Pallas GPU attention (``pallas.ops.gpu.attention``) has only a top-left causal mask.
- **CPU**, and wherever those do not serve: an online softmax in jnp
  (:func:`blocked_attention`), a ``lax.while_loop`` over blocks of the rows' pages up to the
  longest live row, each block read through the page table; its temporaries are one
  block's ``[B, H, C, KB]`` scores whatever the context (the reference's grew with it:
  9.4 GB at 8k on the 100m config).

On a CPU, ``kernels="pallas_interpret_gpu"`` runs the GPU path's call with XLA's
implementation. jax 0.10.2's interpret mode cannot run the TPU kernel and its reference
(``ref_ragged_paged_attention``) does not trace under jit, so ``"pallas_interpret"``
prefills with :func:`blocked_attention`; the tests check :func:`ragged_paged_operands` by
running that reference on them eagerly, and compile the kernel for TPUs deviceless.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jspec import kv_cache as kvc
from jspec.attention import Block, full_mask
from jspec.sharding import heads_axis, per_device


def problem(impl: str, *, head_dim: int, dtype, page_size: int) -> str | None:
    """Why the ``impl`` kernel cannot serve a prefill of these shapes, or None."""
    if impl == "rpa":
        if head_dim % 128:
            return f"ragged_paged_attention needs a head dim that is a multiple of 128, got {head_dim}"
        if page_size % 8:
            return f"ragged_paged_attention needs pages of whole 8-row tiles, got {page_size}"
    if impl == "cudnn":
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"cuDNN's flash attention takes fp16 and bf16, not {jnp.dtype(dtype).name}"
        if head_dim > 256 or head_dim % 8:
            return f"cuDNN's flash attention needs a head dim <= 256 and a multiple of 8, got {head_dim}"
        return cudnn_missing()
    return None


@functools.cache
def cudnn_missing() -> str | None:
    """Why jax cannot build a cuDNN attention here (no cuDNN library: a deviceless compile
    with the gpu-aot extra, a CUDA install without it), or None. jax checks while tracing."""
    x = jax.ShapeDtypeStruct((1, 8, 1, 64), jnp.bfloat16)
    try:
        jax.eval_shape(functools.partial(jax.nn.dot_product_attention, implementation="cudnn"),
                       x, x, x)
    except Exception as e:  # noqa: BLE001 - any refusal means: not here
        return f"cuDNN attention unavailable: {str(e).splitlines()[0][:120]}"
    return None


@dataclasses.dataclass(frozen=True)
class PrefillAttention:
    """A chunk's attention backend for :func:`jspec.llama.forward`: ``prepare`` once per
    chunk, call once per layer. ``impl``: ``"rpa"`` (TPU), ``"cudnn"`` (GPU), ``"dpa_xla"``
    (the GPU call with XLA's implementation) or ``"blocked"`` (:func:`blocked_attention`)."""
    impl: str

    def prepare(self, cache: kvc.PagedKVCache, block_mask, q) -> Block:
        """``block_mask`` must be None (causal): a chunk, not a tree."""
        if block_mask is not None:
            raise ValueError("prefill attention serves causal chunks only")
        return Block(mask=full_mask(None, q.shape[0], q.shape[1]), table=kvc.read_table(cache))

    def __call__(self, q: jax.Array, cache: kvc.PagedKVCache, layer, block: Block) -> jax.Array:
        """``q [B, C, H, D]`` at positions ``cache.lengths + t`` (the chunk's KV written
        there) -> ``[B, C, H, D]``."""
        if self.impl == "blocked":
            return blocked_attention(q, cache, layer, block.table)
        layer = jnp.asarray(layer, jnp.int32)
        h = heads_axis(cache.k_pages.shape[-4])
        if self.impl == "rpa":
            # The pools go in whole (sharded over KV heads under a mesh): each device lays
            # out its own heads' rows in the kernel's format, in one gather per pool.
            return per_device(_ragged_paged, (q, cache.k_pages, cache.v_pages, block.table,
                                              cache.lengths, layer),
                              (P(None, None, h), P(None, h), P(None, h), P(), P(), P()),
                              P(None, None, h))
        k, v = kvc.read_layer(cache, layer, block.table)               # [B, KVH, S, D]
        impl = "cudnn" if self.impl == "cudnn" else "xla"
        # Under a mesh, each device attends with its own KV heads (XLA cannot partition a
        # kernel call); off one, directly.
        return per_device(functools.partial(_dot_product, implementation=impl),
                          (q, k, v, cache.lengths),
                          (P(None, None, h), P(None, h), P(None, h), P()), P(None, None, h))


class ChunkRouted:
    """An attention backend (``main``: the reference or the tree kernel) whose causal blocks
    longer than ``longest_tree`` queries go to ``chunk(head_dim, dtype, page_size)``, a
    :class:`PrefillAttention`: a drafter's ``prefill``/``extend`` of a 512-token prompt
    chunk otherwise fell to the reference and held ``[B, H, C, S]`` fp32 scores (4.4 GB, all
    but 0.1 GB of the 8B speculative program's temporaries at batch 8, 8k, on one v6e chip).
    Everything else (``writes_kv``, ``windowed``, ...) is ``main``'s."""

    def __init__(self, main, longest_tree: int, chunk):
        self.main, self.longest_tree, self.chunk = main, longest_tree, chunk

    def __getattr__(self, name):
        if name == "main":           # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.main, name)

    def _chunk_backend(self, cache, block_mask, q):
        if block_mask is not None or q.shape[1] <= self.longest_tree:
            return None
        return self.chunk(cache.k_pages.shape[-1], cache.k_pages.dtype, cache.page_size)

    def prepare(self, cache, block_mask, q) -> Block:
        backend = self._chunk_backend(cache, block_mask, q)
        if backend is None:
            return self.main.prepare(cache, block_mask, q)
        return backend.prepare(cache, None, q).replace(chunk=backend)

    def __call__(self, q, cache, layer, block_mask=None, **kw):
        if not isinstance(block_mask, Block):
            if self._chunk_backend(cache, block_mask, q) is None:
                return self.main(q, cache, layer, block_mask, **kw)
            block_mask = self.prepare(cache, block_mask, q)
        if block_mask.chunk is not None:
            return block_mask.chunk(q, cache, layer, block_mask)
        return self.main(q, cache, layer, block_mask, **kw)


def ragged_paged_operands(q, k_pages, v_pages, table, committed, layer) -> tuple:
    """``ragged_paged_attention``'s operands for a chunk: ``q [B, C, H, D]`` as ``B``
    sequences of ``C`` queries ending at ``committed + C``, over the rows' pages of layer
    ``layer`` of the pools ``[L, KVH, P, page_size, D]`` (``table [B, M]``, clamped into
    the pool), gathered straight into its layout: pages ``[B * M', page_size, 2 KVH, D]``
    with keys and values interleaved by head."""
    B, C, H, D = q.shape
    _, KVH, _, ps, _ = k_pages.shape
    # Pages for a last chunk that runs past the rows' allocation: copies of the row's last
    # page, read only by that chunk's padding queries; a real query never reads past its
    # row's own tokens.
    extra = -(-C // ps)
    t = jnp.concatenate([table, jnp.broadcast_to(table[:, -1:], (B, extra))], 1)   # [B, M']
    rows = lambda pool: kvc.gather_pages(pool, layer, t, heads_first=False)  # [B, M', KVH, ps, D]
    M = t.shape[1]
    kv = jnp.stack([rows(k_pages), rows(v_pages)], axis=3)             # [B, M', KVH, 2, ps, D]
    kv = kv.transpose(0, 1, 4, 2, 3, 5).reshape(B * M, ps, 2 * KVH, D)  # k0 v0 k1 v1 ...
    pages = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
    return (q.reshape(B * C, H, D), kv, (committed + C).astype(jnp.int32), pages,
            jnp.arange(B + 1, dtype=jnp.int32) * C, jnp.array([B], jnp.int32))


def _ragged_paged(q, k_pages, v_pages, table, committed, layer):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    B, C, H, D = q.shape
    ps = k_pages.shape[-2]
    args = ragged_paged_operands(q, k_pages, v_pages, table, committed, layer)
    pages = args[3].shape[1]
    out = ragged_paged_attention(*args, sm_scale=1.0 / math.sqrt(D),
                                 num_kv_pages_per_block=min(pages, max(1, 128 // ps)),
                                 num_queries_per_block=min(C, 64))
    return out.reshape(B, C, H, D).astype(q.dtype)


def _dot_product(q, k, v, committed, implementation: str):
    B, C = q.shape[:2]
    S = k.shape[2]
    pos = committed[:, None, None, None] + jnp.arange(C)[None, None, :, None]
    mask = jnp.arange(S)[None, None, None, :] <= pos                      # [B, 1, C, S]
    out = jax.nn.dot_product_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                                       mask=mask, implementation=implementation)
    return out.astype(q.dtype)


#: Keys per block of :func:`blocked_attention` (rounded to whole pages).
KEY_BLOCK = 512


def blocked_attention(q, cache: kvc.PagedKVCache, layer, table=None) -> jax.Array:
    """The chunk's attention as an online softmax over blocks of about :data:`KEY_BLOCK`
    keys, each read from the pool through the page table: ``q [B, C, H, D]`` at positions
    ``cache.lengths + t``, which sees every position up to its own. Only blocks below the
    longest row's ``lengths + C`` are visited. fp32 scores and accumulation."""
    B, C, H, D = q.shape
    table = kvc.read_table(cache) if table is None else table
    ps, M = cache.page_size, table.shape[1]
    ppb = max(1, min(M, KEY_BLOCK // ps))                  # pages per block
    table = jnp.pad(table, ((0, 0), (0, -M % ppb)))        # page 0 past the end: masked
    KVH = cache.k_pages.shape[1]
    qg = q.reshape(B, C, KVH, H // KVH, D).astype(jnp.float32) * (D ** -0.5)
    pos = cache.lengths[:, None] + jnp.arange(C)[None]                     # [B, C]
    kb = ppb * ps
    hi = jax.lax.Precision.HIGHEST

    def body(carry):
        i, m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, i * ppb, ppb, 1)
        k, v = kvc.read_layer(cache, layer, pages)                           # [B, KVH, kb, D]
        s = jnp.einsum("bckgd,bksd->bkgcs", qg, k.astype(jnp.float32), precision=hi)
        key = i * kb + jnp.arange(kb)
        vis = (key[None, None, :] <= pos[:, :, None])[:, None, None]          # [B,1,1,C,kb]
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(vis, jnp.exp(s - safe[..., None]), 0.0)
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        acc = acc * alpha[..., None] + jnp.einsum("bkgcs,bksd->bkgcd", p,
                                                  v.astype(jnp.float32), precision=hi)
        return i + 1, m_new, l * alpha + jnp.sum(p, axis=-1), acc

    G = H // KVH
    n = (jnp.max(cache.lengths) + C + kb - 1) // kb
    n = jnp.minimum(n, table.shape[1] // ppb)
    init = (jnp.int32(0), jnp.full((B, KVH, G, C), -jnp.inf, jnp.float32),
            jnp.zeros((B, KVH, G, C), jnp.float32), jnp.zeros((B, KVH, G, C, D), jnp.float32))
    _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < n, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]                         # [B, KVH, G, C, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, C, H, D).astype(q.dtype)
