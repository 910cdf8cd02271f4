"""Which implementation runs attention and the verify walk.

``"auto"`` (the default of :func:`jspec.generate` and the CLI): the Pallas kernels on TPU
and GPU, the reference on CPU. :func:`resolve` turns it into a concrete mode on the host,
before any decoder is built (decoders only ever see concrete modes): on TPU/GPU it first
checks statically that the kernels can express the configuration (head dim, page size,
dtype, tree width, vocabulary; single device), then compiles the tree-attention kernel and
the verify walk once for the shapes in use (cached per shape key). A configuration the
kernels cannot express resolves to ``"reference"`` with an info log; a kernel that fails
to compile resolves to ``"reference"`` with a warning naming the error (logger ``"jspec"``).
An explicit ``"pallas"`` never falls back: it raises.

``"reference"``: the jnp references (XLA), everywhere. ``"pallas"``: the Pallas kernels for
the backend (Mosaic on TPU, Triton on GPU); on CPU there is no compiled Pallas, so asking for
it there is an error, not a silent fallback. ``"pallas_interpret"`` / ``"pallas_interpret_gpu"``:
the TPU (Mosaic) / GPU (Triton) kernels in Pallas interpret mode, on any backend (tests run
them on CPU this way).

The kernels need lane-friendly head dims (TPU: a multiple of 128; GPU: a power of two >= 16).
A smaller head dim (tiny test models) is zero-padded up to that width here, with the query
pre-scaled so the kernel's ``D_pad ** -0.5`` becomes the model's ``D ** -0.5``; that copies
the layer's page pool each call, which is fine for tests and never happens for real models.
Otherwise the kernels get the whole stacked pools ``[L, KVH, P, page_size, D]`` and the
(traced, inside the layer scan) layer index, and read the layer's pages in place: no
per-layer pool slice is materialised before the custom call.

Under a device mesh the decoders run inside a ``shard_map`` that is manual over ``data``
(:func:`jspec.sharding.per_data_shard`) and leave ``model`` to XLA's partitioner, which cannot
split a Mosaic or Triton custom call: each kernel call therefore runs inside a nested
``shard_map`` over ``model`` (:func:`per_device`), on the device's own KV heads (the pools'
KV-head axis is what ``model`` splits) with everything else replicated. That needs the KV
heads to divide over ``model``; where they do not, ``"auto"`` resolves to the reference.

The tree-attention kernel serves every block of at most 64 queries that is a square window
(plain decode, N = 1, and tree verification). Prefill blocks (longer prompts) and a
drafter's tree-loop window (K queries over S*K transient slots) are not what it is for:
those run the XLA attention, by design.
"""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jspec import kv_cache as kvc
from jspec.attention import (Block, full_mask, merge_window, paged_attention_ref,
                             windowed_attention_ref)
from jspec.platform import target_platform
from jspec.prefill_attention import ChunkRouted, PrefillAttention, problem
from jspec.sharding import heads_axis, model_split, per_device
from jspec.spec_config import MAX_TREE_NODES
from jspec.tree.build import pack_mask

log = logging.getLogger("jspec")

MODES = ("auto", "reference", "pallas", "pallas_interpret", "pallas_interpret_gpu")
CONCRETE = MODES[1:]   # what decoders see


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"kernels={mode!r}: choose one of {MODES}")
    if mode == "pallas" and default_backend() not in ("tpu", "gpu"):
        raise ValueError(f"kernels='pallas' needs a TPU or GPU (backend is "
                         f"{default_backend()!r}); use 'auto', 'pallas_interpret' or 'reference'")


def _backend(mode: str) -> str:
    if mode == "pallas":
        return default_backend()
    return "gpu" if mode == "pallas_interpret_gpu" else "tpu"


