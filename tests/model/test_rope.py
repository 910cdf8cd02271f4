"""The accelerators' RoPE (the roll as a product with a permutation, over the whole fused
q/k/v block) equals the roll it replaces, bit for bit, in fp32 and bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.platform import building_for
from jspec.rope import rope_inv_freq, rope_tables, rotate, rotate_by_product
from jspec.config import RopeConfig


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rotation_by_product_equals_roll(dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 4, head_dim)) * 30, dtype)   # [B, T, KVH, G+2, D]
    pos = jnp.asarray(rng.integers(0, 4000, (2, 5)), jnp.int32)
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192)
    cos, sin = rope_tables(pos, rope_inv_freq(rope, head_dim))
    cos, sin = cos[:, :, :, None], sin[:, :, :, None]
    want = jax.jit(rotate)(x, cos, sin)
    got = jax.jit(rotate_by_product)(x, cos, sin)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(want, np.float32), np.asarray(x, np.float32))


def test_value_slot_passes_through():
    """The accelerators' tables make the value slot of a KV head's block the identity."""
    from jspec import kv_cache as kvc
    from jspec.config import LlamaConfig
    from jspec.llama import shared_inputs
    from jspec.attention import paged_attention_ref
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    cache = kvc.init_cache(1, 2, 8, np.zeros((1, 2), np.int32), 2, 4)
    pos = jnp.arange(3, dtype=jnp.int32)[None] + 5
    with building_for("tpu"):
        shared = shared_inputs(cfg, pos, cache, None, None, paged_attention_ref)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, 2, 4, 8)), jnp.float32)
    out = rotate(x, shared.cos, shared.sin)
    np.testing.assert_array_equal(np.asarray(out[:, :, :, 3]), np.asarray(x[:, :, :, 3]))
    assert not np.allclose(np.asarray(out[:, :, :, :3]), np.asarray(x[:, :, :, :3]))
