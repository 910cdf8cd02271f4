"""GGUF files written the way llama.cpp's converter writes them, for the GGUF loader's tests.

:func:`write_llama_gguf` takes HF-named float32 weights (``[out, in]``), permutes the Q/K rows
as llama.cpp does (:func:`jspec.checkpoint.gguf.permute_qk`), stores every matrix in the
requested GGML type and the metadata given. A type ``gguf.quants`` can quantize is quantized
from the weights; for the others (the K- and IQ-quants have no Python quantizer) the blocks are
random bytes, which is enough to test that the loader dequantizes them as ``gguf`` does.
"""

from __future__ import annotations

import numpy as np

from jspec.checkpoint.gguf import permute_qk
from jspec.config import LlamaConfig

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


# A two-layer model with a 64-token byte-ish vocabulary, small enough to quantize in a test.
SMALL_CFG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                        eos_token_ids=(2,), bos_token_id=1)
SMALL_VOCAB = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
               "tokenizer.ggml.tokens": ["<s>", "</s>", "!\""] + [chr(0x21 + i) for i in range(61)],
               "tokenizer.ggml.token_type": [3, 3] + [1] * 62, "tokenizer.ggml.merges": ["! \""],
               "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)          # model.layers.{i}.{rest}
    return f"blk.{i}.{HF_TO_GGUF[rest]}"


def encode_tensor(arr: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """``arr`` (float32) as the raw bytes (or floats) GGUF stores for ``qtype``."""
    import gguf
    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return arr.astype(np.float32)
    if qtype == Q.F16:
        return arr.astype(np.float16)
    try:
        return gguf.quants.quantize(arr.astype(np.float32), qtype)
    except NotImplementedError:
        # Random blocks; rows whose f16 scales came out inf/NaN are drawn again.
        shape = gguf.quants.quant_shape_to_byte_shape(arr.shape, qtype)
        data = rng.integers(0, 256, size=shape, dtype=np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):
            return _finite_blocks(data, qtype, rng)


def _finite_blocks(data, qtype, rng):
    import gguf
    while not (ok := np.isfinite(gguf.quants.dequantize(data, qtype)).all(axis=-1)).all():
        data[~ok] = rng.integers(0, 256, size=(int((~ok).sum()), data.shape[-1]), dtype=np.uint8)
    return data


def write_llama_gguf(path, cfg: LlamaConfig, state_dict: dict, tokenizer: dict | None = None,
                     qtype=None, arch: str = "llama", extra_tensors: dict | None = None,
                     rope_scaling: bool | None = None, seed: int = 0) -> dict:
    """Write ``state_dict`` (HF names) as a GGUF; matrices in ``qtype`` (default F32), norms in
    F32. ``tokenizer``: ``tokenizer.ggml.*`` / ``tokenizer.chat_template`` keys to values.
    Returns the raw arrays written, by GGUF name (what ``gguf.quants.dequantize`` should see)."""
    import gguf
    Q = gguf.GGMLQuantizationType
    qtype = Q.F32 if qtype is None else qtype
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if rope_scaling if rope_scaling is not None else cfg.rope.rope_type == "llama3":
        w.add_string(f"{arch}.rope.scaling.type", "llama3")
        w.add_float32(f"{arch}.rope.scaling.factor", cfg.rope.factor)
        w.add_float32(f"{arch}.rope.scaling.low_freq_factor", cfg.rope.low_freq_factor)
        w.add_float32(f"{arch}.rope.scaling.high_freq_factor", cfg.rope.high_freq_factor)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                     cfg.rope.original_max_position_embeddings)
    for key, value in (tokenizer or {}).items():
        _add_kv(w, key, value)
    raw = {}
    tensors = {gguf_name(k): np.asarray(v, np.float32) for k, v in state_dict.items()}
    tensors.update(extra_tensors or {})
    for name, arr in tensors.items():
        if name.endswith("attn_q.weight"):
            arr = permute_qk(arr, cfg.num_heads)
        elif name.endswith("attn_k.weight"):
            arr = permute_qk(arr, cfg.num_kv_heads)
        t = qtype if arr.ndim == 2 else Q.F32
        data = encode_tensor(arr, t, rng)
        raw[name] = data
        if t in (Q.F32, Q.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raw


def _add_kv(w, key: str, value) -> None:
    import gguf
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)) and value and isinstance(value[0], float):
        w.add_array(key, [float(v) for v in value])
    else:
        w.add_array(key, list(value))
    del gguf


def llama2c_tokenizer_meta(tok) -> dict:
    """A llama2.c tokenizer as a GGUF ``llama`` (SentencePiece) vocabulary, spelled the way
    SentencePiece spells it (``\u2581`` for a space, ``<0xNN>`` byte pieces typed 6)."""
    tokens, types = [], []
    for i, p in enumerate(tok.pieces):
        s = p.decode("utf-8", errors="replace").replace(" ", "\u2581")
        tokens.append(s)
        types.append(2 if i == 0 else 3 if i in (1, 2) else 6 if s.startswith("<0x") else 1)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [float(s) for s in tok.scores],
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True}


def hf_bpe_tokenizer_meta(tok_json: dict, pre: str, special: tuple[str, ...] = ()) -> dict:
    """An HF byte-level BPE ``tokenizer.json`` (as a dict) as GGUF ``gpt2`` metadata."""
    model = tok_json["model"]
    vocab = model["vocab"]
    for t in tok_json.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in special else 1 for t in tokens]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges}
