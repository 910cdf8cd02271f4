"""Reference (pure jnp) attention of a block of new queries over a row's paged KV.

The block's own keys have already been written to the cache after ``lengths``.
Query ``t`` of row ``b`` sees every committed prefix position ``p < lengths[b]``
and the window positions ``lengths[b] + w`` for which ``block_mask[b, t, w]`` holds.
The window is usually the block itself (``[B, T, T]``: causal when ``block_mask`` is
None, a tree mask for verification); a drafter's tree loop uses a wider window
``[B, T, W]`` covering the transient slots its earlier steps wrote. Only the window
mask is ever built, never prefix x T.

This is the jnp reference the Pallas kernels are checked against; it gathers the
row's pages into a contiguous view, which is simple and right. On CPU it reads only the
bucket of the page table that holds the live length (see ``LIVE_MIN_PAGES``); elsewhere
it reads the whole addressable length.

What only depends on the block and the cache's lengths, not on the layer (the ``[B, T, S]``
visibility, the kernels' packed mask), is computed once per forward by the backend's
``prepare`` (a :class:`Block`) and handed to every layer. In a scanned layer stack XLA
recomputed it inside each layer's body (deviceless TPU compile, 8B shape).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jspec import kv_cache as kvc
from jspec.platform import target_platform
from jspec.shapes import Bool, Int


def causal_block_mask(T: int) -> jax.Array:
    return jnp.tril(jnp.ones((T, T), bool))


def visibility(lengths: jax.Array, num_keys: int, block_mask: jax.Array) -> jax.Array:
    """``[B, T, S]`` bool: which of the row's ``S`` key slots query ``t`` may read."""
    B, T, W = block_mask.shape
    p = jnp.arange(num_keys, dtype=jnp.int32)[None, None, :]
    rel = p - lengths[:, None, None]                      # offset into the window
    in_window = (rel >= 0) & (rel < W)
    blk = jnp.take_along_axis(block_mask, jnp.clip(rel, 0, W - 1).repeat(T, axis=1), axis=2)
    return (rel < 0) | (in_window & blk)


def _softmax_attend(qg, keys, values, visible, D):
    """GQA attention of ``qg [B, T, KVH, G, D]`` over key/value segments laid side by side
    (``keys[i], values[i]: [B, KVH, S_i, D]``, ``visible[i]`` broadcastable to
    ``[B, 1, 1, T, S_i]``), with one softmax across all segments. Scores, softmax and
    accumulation are fp32; the cache is read in its own dtype (bf16 stays bf16 in memory).

    XLA:CPU has no bf16 x bf16 -> fp32 dot (jax 0.10.2 fails at run time: "Unsupported
    element type for DotThunk"), so on CPU a low-precision segment is widened inside the
    product (fused into the gather there; CPU serving is fp32 anyway)."""
    hi = jax.lax.Precision.HIGHEST
    widen = target_platform() == "cpu"

    def operand(x):
        return x.astype(jnp.float32) if widen else x

    scores = [jnp.where(vis, jnp.einsum("btkgd,bksd->bkgts", operand(qg.astype(k.dtype)),
                                        operand(k), precision=hi,
                                        preferred_element_type=jnp.float32) * (D ** -0.5), -jnp.inf)
              for k, vis in zip(keys, visible)]
    p = jax.nn.softmax(jnp.concatenate(scores, -1) if len(scores) > 1 else scores[0], axis=-1)
    out, start = 0.0, 0
    for v, sc in zip(values, scores):
        n = sc.shape[-1]
        out = out + jnp.einsum("bkgts,bksd->btkgd", operand(p[..., start:start + n].astype(v.dtype)),
                               operand(v), precision=hi, preferred_element_type=jnp.float32)
        start += n
    return out


@struct.dataclass
class Block:
    """One forward's query block as every layer's attention sees it (see the module doc).
    ``mask``: the window mask; ``visible``: the reference's key visibility (None when a
    kernel serves the block), ``table`` the page table it gathers by
    (:func:`jspec.kv_cache.read_table`) and ``reach`` the live-length bucket it reads
    (:func:`reach`); ``mask_bits``: the kernels' packed mask and
    ``rows`` their page table and mask words (None for the reference)."""
    mask: Bool["B T W"]
    visible: Bool["B T S"] | None = None
    table: Int["B max_pages"] | None = None
    reach: Int[""] | None = None
    mask_bits: jax.Array | None = None
    rows: tuple | None = None
    chunk: object = struct.field(pytree_node=False, default=None)  # a prompt chunk's backend


