"""Batch-invariant attention: a query's output is bit-identical whatever block it is in (a
1-token step, an N-node verify tree, a prefill chunk), whatever rows are beside it, and
whichever bucket of the cache is read (:func:`jspec.attention.reach_buckets`).

Why a target needs it: W8A8 (:mod:`jspec.quant`) rounds every activation to int8. The
reference attention sums in an order that moves with the shapes, a 1e-7 relative
difference between a 1-token step and an N-token verify, or two cache sizes; where an
activation sits near a rounding step its int8 value moves by one, and tokens follow
(stories260K: 0.006 in a hidden state after five layers from 1e-7 in the first). So
:func:`jspec.llama.forward` gives a target whose params quantize activations this backend
(:func:`for_params`), and with it every op before the float LM head is exact or the same
sum in the same order: a verify pass gives each token the keys, values and logits of its
1-token step, bit for bit (``tests/quant/test_batch_invariance.py``). The rest of that
forward was invariant already (int8 x int8 into int32 is exact) or was made so where it
was not: the norms' sum of squares (:func:`jspec.layers.sum_square`) and the activations'
scales (:func:`jspec.quant.qweight.quantize_rows`) go through :mod:`jspec.invariant_ops`.

How, from what XLA:CPU (jax 0.10.2) was measured to do:
- **No dots.** XLA picks a dot's kernel and blocking by shape (a matrix-vector product at
  T = 1, a GEMM at T = 8, the contraction split by its length), which changes the order of
  its sums. Scores and values are summed by two-operand reduces
  (:func:`jspec.invariant_ops.plain_sum`), which XLA emits as a loop over the summed axis,
  in index order, whatever the other axes are.
- **No library fusion.** A plain reduce goes to XLA:CPU's YNN fusion, which took the
  ``exp(s - m)`` after the softmax's max along at some shapes and not at others; YNN's
  ``exp`` differs from XLA's in the last bit. The two-operand reduces are not taken.
- **Keys past the last visible one add exact zeros**, so every bucket of the cache gives
  the same sums.
- **RoPE from a table** computed on the host (:func:`rope_tables`): XLA computes ``cos`` and
  ``sin`` inside whichever fusion takes them, and two fusions of one angle differed in the
  last bit.

Measured bit for bit with an unrolled layer stack (jspec's CPU default) for a forward
compiled on its own. Inside ``generate``'s speculative loop XLA:CPU's fusion emitters still
gave a verify row other bits than its 1-token step (SmolLM2 W8A8: equal through layer 4,
5e-7 apart after it, an int8 flip at layer 21, 0.12 in a logprob, greedy output parted at
token 7); with the legacy loop emitters every layer's input was bit-identical, so
every program over such a target compiles with them (:func:`compiler_options`: ``generate``
through :mod:`jspec.plan`, the serving engine and its prompt scorer through
:mod:`jspec.compiled`). A read of fewer than :data:`MIN_KEYS` keys summed in another order,
so every read takes at least that many (:meth:`InvariantAttention.prepare`). With a scanned
stack XLA fused the stack's last ops differently from one program to the next (0.03 in a
logit), so a W8A8 load says where it is exact
(:func:`jspec.checkpoint.quantize.warn_if_inexact`). On TPU and GPU none of this was
measured: programs for them keep the kernels (:func:`for_params`).

The cost is speed, no BLAS: per layer on SmolLM2's heads (3 KV heads x 3, D 64), 2.1x the
reference at batch 1 over 512 keys and 6x with an 8-node tree (1.0 against 0.55 ms, 5.7
against 0.95), measured before blocks of up to 64 queries read their keys compacted (a
gather of T x S keys and values; SmolLM2 W8A8 ``generate`` kept its rate against fp32). Only a target that needs it gets it, and the Pallas kernels are not used
under it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.attention import LIVE_MIN_PAGES, Block, ReferenceAttention, reach, reach_buckets
from jspec.invariant_ops import plain_max, plain_sum
from jspec.platform import target_platform
from jspec.quant import quantizes_activations

# The largest block whose queries each read their visible keys compacted: every 1-token step
# and verify (chain or tree), and a short prefill chunk; a longer one (a prefill chunk,
# causal, so compacting would move nothing) reads them where they are, as a gather of every
# query's keys would take T x S x D floats. Steps and verifies must take the same path: with
# verifies alone compacted, stories260K's plain steps left its speculative verifies by 0.05
# in a logprob.
MAX_COMPACT = 64


def compact_visible(k, v, visible):
    """Each query's visible keys and values moved to the front, in slot order: ``k, v [B,
    KVH, S, D]``, ``visible [B, 1, 1, T, S]`` -> ``[B, KVH, T, S, D]`` each and the
    visibility ``[B, 1, 1, T, S]`` of the compacted slots (the first ``n`` of a query that
    sees ``n`` keys). Why: XLA:CPU's sum over keys rounds by slot position (in lanes), not
    purely in order, and a tree node's ancestors sit at its verify block's slots, not where
    its 1-token step has them, after the path decoded in sequence (one bit in an 8-node tree,
    measured; SmolLM2 W8A8's tree speculation parted from plain decoding at token 8-57).
    Compacted, a node sees the prefix and then its path at consecutive slots, as its step
    does; a causal block's keys stay where they are."""
    B, T, S = visible.shape[0], visible.shape[3], k.shape[2]
    vis = jnp.broadcast_to(visible, (B, 1, 1, T, S)).reshape(B, T, S)
    rank = jnp.where(vis, jnp.cumsum(vis, -1, dtype=jnp.int32) - 1, S)    # S: dropped
    slot = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, T, S))
    b, t = jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None]
    idx = jnp.zeros((B, T, S), jnp.int32).at[b, t, rank].set(slot, mode="drop")
    take = lambda x: jnp.take_along_axis(x[:, :, None], idx[:, None, :, :, None], axis=3)
    count = jnp.sum(vis, -1, dtype=jnp.int32)
    return take(k), take(v), (jnp.arange(S)[None, None] < count[..., None])[:, None, None]


