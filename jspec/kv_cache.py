"""A functional paged KV cache.

Every layer's keys and values live in one pool of fixed-size pages; each batch row
owns a list of pages (its page table) and a length. All operations are pure
functions returning a new cache, so the cache threads through ``lax.while_loop``.

Layout ``[L, KVH, P, page_size, D]`` (layers, KV heads, pages, slots, head dim)
follows JAX's Pallas ``paged_attention`` op: one KV head's pages are contiguous,
which is what a kernel that streams a head's pages wants.

Pages are handed out on the host at admission (:func:`allocate_page_table`) from a
static budget; a request that does not fit is refused there with
:class:`KVCacheExhaustedError`, or (:func:`partial_page_table`) admitted with fewer pages
than some rows need, which then stop when theirs are full. Inside the compiled loop
nothing allocates: writes past a row's allocation are dropped (``mode='drop'``), never
redirected onto another row's page, and the decode loop stops a row before it reaches
that point.

Speculative decoding writes T candidate positions after ``lengths`` and later
keeps a subset of them (the accepted path): :func:`commit` moves that subset to
the front of the block, in order, and advances the length; the rest becomes
overshoot that later writes overwrite.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.platform import target_platform
from jspec.shapes import Float, Int


class KVCacheExhaustedError(RuntimeError):
    """A request needs more KV pages than the static budget has left."""


@struct.dataclass
class PagedKVCache:
    k_pages: Float["L KVH P page_size D"]
    v_pages: Float["L KVH P page_size D"]
    page_table: Int["B max_pages"]  # unallocated entries hold P (out of range)
    lengths: Int["B"]               # committed positions per row
    capacity: Int["B"]              # allocated slots per row (pages * page_size)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    @property
    def max_len(self) -> int:
        """Positions addressable by one row's page table."""
        return self.page_table.shape[1] * self.page_size


def pages_needed(num_tokens: int, page_size: int) -> int:
    return max(1, math.ceil(num_tokens / page_size))


def allocate_page_table(tokens_per_row, page_size: int, num_pages: int,
                        max_pages_per_row: int | None = None) -> np.ndarray:
    """Hand out pages for each row from a pool of ``num_pages``; host side, at admission.

    Raises :class:`KVCacheExhaustedError` naming the row that does not fit.
    """
    need = [pages_needed(int(n), page_size) for n in tokens_per_row]
    if max_pages_per_row is None:
        max_pages_per_row = max(need)
    table = np.full((len(need), max_pages_per_row), num_pages, np.int32)
    nxt = 0
    for row, n in enumerate(need):
        if n > max_pages_per_row:
            raise KVCacheExhaustedError(
                f"row {row} needs {n} pages of {page_size} slots ({tokens_per_row[row]} tokens) but "
                f"a row may hold at most {max_pages_per_row} pages")
        if nxt + n > num_pages:
            raise KVCacheExhaustedError(
                f"KV cache exhausted: row {row} needs {n} pages of {page_size} slots for "
                f"{tokens_per_row[row]} tokens, but only {num_pages - nxt} of {num_pages} pages are "
                f"free. Raise num_pages, lower max_new_tokens or the batch size.")
        table[row, :n] = np.arange(nxt, nxt + n, dtype=np.int32)
        nxt += n
    return table


def partial_page_table(min_tokens, tokens_per_row, page_size: int, num_pages: int,
                       max_pages_per_row: int | None = None) -> np.ndarray:
    """Partial admission, for a pool too small for every row's full need: every row first
    gets pages for its ``min_tokens``, then the pages left go to the rows in order, each up
    to its ``tokens_per_row``. A row given less than its need stops when its pages are full
    (the decode loop's ``cache_full``); its table marks the pages it lacks with ``num_pages``.

    Raises :class:`KVCacheExhaustedError`, naming the first row that does not fit, when the
    minimums alone exceed the pool.
    """
    low = [pages_needed(int(n), page_size) for n in min_tokens]
    want = [max(lo, pages_needed(int(n), page_size)) for lo, n in zip(low, tokens_per_row)]
    used = np.cumsum(low)
    if used[-1] > num_pages:
        row = int(np.argmax(used > num_pages))
        raise KVCacheExhaustedError(
            f"KV cache exhausted even for partial admission: row {row} needs at least {low[row]} "
            f"pages of {page_size} slots (its prompt and one iteration, {int(min_tokens[row])} "
            f"slots), but only {num_pages - int(used[row] - low[row])} of {num_pages} pages are "
            f"free. Raise num_pages or lower the batch size.")
    free = num_pages - int(used[-1])
    grant = []
    for lo, hi in zip(low, want):
        extra = min(hi - lo, free)
        free -= extra
        grant.append(lo + extra)
    return allocate_page_table([g * page_size for g in grant], page_size, num_pages,
                               max_pages_per_row)


