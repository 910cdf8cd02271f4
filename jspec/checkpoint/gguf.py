"""GGUF files (llama.cpp's format): a Llama target, its tokenizer and its chat template.

Parsing and dequantization are the ``gguf`` package's (llama.cpp's own reader): every tensor
type :func:`gguf.quants.dequantize` knows loads, dequantized to float32 on the host and then
cast to the target dtype. The mapping to jspec's parameters is one table, as for HF.

Two facts of the format that bite:

* Shapes are listed in GGML order (fastest dimension first); the reader hands back numpy
  arrays in row-major order, which for a linear layer is HF's ``[out, in]``.
* llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` from HF's rotate-half
  RoPE layout to its interleaved one (per head: for Q the query heads, for K the KV heads).
  :func:`unpermute_qk` undoes it; forgetting it gives wrong logits and no error.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jspec.checkpoint.common import (CheckpointError, Progress, check_shape, expected_shapes,
                                     no_progress, to_param, unflatten, with_dtype)
from jspec.checkpoint.gguf_meta import field
from jspec.config import ConfigError, LlamaConfig, RopeConfig
from jspec.target import Target

GGUF_MAGIC = b"GGUF"

# (GGUF tensor name, flax param path, transpose, unpermute: None | "q" | "k").
GGUF_GLOBAL = (
    ("token_embd.weight", "embed_tokens/embedding", False, None),
    ("output_norm.weight", "norm/scale", False, None),
)
GGUF_UNTIED = (("output.weight", "lm_head/kernel", True, None),)
GGUF_LAYER = (
    ("blk.{i}.attn_norm.weight", "layers_{i}/input_layernorm/scale", False, None),
    ("blk.{i}.attn_q.weight", "layers_{i}/self_attn/q_proj/kernel", True, "q"),
    ("blk.{i}.attn_k.weight", "layers_{i}/self_attn/k_proj/kernel", True, "k"),
    ("blk.{i}.attn_v.weight", "layers_{i}/self_attn/v_proj/kernel", True, None),
    ("blk.{i}.attn_output.weight", "layers_{i}/self_attn/o_proj/kernel", True, None),
    ("blk.{i}.ffn_norm.weight", "layers_{i}/post_attention_layernorm/scale", False, None),
    ("blk.{i}.ffn_gate.weight", "layers_{i}/mlp/gate_proj/kernel", True, None),
    ("blk.{i}.ffn_up.weight", "layers_{i}/mlp/up_proj/kernel", True, None),
    ("blk.{i}.ffn_down.weight", "layers_{i}/mlp/down_proj/kernel", True, None),
)
# Tensors a llama GGUF may carry that jspec computes itself (precomputed RoPE tables).
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Present in architectures jspec does not run; named in the error.
_FOREIGN_SUFFIXES = (".bias", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate_inp.weight",
                     "ffn_gate_exps.weight")


def is_gguf(path: str | os.PathLike) -> bool:
    """A regular file starting with GGUF's magic (the extension is not trusted)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str | os.PathLike):
    """A :class:`gguf.GGUFReader` over ``path``; a damaged file is a :class:`CheckpointError`
    that names the file and what is wrong (truncated, unknown tensor type, not GGUF)."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such file")
    with open(p, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise CheckpointError(f"{p}: not a GGUF file (starts with {head!r}, not {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(p, "r")
    except ValueError as e:
        msg = str(e)
        if "is not a valid GGMLQuantizationType" in msg:
            raise CheckpointError(f"{p}: a tensor has an unknown GGML type ({msg}); this "
                                  f"gguf package ({gguf.__name__} "
                                  f"{_version()}) cannot read it") from e
        raise CheckpointError(f"{p}: cannot parse GGUF ({_truncation(p) or msg})") from e
    except (IndexError, OverflowError, MemoryError, TypeError) as e:
        raise CheckpointError(f"{p}: cannot parse GGUF ({_truncation(p) or e})") from e
    reader.path = p      # for the errors below, which name the file
    _check_extent(p, reader)
    return reader


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"


def _truncation(p: Path) -> str | None:
    return f"truncated: the file is only {p.stat().st_size} bytes"


def _check_extent(p: Path, reader) -> None:
    """numpy's memmap silently yields short views past the end of a truncated file: check that
    every tensor's bytes lie inside it."""
    size = p.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise CheckpointError(
                f"{p}: truncated: tensor {t.name!r} needs bytes up to {end}, the file has {size}")