def full_mask(block_mask: jax.Array | None, B: int, T: int) -> jax.Array:
    """``block_mask`` or, when None, the causal ``[B, T, T]`` mask."""
    if block_mask is None:
        return jnp.broadcast_to(causal_block_mask(T), (B, T, T))
    return block_mask


# Reading only the live length. Shapes are static, so the reference reads a bucket of the
# page table: the smallest of a few fixed fractions of it that covers every row's committed
# length plus the block (:func:`reach_buckets`), one ``lax.switch`` branch per bucket. A
# short table (fewer than LIVE_MIN_PAGES pages) has one bucket and no switch: there the
# read is small and more branches would only cost compile time.
#
# CPU only, where the reference is what runs: a 100m plain step, batch 8, 512 new tokens from
# 12, went from 51.5/56.1 to 44.0/42.4 ms (with the per-forward hoisting; interleaved A/B)
# for 30% more compile time. On TPU/GPU the kernels read only the live pages themselves and
# the reference is a fallback: there the buckets made the 8B iteration compile 55 -> 83 s
# (deviceless v5p), so it keeps one read.
LIVE_MIN_PAGES = 16
LIVE_FRACTIONS = (4, 2, 1)          # buckets: 1/4, 1/2 and all of a row's pages


def reach_buckets(max_pages: int) -> tuple[int, ...]:
    """The page counts a reference attention read may be cut to (ascending)."""
    if max_pages < LIVE_MIN_PAGES or target_platform() != "cpu":
        return (max_pages,)
    return tuple(sorted({-(-max_pages // f) for f in LIVE_FRACTIONS}))


def reach(lengths: jax.Array, window: int, page_size: int, max_pages: int) -> jax.Array:
    """Index into :func:`reach_buckets` of the smallest bucket holding every row's
    ``lengths + window`` positions."""
    pages = (jnp.max(lengths) + window + page_size - 1) // page_size
    sizes = jnp.asarray(reach_buckets(max_pages)[:-1], jnp.int32)
    return jnp.sum(pages > sizes).astype(jnp.int32)


def _live_read(cache: kvc.PagedKVCache, layer, table, branch, attend):
    """``attend(k, v, n)`` over the first ``n`` pages of every row (``k, v: [B, KVH, n *
    page_size, D]``), ``n`` the bucket ``branch`` picks."""
    def read(n):
        return lambda: attend(*kvc.read_layer(cache, layer, table[:, :n]), n * cache.page_size)
    sizes = reach_buckets(table.shape[1])
    if len(sizes) == 1:
        return read(sizes[0])()
    return jax.lax.switch(branch, [read(n) for n in sizes])


class ReferenceAttention:
    """The jnp attention as a backend: ``prepare`` once per forward, call once per layer.
    Calling it with a raw mask (or None, causal) prepares on the spot. Reads only the
    bucket of each row's pages that holds the live length (see :func:`reach_buckets`)."""

    def prepare(self, cache: kvc.PagedKVCache, block_mask: jax.Array | None, q) -> Block:
        """``q``: the queries' shape and dtype ``[B, T, H, D]`` (an array or
        ShapeDtypeStruct)."""
        mask = full_mask(block_mask, cache.lengths.shape[0], q.shape[1])
        M = cache.page_table.shape[1]
        return Block(mask=mask, visible=visibility(cache.lengths, cache.max_len, mask),
                     table=kvc.read_table(cache),
                     reach=reach(cache.lengths, mask.shape[-1], cache.page_size, M))

    def __call__(self, q: jax.Array, cache: kvc.PagedKVCache, layer: int,
                 block_mask: jax.Array | Block | None = None) -> jax.Array:
        """``q: [B, T, H, D]`` -> ``[B, T, H, D]``. Scores, softmax and accumulation in fp32."""
        B, T, H, D = q.shape
        block = block_mask
        if not isinstance(block, Block) or block.visible is None:
            block = self.prepare(cache, block.mask if isinstance(block, Block) else block, q)
        KVH = cache.k_pages.shape[1]
        qg = q.reshape(B, T, KVH, H // KVH, D)
        o = _live_read(cache, layer, block.table, block.reach, lambda k, v, n: self.attend(
            qg, k, v, block.visible[:, None, None, :, :n], D))
        return o.reshape(B, T, H, D).astype(q.dtype)

    @staticmethod
    def attend(qg, k, v, visible, D):
        """``qg [B, T, KVH, G, D]`` over one segment ``k, v [B, KVH, S, D]`` with
        ``visible`` broadcastable to ``[B, 1, 1, T, S]`` -> fp32 ``[B, T, KVH, G, D]``."""
        return _softmax_attend(qg, [k], [v], [visible], D)


paged_attention_ref = ReferenceAttention()


def prepare(attention_fn, cache: kvc.PagedKVCache, block_mask: jax.Array | None, q):
    """What ``attention_fn`` wants every layer to get for queries shaped like ``q``: its
    prepared :class:`Block`, or the raw mask for a plain function without a ``prepare``."""
    prep = getattr(attention_fn, "prepare", None)
    return block_mask if prep is None else prep(cache, block_mask, q)


def windowed_attention_ref(q: jax.Array, cache: kvc.WindowedCache, layer: int,
                           block_mask: jax.Array) -> jax.Array:
    """Attention over a paged prefix (every committed position) and a dense window of
    transient slots (``block_mask [B, T, W]``), as a drafter's tree loop needs. The prefix
    is read up to the live length's bucket, as in :class:`ReferenceAttention`."""
    B, T, H, D = q.shape
    pre = cache.prefix
    KVH = pre.k_pages.shape[1]
    qg = q.reshape(B, T, KVH, H // KVH, D)
    kw = jnp.swapaxes(cache.k[layer], 1, 2)               # [B, KVH, W, D]
    vw = jnp.swapaxes(cache.v[layer], 1, 2)
    table = kvc.read_table(pre)

    def attend(k, v, n):
        prefix_vis = jnp.arange(n)[None, :] < pre.lengths[:, None]                # [B, n]
        return _softmax_attend(qg, [k, kw], [v, vw],
                               [prefix_vis[:, None, None, None], block_mask[:, None, None]], D)

    o = _live_read(pre, layer, table, reach(pre.lengths, 0, pre.page_size, table.shape[1]),
                   attend)
    return o.reshape(B, T, H, D).astype(q.dtype)


def window_lse(q: jax.Array, cache: kvc.WindowedCache, layer: int, block_mask: jax.Array):
    """Attention of ``q [B, T, H, D]`` over the dense window alone: ``(out, lse)``, fp32
    ``[B, T, H, D]`` and ``[B, T, H]``."""
    B, T, H, D = q.shape
    kw = jnp.swapaxes(cache.k[layer], 1, 2).astype(jnp.float32)          # [B, KVH, W, D]
    vw = jnp.swapaxes(cache.v[layer], 1, 2).astype(jnp.float32)
    KVH = kw.shape[1]
    qg = q.reshape(B, T, KVH, H // KVH, D).astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("btkgd,bksd->bkgts", qg, kw, precision=hi) * (D ** -0.5)
    vis = block_mask[:, None, None]
    s = jnp.where(vis, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)                                    # [B, KVH, G, T]
    p = jnp.where(vis, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bkgts,bksd->btkgd", p, vw, precision=hi)
    return o.reshape(B, T, H, D), lse.transpose(0, 3, 1, 2).reshape(B, T, H)


def merge_window(q, o_prefix, lse_prefix, cache: kvc.WindowedCache, layer, block_mask):
    """One softmax over the prefix and the window from each part's normalised output and
    log-sum-exp (the prefix's from a kernel that read the paged pool; -inf where a row has
    no prefix). Every query sees itself in the window, so the total is never empty."""
    o_w, lse_w = window_lse(q, cache, layer, block_mask)
    m = jnp.maximum(lse_prefix, lse_w)
    w_p, w_w = jnp.exp(lse_prefix - m)[..., None], jnp.exp(lse_w - m)[..., None]
    out = (o_prefix.astype(jnp.float32) * w_p + o_w * w_w) / (w_p + w_w)
    return out.astype(q.dtype)
