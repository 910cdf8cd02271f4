"""The TPU KV-write kernel (pallas_kernels/kv_write), in interpret mode on CPU: against its
scatter reference, and inside whole generations (plain and speculative) against plain
decoding with the references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import executables, llama
from jspec.config import LlamaConfig
from jspec.drafters import random_drafter
from jspec.spec_config import SpecConfig
from jspec.target import Target
from pallas_kernels import kv_write
from pallas_kernels.kv_write import kv_write_ref, kv_write_tpu


def _case(rng, dtype, T, G, page_size, drop):
    L, KVH, P, D, B = 3, 2, 40, 128, 3
    rows = jnp.asarray(rng.standard_normal((B, KVH, (G + 2) * T, D)), dtype)
    k = jnp.asarray(rng.standard_normal((L, KVH, P, page_size, D)), dtype)
    v = k + 1
    pages_per_row = P // B
    table = rng.permutation(P)[: B * pages_per_row].reshape(B, pages_per_row)
    lengths = rng.integers(0, pages_per_row * page_size - T, B)
    pos = lengths[:, None] + np.arange(T)[None]
    slots = table[np.arange(B)[:, None], pos // page_size] * page_size + pos % page_size
    slots = np.where(rng.random((B, T)) < drop, P * page_size, slots).reshape(-1)
    return rows, k, v, jnp.asarray(slots, jnp.int32), jnp.int32(1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,G,page_size,drop", [
    (1, 4, 16, 0.0), (1, 1, 16, 0.5), (8, 4, 16, 0.2), (5, 1, 32, 0.3), (20, 2, 16, 0.1),
    pytest.param(64, 2, 16, 0.1, marks=pytest.mark.slow)])
def test_kernel_equals_scatter(dtype, T, G, page_size, drop):
    """Tokens straddle row groups and pages; dropped tokens (masked or past the allocation)
    leave their slots as they were, and so does every other slot of a touched group."""
    args = _case(np.random.default_rng(T * 7 + G), jnp.dtype(dtype), T, G, page_size, drop)
    kw = dict(T=T, k_row0=G * T, v_row0=(G + 1) * T)
    got = jax.jit(functools.partial(kv_write_tpu, interpret=True, **kw))(*args)
    want = kv_write_ref(*args, **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert not np.array_equal(np.asarray(got[0], np.float32), np.asarray(args[1], np.float32))


def test_refuses_pages_that_are_not_whole_tiles():
    rows, k, v, slots, layer = _case(np.random.default_rng(0), jnp.bfloat16, 1, 1, 16, 0.0)
    k8 = k.reshape(3, 2, 80, 8, 128)
    with pytest.raises(ValueError, match="page_size 8 is not a multiple of 16"):
        kv_write_tpu(rows, k8, k8, slots, layer, T=1, k_row0=1, v_row0=2, interpret=True)


@pytest.fixture(scope="module")
def lane_wide_target():
    """A random Llama with a lane-wide head dim (128), the one shape where the TPU backend
    writes KV with the kernel (tiny head dims are padded, and keep the scatter)."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=128)
    return Target(cfg, llama.init_params(cfg, jax.random.key(3)))


@pytest.mark.parametrize("whole_block", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["cpu_layout", "tpu_layout"])
def test_generation_with_the_kernel_write_equals_references(lane_wide_target, monkeypatch,
                                                             whole_block):
    """``pallas_interpret`` on a lane-wide model writes KV with the kernel (counted); plain and
    speculative (tree and chain) greedy tokens equal plain decoding with the references.
    ``tpu_layout`` forces the accelerators' forward on CPU: the whole rotated q/k/v block
    feeds both the write and the attention kernel (its grouped queries)."""
    target = lane_wide_target
    prompts = [[1, 5, 9, 13, 17, 21, 2], [3, 4, 100, 7]]
    want = jspec.generate(target, prompts, max_new_tokens=20, stop_ids=[], kernels="reference")
    calls = []
    monkeypatch.setattr(kv_write, "kv_write_tpu",
                        lambda *a, **k: calls.append(k["T"]) or kv_write_tpu(*a, **k))
    monkeypatch.setattr(llama, "_rotates_whole_block", lambda: whole_block)
    executables.clear_all()
    try:
        plain = jspec.generate(target, prompts, max_new_tokens=20, stop_ids=[],
                               kernels="pallas_interpret")
        d = random_drafter("eagle1", target.config, jax.random.key(5))
        tree = jspec.generate(target, prompts, max_new_tokens=20, stop_ids=[], drafter=d,
                              spec=SpecConfig(5, 4, 8), kernels="pallas_interpret")
        chain = jspec.generate(target, prompts, max_new_tokens=20, stop_ids=[], drafter=d,
                               spec=SpecConfig.chain(4), kernels="pallas_interpret")
    finally:
        executables.clear_all()
    assert plain.tokens == want.tokens
    assert tree.tokens == want.tokens
    assert chain.tokens == want.tokens
    assert {1, 8, 5} <= set(calls), calls      # the decode step's, the tree's and the chain's verify