def invariant_attend(qg, k, v, visible, D):
    """:meth:`jspec.attention.ReferenceAttention.attend`'s contract: ``qg [B, T, KVH, G, D]``
    over ``k, v [B, KVH, S, D]`` with ``visible`` broadcastable to ``[B, 1, 1, T, S]`` ->
    fp32 ``[B, T, KVH, G, D]``. Every query sees at least itself."""
    T = qg.shape[1]
    if T <= MAX_COMPACT:
        k, v, visible = compact_visible(k, v, visible)                  # [B, KVH, T, S, D]
    else:
        k, v = k[:, :, None], v[:, :, None]                              # [B, KVH, 1, S, D]
    q = jnp.transpose(qg, (0, 2, 3, 1, 4)).astype(jnp.float32)           # [B, KVH, G, T, D]
    kt = jnp.swapaxes(k.astype(jnp.float32), 3, 4)                       # [B, KVH, T|1, D, S]
    # Summed over D with the keys minor: one loop per score, vectorized across keys.
    s = plain_sum(q[..., None] * kt[:, :, None], 4) * (D ** -0.5)        # [B, KVH, G, T, S]
    s = jnp.where(visible, s, -jnp.inf)
    e = jnp.where(visible, jnp.exp(s - plain_max(s, 4, keepdims=True)), 0.0)
    # Summed over keys from position 0: a key past the last visible one adds an exact zero,
    # so any bucket of the cache gives the same sums.
    out = plain_sum(e[..., None] * v.astype(jnp.float32)[:, :, None], 4)
    out = out / plain_sum(e, 4)[..., None]                               # [B, KVH, G, T, D]
    return jnp.transpose(out, (0, 3, 1, 2, 4))


def rope_tables(positions, inv_freq: np.ndarray, max_len: int):
    """:func:`jspec.rope.rope_tables`' ``(cos, signed sin)`` read from a table of every
    position below ``max_len`` computed on the host (numpy, float64 rounded to float32). XLA
    computes ``cos`` and ``sin`` inside whichever fusion takes them, and two fusions of one
    position's angle differed in the last bit (the test options' emitters); a table is the
    same numbers in every program. Positions past the table (padding) read its last row."""
    half = inv_freq.shape[0]
    angle = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None].astype(np.float32)
    emb = np.concatenate([angle, angle], -1).astype(np.float64)
    sign = np.r_[-np.ones(half), np.ones(half)]
    cos = jnp.asarray(np.cos(emb).astype(np.float32))
    sin = jnp.asarray((np.sin(emb) * sign).astype(np.float32))
    pos = jnp.minimum(positions, max_len - 1)
    take = lambda t: jnp.take(t, pos, axis=0)[:, :, None]    # [B, T, 1, D]
    return take(cos), take(sin)


