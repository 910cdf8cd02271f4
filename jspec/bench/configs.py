"""Named random Llama configurations for benchmarks (weights are random; only shapes matter)."""

from __future__ import annotations

from jspec.config import LlamaConfig, RopeConfig

LLAMA3_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192)

RANDOM_CONFIGS: dict[str, LlamaConfig] = {
    # Fast enough for unit tests.
    "tiny": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope=LLAMA3_ROPE,
                        tie_word_embeddings=False, max_position_embeddings=131072,
                        bos_token_id=1, eos_token_ids=(2,)),
    # The shipped default target's shape (checkpoints/default): deep and thin, 6.7M parameters.
    "deep16": LlamaConfig(vocab_size=2048, hidden_size=192, intermediate_size=512, num_layers=16,
                          num_heads=6, num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                          max_position_embeddings=2048, bos_token_id=0, eos_token_ids=(1,)),
    # ~100M parameters (tied embeddings): 12 x 6.29M blocks + 24.6M embedding.
    "100m": LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                        num_heads=12, num_kv_heads=4, head_dim=64, rope=LLAMA3_ROPE,
                        tie_word_embeddings=True, max_position_embeddings=131072,
                        bos_token_id=1, eos_token_ids=(2,)),
    # Llama-3-8B's shapes (untied, GQA 32/8, llama3 RoPE). Natural dtype bfloat16 (see
    # NATURAL_DTYPES); meant for shape-only work such as `python -m jspec.bench anatomy`.
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             rope=LLAMA3_ROPE, tie_word_embeddings=False,
                             max_position_embeddings=131072, bos_token_id=128000,
                             eos_token_ids=(128001, 128009)),
    # Llama-3-70B's shapes (80 layers, GQA 64/8). Shape-only: `python -m jspec.bench plan`.
    "llama3-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                              rope=LLAMA3_ROPE, tie_word_embeddings=False,
                              max_position_embeddings=131072, bos_token_id=128000,
                              eos_token_ids=(128001, 128009)),
}

# The dtype a config is usually run in. random_config() still defaults to float32 for every
# config; tools that default to the natural dtype (the anatomy bench) read this.
NATURAL_DTYPES: dict[str, str] = {"llama3-8b": "bfloat16", "llama3-70b": "bfloat16"}


def natural_dtype(name: str) -> str:
    return NATURAL_DTYPES.get(name, "float32")


def random_config(name: str, dtype: str = "float32") -> LlamaConfig:
    try:
        cfg = RANDOM_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown random config {name!r}; known: {', '.join(RANDOM_CONFIGS)}") from None
    return cfg.replace(dtype=dtype)