def init_cache(num_layers: int, num_kv_heads: int, head_dim: int, page_table,
               num_pages: int, page_size: int, dtype=jnp.float32) -> PagedKVCache:
    page_table = jnp.asarray(page_table, jnp.int32)
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    capacity = jnp.sum(page_table < num_pages, axis=1, dtype=jnp.int32) * page_size
    return PagedKVCache(
        k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype),
        page_table=page_table, lengths=jnp.zeros(page_table.shape[:1], jnp.int32),
        capacity=capacity)


def _slots(cache: PagedKVCache, positions: jax.Array) -> jax.Array:
    """Flat slot index of absolute positions ``[B, T]``; out-of-allocation -> P*page_size."""
    ps = cache.page_size
    oob = cache.num_pages * ps
    page_idx = positions // ps
    in_table = (positions >= 0) & (page_idx < cache.page_table.shape[1])
    page = jnp.take_along_axis(cache.page_table, jnp.clip(page_idx, 0, cache.page_table.shape[1] - 1),
                               axis=1)
    slot = page * ps + positions % ps
    ok = in_table & (positions < cache.capacity[:, None]) & (page < cache.num_pages)
    return jnp.where(ok, slot, oob)


def _flat(pages: jax.Array) -> jax.Array:
    L, H, P, S, D = pages.shape
    return pages.reshape(L, H, P * S, D)


def write_slots(cache: PagedKVCache, T: int, valid: jax.Array | None = None,
                offset: jax.Array | int = 0) -> jax.Array:
    """``[B*T]`` flat slots of a ``T``-token block at positions ``lengths + offset + t``
    (``valid: [B, T]`` False, or outside the row's allocation: out of range, dropped)."""
    B = cache.lengths.shape[0]
    pos = cache.lengths[:, None] + offset + jnp.arange(T, dtype=jnp.int32)[None]
    slots = _slots(cache, pos)
    if valid is not None:
        slots = jnp.where(valid, slots, cache.num_pages * cache.page_size)
    return slots.reshape(B * T)


def _per_row() -> bool:
    # TPU/GPU: the write scatters one contiguous [D] row per (head, slot). With the heads in
    # the window ([KVH, D], not adjacent in [L, KVH, P*S, D]) XLA:TPU relaid the whole pool out
    # and back around every layer's write (deviceless v5p compile, 8B shape).
    # CPU: one [KVH, D] window per slot, written in place; it ran a 100M plain decode step 9%
    # faster (30.4 vs 33.1 ms/token, interleaved A/B).
    return target_platform() != "cpu"


def write_index(cache: PagedKVCache, T: int, valid: jax.Array | None = None,
                offset: jax.Array | int = 0) -> jax.Array:
    """The layer-independent part of a block's KV scatter indices (see :func:`write_layer`),
    which a forward computes once, outside its layer loop: ``[B*T, 1]`` slots on CPU;
    on TPU/GPU ``[B, KVH, T, 2]`` (head, slot) pairs: (row, head, position) is how a
    projection's output is laid out there, so the updates need no transpose, and the head
    axis stays its own dimension, which a mesh shards (flattened with the others, it made
    the partitioner replicate every layer's updates: 420 MB more temporaries per device for
    an 8B prefill on a (2, 4) mesh)."""
    slots = write_slots(cache, T, valid, offset)
    if not _per_row():
        return slots[:, None]
    B, KVH = cache.lengths.shape[0], cache.k_pages.shape[1]
    slots = jnp.broadcast_to(slots.reshape(B, 1, T), (B, KVH, T))
    heads = jnp.broadcast_to(jnp.arange(KVH, dtype=jnp.int32)[None, :, None], (B, KVH, T))
    return jnp.stack([heads, slots], -1)


def layer_index(index: jax.Array, layer) -> jax.Array:
    """:func:`write_index` ``index`` with the ``layer`` column in front: what
    :func:`write_layer` scatters by. A scanned forward builds it for every layer before its
    loop (built in the loop body, the column cost a TPU layer five scalar and index kernels)."""
    return jnp.concatenate([jnp.full(index.shape[:-1] + (1,), layer, jnp.int32), index], -1)