def gguf_config(reader, dtype=None) -> LlamaConfig:
    """The :class:`LlamaConfig` a GGUF's ``llama.*`` metadata describes."""
    arch = field(reader, "general.architecture", required=True)
    if arch != "llama":
        raise CheckpointError(f"{reader.path}: general.architecture={arch!r}: jspec runs "
                              "'llama' targets only (Llama 2/3, SmolLM, TinyLlama, ...)")
    names = {t.name for t in reader.tensors}
    foreign = sorted(n for n in names if n.endswith(_FOREIGN_SUFFIXES))
    if foreign:
        raise CheckpointError(f"{reader.path}: tensor {foreign[0]!r}: biases, QK norms and "
                              "mixtures of experts are not in jspec's Llama")
    k = lambda name, **kw: field(reader, f"llama.{name}", **kw)
    hidden = k("embedding_length", required=True)
    heads = k("attention.head_count", required=True)
    kv_heads = k("attention.head_count_kv", default=heads)
    head_dim = k("attention.key_length", default=None) or hidden // heads
    rope_dim = k("rope.dimension_count", default=head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(f"{reader.path}: llama.rope.dimension_count={rope_dim} is not the "
                              f"head dim {head_dim}; partial rotary embeddings are not supported")
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = k("vocab_size", default=None) or (len(tokens) if tokens is not None else None)
    if vocab is None:
        vocab = _tensor_shape(reader, "token_embd.weight")[0]
    eos = [field(reader, "tokenizer.ggml.eos_token_id")]
    eos.append(field(reader, "tokenizer.ggml.eot_token_id"))
    eos = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
    try:
        cfg = LlamaConfig(
            vocab_size=int(vocab), hidden_size=int(hidden),
            intermediate_size=int(k("feed_forward_length", required=True)),
            num_layers=int(k("block_count", required=True)), num_heads=int(heads),
            num_kv_heads=int(kv_heads), head_dim=int(head_dim),
            rms_norm_eps=_f32(k("attention.layer_norm_rms_epsilon", default=1e-5)),
            rope=_rope(reader), tie_word_embeddings="output.weight" not in names,
            max_position_embeddings=int(k("context_length", default=8192)),
            bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"), eos_token_ids=eos)
    except ConfigError as e:
        raise CheckpointError(f"{reader.path}: {e}") from e
    return with_dtype(cfg, dtype)


def _rope(reader) -> RopeConfig:
    k = lambda name, default=None: field(reader, f"llama.rope.{name}", default)
    theta = _f32(k("freq_base", 10000.0))
    kind = k("scaling.type", "none")
    if kind in (None, "none"):
        # Llama-3.1 files often say nothing here and store the scaled frequencies as
        # rope_freqs.weight; without the parameters jspec cannot rebuild them, so refuse.
        if any(t.name == "rope_freqs.weight" for t in reader.tensors):
            raise CheckpointError(f"{reader.path}: carries rope_freqs.weight (precomputed "
                                  "Llama-3.1 RoPE factors) without llama.rope.scaling.* fields")
        return RopeConfig(theta=theta)
    if kind != "llama3":
        raise CheckpointError(f"{reader.path}: llama.rope.scaling.type={kind!r}: jspec "
                              "implements no scaling and 'llama3'")
    return RopeConfig(
        theta=theta, rope_type="llama3", factor=float(k("scaling.factor", 8.0)),
        low_freq_factor=float(k("scaling.low_freq_factor", 1.0)),
        high_freq_factor=float(k("scaling.high_freq_factor", 4.0)),
        original_max_position_embeddings=int(k("scaling.original_context_length", 8192)))


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): the shortest repr that rounds to the same float32."""
    return float(str(np.float32(x)))


def _tensor_shape(reader, name: str) -> tuple[int, ...]:
    for t in reader.tensors:
        if t.name == name:
            return tuple(int(d) for d in reversed(t.shape.tolist()))
    raise CheckpointError(f"{reader.path}: no tensor {name!r}")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection (``[heads * head_dim, in]``):
    per head it interleaved the two rotate-half halves; this puts them back."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (what its converter does); the inverse of :func:`unpermute_qk`."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(reader, tensor) -> np.ndarray:
    """One tensor as float32 in row-major (HF) shape, whatever its GGML type."""
    import gguf

    qtype = tensor.tensor_type
    try:
        if qtype == gguf.GGMLQuantizationType.BF16 and tensor.data.dtype != np.uint8:
            arr = gguf.quants.dequantize(tensor.data.view(np.uint8), qtype)
        else:
            arr = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise CheckpointError(f"{reader.path}: tensor {tensor.name!r} has type {qtype.name}, "
                              f"which gguf {_version()} cannot dequantize") from e
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def gguf_table(cfg: LlamaConfig):
    rows = list(GGUF_GLOBAL) + ([] if cfg.tie_word_embeddings else list(GGUF_UNTIED))
    out = [(n, tuple(p.split("/")), t, u) for n, p, t, u in rows]
    for i in range(cfg.num_layers):
        out += [(n.format(i=i), tuple(p.format(i=i).split("/")), t, u)
                for n, p, t, u in GGUF_LAYER]
    return out


def checked_tensors(reader, cfg: LlamaConfig) -> dict:
    """The file's tensors by name, once every one the config needs is there with its shape
    and nothing is left over that jspec's Llama has no place for."""
    tensors = {t.name: t for t in reader.tensors}
    shapes = expected_shapes(cfg)
    table = gguf_table(cfg)
    wanted = {name for name, *_ in table}
    extra = sorted(set(tensors) - wanted - set(_IGNORED))
    if extra:
        raise CheckpointError(f"{reader.path}: tensors jspec's Llama has no place for: {extra[:5]}")
    for name, path, transpose, _ in table:
        if name not in tensors:
            raise CheckpointError(f"{reader.path}: missing tensor {name!r}")
        want = tuple(reversed(shapes[path])) if transpose else shapes[path]
        got = tuple(int(d) for d in reversed(tensors[name].shape.tolist()))
        check_shape(name, want, got)
    return tensors


def gguf_params(reader, cfg: LlamaConfig, progress: Progress | None = None):
    """Flax params from a GGUF's tensors, each checked against the config's shape before the
    next is dequantized."""
    tensors = checked_tensors(reader, cfg)
    flat = {}
    table = gguf_table(cfg)
    for name, path, transpose, perm in (progress or no_progress)(table, total=len(table)):
        arr = dequantize(reader, tensors[name])
        if not np.isfinite(arr).all():
            raise CheckpointError(f"{reader.path}: tensor {name!r} holds non-finite values "
                                  "(NaN or inf) once dequantized: the file is damaged")
        if perm is not None:
            arr = unpermute_qk(arr, cfg.num_heads if perm == "q" else cfg.num_kv_heads)
        flat[path] = to_param(arr.T if transpose else arr, cfg.dtype)
    return unflatten(flat)


def load_gguf_config(path: str | os.PathLike, dtype=None) -> LlamaConfig:
    return gguf_config(open_gguf(path), dtype)


def open_target(path: str | os.PathLike, dtype=None):
    """``(reader, config, tokenizer)`` of a GGUF, checked against each other."""
    from jspec.checkpoint.gguf_tokenizer import gguf_tokenizer

    reader = open_gguf(path)
    cfg = gguf_config(reader, dtype if dtype is not None else "float32")
    tok = gguf_tokenizer(reader)
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {tok.vocab_size} tokens, more than "
                              f"the model's vocabulary of {cfg.vocab_size}")
    return reader, cfg, tok


def load_gguf(path: str | os.PathLike, dtype=None, progress: Progress | None = None,
              mesh=None, quantize=None) -> Target:
    """A target from a GGUF file: weights dequantized (to ``dtype``, default float32), the
    tokenizer and chat template built from its metadata (:mod:`jspec.checkpoint.gguf_tokenizer`).
    ``quantize``: the dequantized weights quantized (:func:`jspec.checkpoint.quantize.quantize_target`);
    :func:`jspec.checkpoint.load_target` keeps a file's own int8 blocks instead where it can
    (:mod:`jspec.checkpoint.gguf_blocks`)."""
    from jspec.checkpoint.quantize import quantize_target
    from jspec.target import shard_target

    reader, cfg, tok = open_target(path, dtype)
    target = Target(cfg, gguf_params(reader, cfg, progress), tok)
    target = shard_target(target, mesh) if mesh is not None else target
    return quantize_target(target, quantize)