def _padded_head_dim(D: int, backend: str) -> int:
    if backend == "tpu":
        return -(-D // 128) * 128
    return max(16, 1 << (D - 1).bit_length())


def _concrete(mode: str) -> None:
    if mode not in CONCRETE:
        raise ValueError(f"kernels={mode!r} is not a concrete mode; call jspec.kernels.resolve "
                         f"first (concrete modes: {CONCRETE})")


class KernelAttention:
    """The Pallas tree-attention kernel as an attention backend (``prepare`` once per
    forward, call once per layer; see :mod:`jspec.attention`). Blocks the kernel is not
    for (see the module doc) are prepared for, and served by, the reference."""

    def __init__(self, mode: str):
        self.backend = _backend(mode)
        self.interpret = mode != "pallas"

    def prepare(self, cache, block_mask, q) -> Block:
        """``q``: the queries' shape and dtype ``[B, T, H, D]``."""
        from pallas_kernels.tree_attention.dispatch import row_inputs
        B, T, H, D = q.shape
        mask = full_mask(block_mask, B, T)
        if T > MAX_TREE_NODES or mask.shape[-1] != T:
            return paged_attention_ref.prepare(cache, mask, q)
        bits = pack_mask(mask)
        rows = None
        if _padded_head_dim(D, self.backend) == D:     # padded (tiny) models prepare per call
            m = model_split()                          # the shapes each device's kernel sees
            k = cache.k_pages
            kh = jax.ShapeDtypeStruct(k.shape[:-4] + (k.shape[-4] // m,) + k.shape[-3:], k.dtype)
            rows = row_inputs(jax.ShapeDtypeStruct((B, T, H // m, D), q.dtype), kh,
                              cache.page_table, bits, backend=self.backend,
                              interpret=self.interpret)
        return Block(mask=mask, mask_bits=bits, rows=rows)

    def writes_kv(self, cache, T: int) -> bool:
        """Whether a ``T``-token block's KV is written by the TPU kernel
        (:mod:`pallas_kernels.kv_write`) rather than XLA's scatter: on the TPU backend, where
        its ``validate`` accepts the block (at most 64 tokens: prefill keeps the scatter; a
        lane-wide head dim: tiny padded models keep it too; pages of whole sublane tiles)."""
        from pallas_kernels.kv_write import validate
        if self.backend != "tpu":
            return False
        KVH, D = cache.k_pages.shape[-4], cache.k_pages.shape[-1]
        rows = jax.ShapeDtypeStruct((1, KVH, 2 * T, D), cache.k_pages.dtype)
        try:
            validate(rows, cache.k_pages, cache.v_pages, T, 0, T)
        except ValueError:
            return False
        return True

    def write_kv(self, cache, layer, rows, T: int, k_row0: int, v_row0: int, slots):
        """Keys ``rows[:, :, k_row0 + t]`` and values ``rows[:, :, v_row0 + t]`` (``rows [B, KVH,
        R, D]``, already finite) of layer ``layer`` at flat ``slots [B*T]``
        (:func:`jspec.kv_cache.write_slots`)."""
        from pallas_kernels.kv_write import kv_write_tpu

        def write(rows, k, v, slots, layer):
            return kv_write_tpu(rows, k, v, slots, layer, T=T, k_row0=k_row0, v_row0=v_row0,
                                interpret=self.interpret)
        h = heads_axis(cache.k_pages.shape[-4])
        k, v = per_device(write, (rows, cache.k_pages, cache.v_pages, slots,
                                  jnp.asarray(layer, jnp.int32)),
                          (P(None, h), P(None, h), P(None, h), P(), P()), (P(None, h), P(None, h)))
        return cache.replace(k_pages=k, v_pages=v)

    def __call__(self, q, cache, layer, block_mask=None, grouped=None, return_lse=False):
        """``grouped``: ``q`` already grouped by KV head (the rows :meth:`write_kv` wrote
        from), used by the TPU kernel at lane-wide head dims. ``return_lse``: also each
        query's log-sum-exp ``[B, T, H]`` (see :meth:`windowed`)."""
        from pallas_kernels.tree_attention import tree_attention
        B, T, H, D = q.shape
        block = block_mask if isinstance(block_mask, Block) else self.prepare(cache, block_mask, q)
        if block.mask_bits is None:
            assert not return_lse, "the kernel serves every block that asks for its LSE"
            return paged_attention_ref(q, cache, layer, block)
        Dp = _padded_head_dim(D, self.backend)
        grouped = grouped if self.backend == "tpu" and Dp == D else None

        def attend(q, k, v, page_table, lengths, bits, layer, rows, grouped):
            # k, v: the stacked [L, KVH, P, ps, D] pools, no slice
            if Dp != D:
                # Tiny test models only: a padded copy of this layer's pools (slice + pad, one
                # fused copy of one layer; padding the whole stack would copy L layers per call).
                # q is scaled so that the scores (and their log-sum-exp) are unchanged.
                pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Dp - D)])
                q = pad(q * jnp.asarray((Dp / D) ** 0.5, q.dtype))
                k, v, layer = pad(k[layer])[None], pad(v[layer])[None], jnp.int32(0)
            out = tree_attention(q, k, v, page_table, lengths, bits, layer,
                                 backend=self.backend, interpret=self.interpret, prepared=rows,
                                 grouped=grouped, return_lse=return_lse)
            return (out[0][..., :D], out[1]) if return_lse else out[..., :D]
        h = heads_axis(cache.k_pages.shape[-4])
        return per_device(attend, (q, cache.k_pages, cache.v_pages, cache.page_table,
                                   cache.lengths, block.mask_bits, jnp.asarray(layer, jnp.int32),
                                   block.rows, grouped),
                          (P(None, None, h), P(None, h), P(None, h), P(), P(), P(), P(), P(),
                           P(None, h)),
                          (P(None, None, h), P(None, None, h)) if return_lse else P(None, None, h))

    def windowed(self, q, cache: kvc.WindowedCache, layer, block_mask):
        """A drafter's tree-loop attention (:func:`jspec.attention.windowed_attention_ref`'s
        contract) without gathering its pages: the kernel attends to the committed prefix
        straight from the paged pool (an all-zero tree mask: prefix only) and returns its
        log-sum-exp, which merges with the small dense window's (fp32). Under a mesh that
        splits ``model`` it keeps the reference: compiled for a v5e 2x4 slice (8B, batch 8,
        8k), the kernel path made an iteration move 14.9 GB per chip against 12.3 GB with
        the reference window (why is not yet found), while on one chip it saves 1.8 GB."""
        B, T = q.shape[:2]
        none = jnp.zeros((B, T, T), bool)
        if T > MAX_TREE_NODES or model_split() > 1:
            return windowed_attention_ref(q, cache, layer, block_mask)
        o, lse = self(q, cache.prefix, layer, Block(mask=none, mask_bits=pack_mask(none)),
                      return_lse=True)
        return merge_window(q, o, lse, cache, layer, block_mask)


def attention_fn(mode: str):
    """The attention backend of a concrete ``mode`` for :func:`jspec.llama.forward` and the
    drafters, like the reference, with a ``prepare`` run once per forward. A causal block
    longer than any tree (a drafter's prompt chunk) goes to :func:`prefill_attention_fn`'s."""
    _concrete(mode)
    main = paged_attention_ref if mode == "reference" else KernelAttention(mode)
    return ChunkRouted(main, MAX_TREE_NODES, lambda D, dtype, ps: _prefill(mode, D, dtype, ps))


def prefill_attention_fn(mode: str, config, page_size: int):
    """A prefill chunk's attention backend (:mod:`jspec.prefill_attention`) for a concrete
    ``mode``: jax's ragged paged attention on TPU, cuDNN's on GPU where they serve these
    shapes (else XLA's, the reason logged); ``"pallas_interpret_gpu"`` the GPU call with
    XLA's implementation; XLA's blocked online softmax for the other modes."""
    _concrete(mode)
    return _prefill(mode, config.head_dim, config.dtype, page_size)


def _prefill(mode: str, head_dim: int, dtype, page_size: int):
    if mode == "pallas_interpret_gpu":
        return PrefillAttention("dpa_xla")
    if mode != "pallas":
        return PrefillAttention("blocked")
    impl = {"tpu": "rpa", "gpu": "cudnn"}[_backend(mode)]
    why = problem(impl, head_dim=head_dim, dtype=dtype, page_size=page_size)
    if why:
        log.info("prefill attention: XLA's (%s)", why)
        return PrefillAttention("blocked")
    return PrefillAttention(impl)


def walk_impl(mode: str) -> str:
    _concrete(mode)
    return {"reference": "reference", "pallas": "auto", "pallas_interpret": "tpu_interpret",
            "pallas_interpret_gpu": "gpu_interpret"}[mode]


# --------------------------------------------------------------------------- resolution
def default_backend() -> str:
    """The platform programs are built for ("cpu", "gpu", "tpu"; see
    :func:`jspec.platform.target_platform`); a function so tests can fake it."""
    return target_platform()


def _shape_key(config, page_size, num_nodes, max_depth, greedy, batch, max_pages, num_pages):
    return (jnp.dtype(config.dtype).name, config.num_heads, config.num_kv_heads, config.head_dim,
            config.vocab_size, int(page_size), int(num_nodes),
            None if max_depth is None else int(max_depth), bool(greedy), int(batch),
            int(max_pages), int(num_pages))


def _abstract_args(key):
    """ShapeDtypeStructs of one attention call (q, one-layer cache, block mask) and of one
    verify walk for the shape key."""
    from jspec import kv_cache as kvc

    dtype, H, KVH, D, V, ps, N, S, greedy, B, max_pages, num_pages = key
    sds = jax.ShapeDtypeStruct
    table = np.full((B, max_pages), num_pages, np.int32)
    cache = jax.eval_shape(lambda: kvc.init_cache(1, KVH, D, table, num_pages, ps, dtype))
    q = sds((B, N, H, D), dtype)
    mask = sds((B, N, N), jnp.bool_)
    ints = sds((B, N), jnp.int32)
    walk = None
    if S is not None:
        walk = ((ints,) * 4 if greedy else
                (ints, ints, ints, sds((B, N, V), jnp.float32), sds((B, N), jnp.float32),
                 sds((B,), jnp.float32)))
    return q, cache, mask, walk


def static_problem(backend: str, key, pad_head_dim: bool) -> str | None:
    """Why the ``backend`` ("tpu" or "gpu") kernels cannot run this shape key (None when they
    can). The kernels' own static validation, reached by tracing (shapes only) the same calls
    the decoders make, through the interpret-mode variant for ``backend``. With
    ``pad_head_dim=False`` (what ``"auto"`` accepts) a head dim the kernel would pad is
    refused too: padding copies the layer's KV pages on every call."""
    from pallas_kernels.verify_walk import verify_walk_greedy, verify_walk_sample

    dtype, H, KVH, D, V, ps, N, S, greedy, B, max_pages, num_pages = key
    if N > MAX_TREE_NODES:
        return f"{N} tree nodes > {MAX_TREE_NODES}"
    Dp = _padded_head_dim(D, backend)
    if not pad_head_dim and Dp != D:
        return (f"head_dim {D} is not native to the {backend} kernel (it would be padded to "
                f"{Dp}, copying the layer's KV pages on every call)")
    mode = "pallas_interpret" if backend == "tpu" else "pallas_interpret_gpu"
    q, cache, mask, wargs = _abstract_args(key)
    attend = attention_fn(mode)
    try:
        jax.eval_shape(lambda q, c, m: attend(q, c, 0, m), q, cache, mask)
        if wargs is not None:
            fn = verify_walk_greedy if greedy else verify_walk_sample
            jax.eval_shape(lambda *a: fn(*a, max_depth=S, impl=walk_impl(mode)), *wargs)
    except ValueError as e:
        return str(e)
    return None


def probe(mode: str, key) -> None:
    """Compile (without running) the attention kernel and the verify walk of ``mode`` for the
    shape key; raises whatever the compiler raises."""
    q, cache, mask, wargs = _abstract_args(key)
    attend = attention_fn(mode)
    jax.jit(lambda q, c, m: attend(q, c, 0, m)).lower(q, cache, mask).compile()
    if wargs is not None:
        from pallas_kernels.verify_walk import verify_walk_greedy, verify_walk_sample
        S, greedy = key[7], key[8]
        fn = verify_walk_greedy if greedy else verify_walk_sample
        jax.jit(lambda *a: fn(*a, max_depth=S, impl=walk_impl(mode))).lower(*wargs).compile()


_PROBED: dict = {}          # (backend, shape key) -> None (compiled) or the error text
_PROBE_LOCK = threading.Lock()


def probes(forget: bool = False) -> dict:
    """``"auto"``'s compile probes so far, ``(backend, shape key)`` -> None (compiled) or the
    error text; ``forget``: drop them too (each shape probes again on its next resolve)."""
    with _PROBE_LOCK:
        out = dict(_PROBED)
        if forget:
            _PROBED.clear()
        return out


def resolve(mode: str, config, *, page_size: int = 16, num_nodes: int = 1,
            max_depth: int | None = None, greedy: bool = True, batch: int = 1,
            max_pages: int | None = None, num_pages: int | None = None, mesh=None) -> str:
    """The concrete mode (one of :data:`CONCRETE`) for ``mode`` on this host's backend.

    ``config``: the target's :class:`~jspec.config.LlamaConfig`; ``num_nodes``: the query
    block the kernel serves (1 for plain decoding, N for tree verification); ``max_depth``:
    the walk's S (None: no verify walk, plain decoding); ``greedy``: greedy or sampling walk;
    ``batch``, ``max_pages`` (page-table width), ``num_pages`` (pool size): the cache shape.

    ``mesh``: the shapes are those of one device (its data shard's rows, its model shard's
    heads); heads that do not divide over ``model`` cannot run the kernels.

    ``"auto"`` -> ``"reference"`` on CPU, or when the kernels cannot express the shapes
    (info log); otherwise the kernels are compiled once per
    shape key, and a compile error resolves to ``"reference"`` with a warning. ``"pallas"``
    and the interpret modes are checked the same way statically but raise ``ValueError``
    instead of falling back (interpret mode keeps its backend's tile limits).
    """
    check_mode(mode)
    if mode == "reference":
        return mode
    backend = default_backend() if mode == "auto" else _backend(mode)
    if mesh is not None and mesh.size > 1:
        # Each device's kernel sees its data shard's rows and its model shard's heads.
        model = mesh.shape.get("model", 1)
        if config.num_kv_heads % model or config.num_heads % model:
            why = (f"{config.num_kv_heads} KV heads / {config.num_heads} heads do not split "
                   f"over the mesh's 'model' axis of {model}")
            if mode != "auto":
                raise ValueError(f"kernels={mode!r} cannot run on this mesh: {why}")
            log.info("kernels='auto': reference (%s)", why)
            return "reference"
        config = config.replace(num_heads=config.num_heads // model,
                                num_kv_heads=config.num_kv_heads // model)
        batch = max(1, batch // mesh.shape.get("data", 1))
    if max_pages is None:
        max_pages = -(-(num_nodes + page_size) // page_size)
    if num_pages is None:
        num_pages = batch * max_pages
    key = _shape_key(config, page_size, num_nodes, max_depth, greedy, batch, max_pages, num_pages)
    if mode != "auto":
        # The kernels' static limits (tiles, node count), checked here so that a refusal comes
        # before anything compiles; interpret mode enforces the same limits as its backend.
        problem = static_problem(backend, key, pad_head_dim=True)
        if problem:
            raise ValueError(f"kernels={mode!r} cannot run this configuration on {backend}: "
                             f"{problem}")
        return mode
    if backend not in ("tpu", "gpu"):
        log.debug("kernels='auto' on %s: reference (no compiled Pallas kernels)", backend)
        return "reference"
    try:
        problem = static_problem(backend, key, pad_head_dim=False)
    except Exception as e:     # not a refusal but a failure to even trace: fall back, loudly
        log.warning("kernels='auto' on %s: tracing the Pallas kernels failed; falling back to "
                    "the reference. Error: %s: %s", backend, type(e).__name__, e)
        return "reference"
    if problem:
        log.info("kernels='auto' on %s: reference, the Pallas kernels cannot express this "
                 "configuration: %s", backend, problem)
        return "reference"
    with _PROBE_LOCK:
        if (backend, key) not in _PROBED:
            try:
                probe("pallas", key)
                _PROBED[backend, key] = None
            except Exception as e:     # any compiler failure: fall back, loudly
                _PROBED[backend, key] = f"{type(e).__name__}: {e}".strip()
                log.warning("kernels='auto' on %s: the Pallas kernels failed to compile for "
                            "%s head_dim %d, page_size %d, N %d, vocab %d; falling back to "
                            "the reference. Error: %s", backend, key[0], key[3], key[5], key[6],
                            key[4], _PROBED[backend, key][:2000])
        err = _PROBED[backend, key]
    return "reference" if err is not None else "pallas"