# The fewest keys a query's sums run over. XLA:CPU sums a reduce over fewer keys in another
# order or fuses its exp otherwise (measured: a query's output over 32 to 112 keys differed
# in the last bit from its output over 128, 512 or 2048, which agree; a W8A8 prompt scored
# in a 32-key scratch cache parted from its decoding's logprobs by 0.03). Padding the keys
# inside the program does not give the 128-key bits (XLA fuses the pad), reading pages does.
# A read outside the live-length buckets' switch (a table of fewer than LIVE_MIN_PAGES
# pages) is fused with its neighbours otherwise too (SmolLM2 W8A8 scored in a 128-key cache:
# 0.46 from its decoding's logprobs), so small tables are widened to take the switch.
MIN_KEYS = 128


class InvariantAttention(ReferenceAttention):
    """The reference backend (its KV writes, its live-length buckets from
    :data:`MIN_KEYS` keys up) with :func:`invariant_attend` for the arithmetic, and the
    RoPE tables its queries and keys are rotated by (:func:`rope_tables`;
    :func:`jspec.llama.shared_inputs` asks for them)."""
    attend = staticmethod(invariant_attend)
    rope_tables = staticmethod(rope_tables)

    def prepare(self, cache, block_mask, q) -> Block:
        """The reference's block, reading at least :data:`MIN_KEYS` keys: a page table with
        fewer pages than that or than :data:`jspec.attention.LIVE_MIN_PAGES` is widened by
        pages of the pool whose slots are invisible, so that every read goes through the
        live-length buckets, and the bucket is never one of fewer keys."""
        block = super().prepare(cache, block_mask, q)
        M, ps = block.table.shape[1], cache.page_size
        need = max(-(-MIN_KEYS // ps), LIVE_MIN_PAGES)
        if M < need:
            block = block.replace(
                table=jnp.pad(block.table, ((0, 0), (0, need - M))),
                visible=jnp.pad(block.visible, ((0, 0), (0, 0), (0, (need - M) * ps))),
                reach=reach(cache.lengths, block.mask.shape[-1], ps, need))
        lo = next(i for i, n in enumerate(reach_buckets(max(M, need))) if n * ps >= MIN_KEYS)
        return block.replace(reach=jnp.maximum(block.reach, lo))


invariant_attention = InvariantAttention()


def for_params(packed, attention_fn):
    """``attention_fn``, or :data:`invariant_attention` when ``packed`` quantizes activations
    (their int8 rounding would turn attention's shape-dependent float rounding into
    different tokens) and the program is for a CPU, the one platform where it was measured
    batch-invariant. On TPU and GPU it would only cost: with no dots, an 8B W8A8 plan on the
    H200 moved 29.2 GB a plain step against the kernels' 17.3 (``bench plan --topology
    h200``), and its invariance there is unmeasured, which the load warning says
    (:func:`jspec.checkpoint.quantize.warn_if_inexact`)."""
    if quantizes_activations(packed) and target_platform() == "cpu":
        return invariant_attention
    return attention_fn


def compiler_options(params) -> dict | None:
    """XLA options for a program over ``params``: for a target that quantizes activations,
    compiled for a CPU, XLA:CPU's legacy loop emitters (``xla_cpu_use_fusion_emitters``
    off). With the fusion emitters, a verify row inside ``generate``'s speculative loop left
    its 1-token step (SmolLM2 W8A8: equal through layer 4, 5e-7 apart after it, an int8 flip
    at layer 21, 0.12 in a logprob, greedy output parted at token 7); with the legacy ones
    every layer's input was bit-identical (measured). None otherwise: XLA's defaults."""
    if quantizes_activations(params) and target_platform() == "cpu":
        return {"xla_cpu_use_fusion_emitters": False}
    return None
