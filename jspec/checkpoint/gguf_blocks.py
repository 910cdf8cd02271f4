"""A GGUF's quantized blocks kept quantized (``load_target(path, quantize="int8"|"w8a8")``).

Q8_0 (a float16 scale and 32 int8 values a block) *is* an int8 :class:`qwix.QArray` with one
scale per 32 inputs: the values and scales are taken from the file's bytes as they are, with
no round trip through float. Q4_0 (a float16 scale and 32 4-bit values, ``d * (q - 8)``) is
the same with values in [-8, 7]; they are held as int8 (one byte a weight: XLA:CPU has no
packed 4-bit product, so int4 storage would be unpacked before every product anyway).
Q4_1 (``d * q + m``) is *not* a QArray: qwix's zero point is an integer of the values' type,
and ``-m / d`` is not an integer. Its tensors, and any other type, are dequantized by the
``gguf`` package and quantized again to int8 over the same 32-input blocks.

Block weights cannot take the RMSNorm scale folded in (that would change every value of a
block), so the packed q/k/v and gate/up carry it as their ``in_scale``
(:class:`jspec.quant.qweight.QWeight`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from jspec.checkpoint.common import CheckpointError, to_param
from jspec.checkpoint.gguf import checked_tensors, dequantize, open_target, unpermute_qk
from jspec.config import LlamaConfig
from jspec.quant.config import QuantConfig
from jspec.quant.qweight import QWeight

BLOCK = 32
# GGML type -> (bytes a block, the block's int8 values from its raw bytes).
KEPT = {
    "Q8_0": (34, lambda raw: raw[:, 2:].view(np.int8)),
    "Q4_0": (18, lambda raw: np.concatenate([(raw[:, 2:] & 0x0F), (raw[:, 2:] >> 4)], axis=1)
             .astype(np.int8) - 8),
}


def kept_type(tensor) -> str | None:
    name = tensor.tensor_type.name
    return name if name in KEPT else None


def block_arrays(reader, tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(values int8 [out, in], scales float32 [out, in / 32])``: a Q8_0 / Q4_0 tensor's
    blocks as they are in the file, or any other type dequantized and quantized to int8
    per 32 inputs (absmax)."""
    out, k = (int(d) for d in reversed(tensor.shape.tolist()))
    kind = kept_type(tensor)
    if kind is None:
        w = dequantize(reader, tensor)
        q = qwix.quantize(jnp.asarray(w), jnp.int8, channelwise_axes=(0,),
                          tiled_axes={1: BLOCK}, scale_dtype=jnp.float32)
        return np.asarray(q.qvalue), np.asarray(q.scale)
    size, values = KEPT[kind]
    raw = np.asarray(tensor.data).view(np.uint8).reshape(out * k // BLOCK, size)
    scale = raw[:, :2].copy().view(np.float16).astype(np.float32).reshape(out, k // BLOCK)
    return values(raw).reshape(out, k), scale


def _qarray(values, scale, dtype) -> qwix.QArray:
    return qwix.QArray(jnp.asarray(values), jnp.asarray(scale).astype(dtype), None, jnp.int8)


def _rows(reader, tensors, name, perm=None, n_heads=0):
    t = tensors.get(name)
    if t is None:
        raise CheckpointError(f"{reader.path}: missing tensor {name!r}")
    q, s = block_arrays(reader, t)
    if q.shape[1] % BLOCK:
        raise CheckpointError(f"{reader.path}: {name!r} has {q.shape[1]} inputs, not a "
                              f"multiple of the {BLOCK}-weight block")
    if perm:
        q, s = unpermute_qk(q, n_heads), unpermute_qk(s, n_heads)
    return q, s


def _layer(reader, tensors, cfg: LlamaConfig, i: int, act):
    c, dt = cfg, jnp.dtype(cfg.dtype)
    KVH, D, G = c.num_kv_heads, c.head_dim, c.num_heads // c.num_kv_heads
    get = lambda n, *a: _rows(reader, tensors, f"blk.{i}.{n}.weight", *a)
    norm = lambda n: to_param(dequantize(reader, tensors[f"blk.{i}.{n}.weight"]), "float32")
    (q, qs), (k, ks), (v, vs) = get("attn_q", "q", c.num_heads), get("attn_k", "k", KVH), get("attn_v")
    group = lambda a, g: a.reshape(KVH, g, D, a.shape[-1])
    qkv = [np.concatenate([group(q_, G), group(k_, 1), group(v_, 1)], axis=1)
           for q_, k_, v_ in ((q, k, v), (qs, ks, vs))]                  # [KVH, G+2, D, H(/32)]
    (g, gs), (u, us) = get("ffn_gate"), get("ffn_up")
    o, d = get("attn_output"), get("ffn_down")
    return {
        "qkv": QWeight(_qarray(*qkv, dt), norm("attn_norm"), act),
        "o": QWeight(_qarray(*o, dt), None, act),
        "gate_up": QWeight(_qarray(np.stack([g, u]), np.stack([gs, us]), dt),
                           norm("ffn_norm"), act),
        "down": QWeight(_qarray(*d, dt), None, act),
    }


def gguf_packed_blocks(reader, cfg: LlamaConfig, qc: QuantConfig, stacked: bool,
                       progress=None) -> dict:
    """Packed serving params (:mod:`jspec.serving_layout`) whose layer projections are the
    file's int8 blocks; the embedding, final norm and LM head are dequantized to
    ``cfg.dtype`` (kept in float, as :mod:`jspec.quant` keeps them)."""
    from jspec.quant.pack import quantize_weight

    tensors = {t.name: t for t in reader.tensors}
    act = "int8" if qc.activations else None
    steps = range(cfg.num_layers)
    layers = tuple(_layer(reader, tensors, cfg, i, act) for i in (progress(steps, total=len(steps))
                                                                   if progress else steps))
    if stacked:
        layers = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
    packed = {"embed": to_param(dequantize(reader, tensors["token_embd.weight"]), cfg.dtype),
              "norm": to_param(dequantize(reader, tensors["output_norm.weight"]), cfg.dtype),
              "layers": layers}
    if not cfg.tie_word_embeddings:
        packed["lm_head"] = to_param(dequantize(reader, tensors["output.weight"]), cfg.dtype)
    if qc.lm_head:
        head = packed.get("lm_head", packed["embed"])
        packed["lm_head"] = quantize_weight(head, qc, jnp.dtype(cfg.dtype))
    return packed


def keeps_blocks(qc: QuantConfig | None) -> bool:
    """Whether ``qc`` takes a GGUF's int8 blocks as they are (int8 modes, GGUF's 32-input
    blocks or no tile asked)."""
    return qc is not None and qc.mode in ("int8", "w8a8") and qc.tile in (None, 32)


def load_gguf_blocks(path, qc: QuantConfig, dtype=None, progress=None, mesh=None):
    """A GGUF target whose layer projections are the file's blocks (see the module doc)."""
    from jspec.checkpoint.quantize import place_packed, warn_if_inexact
    from jspec.serving_layout import default_stacked
    from jspec.target import Target

    warn_if_inexact(qc)
    reader, cfg, tok = open_target(path, dtype)
    checked_tensors(reader, cfg)
    packed = gguf_packed_blocks(reader, cfg, qc, default_stacked(), progress)
    return Target(cfg, place_packed(packed, mesh), tok)
