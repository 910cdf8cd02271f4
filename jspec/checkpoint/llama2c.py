"""llama2.c ``.bin`` checkpoints (version-0 "legacy" export, float32).

Layout after a 7 x int32 header (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
vocab_size, seq_len), all float32 and torch-style ``[out, in]``::

    token_embedding [V, dim]      rms_att [L, dim]
    wq [L, dim, dim]  wk [L, kv_dim, dim]  wv [L, kv_dim, dim]  wo [L, dim, dim]
    rms_ffn [L, dim]  w1 [L, hidden, dim]  w2 [L, dim, hidden]  w3 [L, hidden, dim]
    rms_final [dim]   freq_cis_real, freq_cis_imag [seq_len, head_dim/2]   wcls [V, dim]

``wcls`` is present only when the header's vocab_size is negative (untied classifier).
llama2.c rotates interleaved pairs (2j, 2j+1) with frequency j; jspec rotates halves
(j, j + head_dim/2). Reordering each head's q/k output rows evens-first maps one onto
the other without touching anything else.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jspec.checkpoint.common import (CheckpointError, Progress, check_shape, expected_shapes,
                                     flatten, no_progress, to_param, unflatten, with_dtype)
from jspec.config import LlamaConfig, RopeConfig
from jspec.target import Target
from jspec.tokenizer import find_tokenizer, load_tokenizer

HEADER = 7
# run.c hard-codes these, so a model differing here cannot be written as a .bin.
L2C_EPS = 1e-5
L2C_THETA = 10000.0


def _layout(c: LlamaConfig, untied: bool):
    """(name, shape) of each block in file order; ``L`` leading dim for per-layer tensors."""
    L, D, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    kv = c.num_kv_heads * c.head_dim
    rows = [("token_embedding", (V, D)), ("rms_att", (L, D)), ("wq", (L, D, D)),
            ("wk", (L, kv, D)), ("wv", (L, kv, D)), ("wo", (L, D, D)), ("rms_ffn", (L, D)),
            ("w1", (L, F, D)), ("w2", (L, D, F)), ("w3", (L, F, D)), ("rms_final", (D,)),
            ("freq_cis_real", (c.max_position_embeddings, c.head_dim // 2)),
            ("freq_cis_imag", (c.max_position_embeddings, c.head_dim // 2))]
    if untied:
        rows.append(("wcls", (V, D)))
    return rows


# llama2.c block -> (flax path template, transpose, rope permute heads from cfg field).
_MAP = {
    "token_embedding": ("embed_tokens/embedding", False, None),
    "rms_final": ("norm/scale", False, None),
    "wcls": ("lm_head/kernel", True, None),
    "rms_att": ("layers_{i}/input_layernorm/scale", False, None),
    "wq": ("layers_{i}/self_attn/q_proj/kernel", True, "num_heads"),
    "wk": ("layers_{i}/self_attn/k_proj/kernel", True, "num_kv_heads"),
    "wv": ("layers_{i}/self_attn/v_proj/kernel", True, None),
    "wo": ("layers_{i}/self_attn/o_proj/kernel", True, None),
    "rms_ffn": ("layers_{i}/post_attention_layernorm/scale", False, None),
    "w1": ("layers_{i}/mlp/gate_proj/kernel", True, None),
    "w2": ("layers_{i}/mlp/down_proj/kernel", True, None),
    "w3": ("layers_{i}/mlp/up_proj/kernel", True, None),
}


def _rope_perm(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order taking interleaved-pair layout to rotate-half, per head."""
    within = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(n_heads)[:, None] * head_dim + within[None]).reshape(-1)