def finite_or_zero(x: jax.Array) -> jax.Array:
    """A NaN or inf key/value is stored as 0: attention weighs masked slots by exactly 0,
    and 0 x NaN would still poison every query of the block (a rejected draft's NaN would
    end the whole verify). The node itself keeps its non-finite hidden state, so its logits
    still stop the row (jspec.decode.finite_rows)."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def write_layer(cache: PagedKVCache, layer: int, k: jax.Array, v: jax.Array,
                valid: jax.Array | None = None, offset: jax.Array | int = 0,
                index: jax.Array | None = None, layer_idx: jax.Array | None = None,
                guarded: bool = False) -> PagedKVCache:
    """Write ``k, v: [B, T, KVH, D]`` of one layer at positions ``lengths + offset + t``.

    ``valid: [B, T]`` masks positions that must not be written (ragged blocks).
    ``offset`` places a block further into the uncommitted region (a drafter's tree
    loop writes step s at ``s * K``). ``index``: :func:`write_index` of the same block,
    computed once outside a layer loop (then ``valid`` and ``offset`` are not used);
    ``layer_idx``: :func:`layer_index` of it for ``layer``, when built before the loop.
    ``guarded``: the caller already applied :func:`finite_or_zero`.
    Does not change ``lengths``.

    One ``lax.scatter`` per pool, over ``[L, KVH, P*S, D]``. TPU/GPU: one contiguous ``[D]``
    row per (layer, head, slot); the KV-head axis stays its own dimension, which a mesh
    shards (a view merging it with the others made the partitioner all-gather the whole
    pool in every layer). CPU: one ``[KVH, D]`` window per (layer, slot).
    """
    B, T = k.shape[:2]
    if layer_idx is None:
        if index is None:
            index = write_index(cache, T, valid, offset)
        layer_idx = layer_index(index, layer)
    shape = cache.k_pages.shape
    if _per_row():      # idx [B, KVH, T, 3] -> one [D] row each; updates [B, KVH, T, D]
        dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(3,),
                                             inserted_window_dims=(0, 1, 2),
                                             scatter_dims_to_operand_dims=(0, 1, 2))
        arrange = lambda x: x.swapaxes(1, 2)
    else:               # idx [B*T, 2] -> one [KVH, D] window each; updates [B*T, KVH, D]
        dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2),
                                             inserted_window_dims=(0, 2),
                                             scatter_dims_to_operand_dims=(0, 2))
        arrange = lambda x: x.reshape(B * T, *x.shape[2:])

    idx = layer_idx
    single = math.prod(idx.shape[:-1]) == 1
    if single:
        # One update: XLA rewrites such a scatter as a dynamic-update-slice under a select
        # of the whole pool (its drop-if-out-of-range), a copy of the pool per layer. A second,
        # out-of-range (dropped) update keeps it a scatter, in place: a 32-slot engine's
        # one-row plain step ran 5x slower without (the pool copies dominated).
        oob = jnp.zeros_like(idx[:1]).at[..., -1].set(_flat(cache.k_pages).shape[2])  # slot
        idx = jnp.concatenate([idx, oob], 0)

    def put(pages, x):
        x = arrange(x if guarded else finite_or_zero(x)).astype(pages.dtype)
        if single:
            x = jnp.concatenate([x, jnp.zeros_like(x)], 0)
        flat = jax.lax.scatter(_flat(pages), idx, x, dn,
                               mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
        return flat.reshape(shape)

    return cache.replace(k_pages=put(cache.k_pages, k), v_pages=put(cache.v_pages, v))


def read_table(cache: PagedKVCache) -> jax.Array:
    """The page table with unallocated entries clamped into the pool (their slots are
    garbage the callers mask): what :func:`read_layer` gathers by, layer-independent."""
    return jnp.clip(cache.page_table, 0, cache.num_pages - 1)


def gather_pages(pool: jax.Array, layer, table: jax.Array, heads_first: bool = True):
    """The pages ``table [B, M]`` (clamped into the pool) of layer ``layer`` of a stacked
    pool ``[L, KVH, P, page_size, D]``, in one gather: ``[B, KVH, M, page_size, D]``, or
    ``[B, M, KVH, page_size, D]`` with ``heads_first=False``."""
    B, M = table.shape
    _, KVH, _, S, D = pool.shape
    idx = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (B, M)), table], -1)
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(1, 3, 4) if heads_first else (2, 3, 4),
                                        collapsed_slice_dims=(0, 2), start_index_map=(0, 2))
    return jax.lax.gather(pool, idx, dn, (1, KVH, 1, S, D),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def read_layer(cache: PagedKVCache, layer: int,
               table: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """All of a row's addressable slots for one layer: ``[B, KVH, max_len, D]`` each.
    ``table``: :func:`read_table`, when a forward computed it once for all layers.

    Slots past ``lengths`` (or never allocated) hold garbage; callers mask them. One gather
    per pool, by (layer, page), straight into ``[B, KVH, pages, page_size, D]`` order.
    """
    if table is None:
        table = read_table(cache)
    B, M = table.shape
    _, KVH, _, S, D = cache.k_pages.shape
    get = lambda pool: gather_pages(pool, layer, table).reshape(B, KVH, M * S, D)
    return get(cache.k_pages), get(cache.v_pages)


@struct.dataclass
class WindowedCache:
    """A paged cache read as a fixed prefix, plus a small dense window of transient slots.

    A drafter's tree loop writes K candidates per step past the committed length and
    throws them away afterwards. Writing them into the page pool would make the loop
    carry (and XLA copy) the whole pool, because the pool before the loop is still
    needed; here the pool is only read and the loop carries ``[L, B, W, KVH, D]``.
    Window slot ``w`` stands for position ``prefix.lengths + w``.
    """
    prefix: PagedKVCache
    k: Float["L B W KVH D"]
    v: Float["L B W KVH D"]

    @classmethod
    def empty(cls, prefix: PagedKVCache, width: int) -> "WindowedCache":
        L, KVH, _, _, D = prefix.k_pages.shape
        shape = (L, prefix.lengths.shape[0], width, KVH, D)
        z = jnp.zeros(shape, prefix.k_pages.dtype)
        return cls(prefix=prefix, k=z, v=z)

    def write(self, layer: int, k: jax.Array, v: jax.Array, offset) -> "WindowedCache":
        """``k, v: [B, T, KVH, D]`` into window slots ``offset .. offset + T - 1``."""
        at = (layer, 0, offset, 0, 0)
        put = lambda buf, x: jax.lax.dynamic_update_slice(buf, x[None].astype(buf.dtype), at)
        return self.replace(k=put(self.k, k), v=put(self.v, v))


def advance(cache: PagedKVCache, n: jax.Array) -> PagedKVCache:
    return cache.replace(lengths=cache.lengths + jnp.asarray(n, jnp.int32))


def commit(cache: PagedKVCache, keep: jax.Array, num_keep: jax.Array) -> PagedKVCache:
    """Keep a subset of the block written after ``lengths`` and advance past it.

    ``keep: [B, A]`` are offsets into that block (ascending along the accepted path),
    ``num_keep: [B]`` how many of them are real. Slot ``lengths + keep[j]`` moves to
    ``lengths + j`` for ``j < num_keep`` in every layer; then ``lengths += num_keep``.
    All sources are read before any destination is written, so overlapping moves are safe.
    """
    A = keep.shape[1]
    j = jnp.arange(A, dtype=jnp.int32)[None]
    src = _slots(cache, cache.lengths[:, None] + keep.astype(jnp.int32))
    dst = _slots(cache, cache.lengths[:, None] + j)
    dst = jnp.where(j < num_keep[:, None], dst, cache.num_pages * cache.page_size)
    src, dst = src.reshape(-1), dst.reshape(-1)
    shape = cache.k_pages.shape

    L, KVH = shape[:2]
    lyr = jnp.arange(L, dtype=jnp.int32)[:, None, None]
    heads = jnp.arange(KVH, dtype=jnp.int32)[None, :, None]

    def move(pages):
        flat = _flat(pages)
        # Gather and scatter both index (layer, head, slot): a contiguous [D] window each, as in
        # write_layer (a [L, KVH, 1, D] window made XLA:TPU copy the whole pool, 8B on v5p).
        vals = flat.at[lyr, heads, src[None, None]].get(mode="clip")   # [L, KVH, B*A, D]
        # The moved rows materialised first: XLA:GPU fused the gather into the scatter, which
        # then read the pool it wrote, so it copied both whole pools every iteration (8B,
        # deviceless H200 compile: 4 pool copies, 17.5 GB).
        vals = jax.lax.optimization_barrier(vals)
        return flat.at[lyr, heads, dst[None, None]].set(vals, mode="drop").reshape(shape)

    return cache.replace(k_pages=move(cache.k_pages), v_pages=move(cache.v_pages),
                         lengths=cache.lengths + num_keep.astype(jnp.int32))
