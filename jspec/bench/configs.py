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
    # ~100M parameters (tied embeddings): 12 x 6.29M blocks + 24.6M embedding.
    "100m": LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                        num_heads=12, num_kv_heads=4, head_dim=64, rope=LLAMA3_ROPE,
                        tie_word_embeddings=True, max_position_embeddings=131072,
                        bos_token_id=1, eos_token_ids=(2,)),
}


def random_config(name: str, dtype: str = "float32") -> LlamaConfig:
    try:
        cfg = RANDOM_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown random config {name!r}; known: {', '.join(RANDOM_CONFIGS)}") from None
    return cfg.replace(dtype=dtype)