def read_header(path: str | os.PathLike) -> tuple[LlamaConfig, bool]:
    """Config and whether the classifier is untied; checks the file size against it."""
    p = Path(path)
    size = p.stat().st_size
    if size < HEADER * 4:
        raise CheckpointError(f"{p}: {size} bytes is too short for a llama2.c header")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = np.fromfile(p, "<i4", HEADER).tolist()
    for name, v in (("dim", dim), ("hidden_dim", hidden), ("n_layers", n_layers),
                    ("n_heads", n_heads), ("n_kv_heads", n_kv), ("seq_len", seq_len)):
        if v <= 0:
            raise CheckpointError(f"{p}: header field {name}={v} must be positive")
    if vocab == 0 or dim % n_heads or (dim // n_heads) % 2:
        raise CheckpointError(f"{p}: header (dim={dim}, n_heads={n_heads}, vocab_size={vocab}) "
                              "is not a llama2.c model")
    cfg = LlamaConfig(
        vocab_size=abs(vocab), hidden_size=dim, intermediate_size=hidden, num_layers=n_layers,
        num_heads=n_heads, num_kv_heads=n_kv, head_dim=dim // n_heads, rms_norm_eps=L2C_EPS,
        rope=RopeConfig(theta=L2C_THETA), tie_word_embeddings=vocab > 0,
        max_position_embeddings=seq_len, bos_token_id=1,
        # run.c stops when the model emits BOS again; 2 is the tokenizer's EOS.
        eos_token_ids=(1, 2), dtype="float32")
    untied = vocab < 0
    want = 4 * (HEADER + sum(int(np.prod(s)) for _, s in _layout(cfg, untied)))
    if size != want:
        raise CheckpointError(
            f"{p}: {'truncated' if size < want else 'too long'}: file is {size} bytes but its "
            f"header (dim={dim}, hidden_dim={hidden}, n_layers={n_layers}, n_heads={n_heads}, "
            f"n_kv_heads={n_kv}, vocab_size={vocab}, seq_len={seq_len}) implies {want} bytes "
            "for a version-0 float32 export")
    return cfg, untied


def load_llama2c(path: str | os.PathLike, dtype=None, tokenizer: str | os.PathLike | None = None,
                 progress: Progress | None = None) -> Target:
    """Load a llama2.c ``.bin``; the tokenizer is ``tokenizer`` or a ``tok*.bin`` beside it."""
    cfg, untied = read_header(path)
    cfg = with_dtype(cfg, dtype)
    shapes = expected_shapes(cfg)
    mm = np.memmap(path, dtype="<f4", mode="r", offset=HEADER * 4)  # pages in per block
    flat, off = {}, 0
    layout = _layout(cfg, untied)
    for name, shape in (progress or no_progress)(layout, total=len(layout)):
        n = int(np.prod(shape))
        block = mm[off:off + n].reshape(shape)
        off += n
        if name not in _MAP:
            continue  # legacy RoPE tables: recomputed from theta instead
        tmpl, transpose, heads = _MAP[name]
        per_layer = "{i}" in tmpl
        for i, w in enumerate(block if per_layer else [block]):
            path_ = tuple(tmpl.format(i=i).split("/"))
            w = np.asarray(w)
            if heads is not None:
                w = w[_rope_perm(getattr(cfg, heads), cfg.head_dim)]
            w = w.T if transpose else w
            check_shape(f"{name}[{i}]" if per_layer else name, shapes[path_], w.shape)
            flat[path_] = to_param(w, cfg.dtype)
    del mm
    tok_path = Path(tokenizer) if tokenizer is not None else find_tokenizer(
        Path(path).parent, exclude=[path])
    tok = load_tokenizer(tok_path) if tok_path is not None else None
    return Target(cfg, unflatten(flat), tok)


def save_llama2c(target: Target, path: str | os.PathLike) -> None:
    """Write a version-0 llama2.c ``.bin`` (float32). Refuses configs run.c cannot express."""
    c = target.config
    problems = []
    if c.head_dim * c.num_heads != c.hidden_size:
        problems.append(f"head_dim*num_heads={c.head_dim * c.num_heads} != hidden_size")
    if c.rope.rope_type != "default" or c.rope.theta != L2C_THETA:
        problems.append(f"rope {c.rope.rope_type} theta={c.rope.theta} (run.c uses default 1e4)")
    if c.rms_norm_eps != L2C_EPS:
        problems.append(f"rms_norm_eps={c.rms_norm_eps} (run.c uses 1e-5)")
    if problems:
        raise CheckpointError("cannot write as llama2.c: " + "; ".join(problems))
    flat = flatten(target.params)
    pos = np.arange(c.max_position_embeddings, dtype=np.float32)[:, None]
    freqs = pos * (1.0 / L2C_THETA ** (np.arange(0, c.head_dim, 2, dtype=np.float32) / c.head_dim))
    untied = not c.tie_word_embeddings
    header = [c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
              -c.vocab_size if untied else c.vocab_size, c.max_position_embeddings]
    with open(path, "wb") as f:
        f.write(np.asarray(header, "<i4").tobytes())
        for name, _ in _layout(c, untied):
            if name == "freq_cis_real":
                f.write(np.cos(freqs).astype("<f4").tobytes())
                continue
            if name == "freq_cis_imag":
                f.write(np.sin(freqs).astype("<f4").tobytes())
                continue
            tmpl, transpose, heads = _MAP[name]
            for i in range(c.num_layers if "{i}" in tmpl else 1):
                w = np.asarray(flat[tuple(tmpl.format(i=i).split("/"))]).astype(np.float32)
                w = w.T if transpose else w
                if heads is not None:
                    w = w[np.argsort(_rope_perm(getattr(c, heads), c.head_dim))]
                f.write(np.ascontiguousarray(w, "<f4").tobytes())
