"""Quantized targets (jspec.quant) are exact where a float target is: greedy speculative
output equals plain decoding of the same quantized target (every drafter kind, chain and
tree, batch 1 and ragged) for the weight-only modes, sampling keeps the quantized target's
distribution, the engine equals generate, and W8A8's per-token activation scales never mix
rows (W8A8's exactness is tests/quant/test_batch_invariance.py's, in jspec's CPU settings)."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.tiny_targets import KINDS, drafter_of
import qwix

import jspec
from jspec.checkpoint import load_target
from jspec.drafters import random_drafter
from jspec.engine import Engine, Request
from jspec.quant import QuantConfig, QuantizeError, mode_of, quantize_weight, quantized_linear
from jspec.scoring import teacher_forced
from jspec.spec_config import SpecConfig

NEW = 32
SPECS = {"chain": SpecConfig.chain(4), "tree": SpecConfig(4, 4, 12)}


@pytest.fixture(scope="module")
def stories(stories_dir):
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    return stories_dir, [c["prompt_token_ids"] for c in cases]


@pytest.fixture(scope="module")
def quantized(stories):
    path, _ = stories
    return {m: load_target(path, quantize=m) for m in ("int8", "w8a8", "fp8", "bf16")}


def test_bad_requests_fail_before_any_weight_is_read(tmp_path):
    with pytest.raises(QuantizeError, match="int4"):
        jspec.load_target(tmp_path / "missing", quantize="int4")
    with pytest.raises(QuantizeError, match="tile"):
        QuantConfig("int8", tile=0)
    with pytest.raises(QuantizeError, match="multiple of the tile"):
        quantize_weight(jnp.ones((4, 48)), QuantConfig("int8", tile=32), jnp.float32)
    with pytest.raises(QuantizeError, match="bf16"):
        QuantConfig("bf16", tile=32)


@pytest.mark.parametrize("mode", ["int8", "w8a8", "fp8", "bf16"])
def test_product_equals_dequantize_then_matmul(mode):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((5, 64)), jnp.float32)
    w = jnp.asarray(r.standard_normal((2, 24, 64)), jnp.float32)
    qw = quantize_weight(w, QuantConfig(mode), jnp.float32)
    lhs = x if mode != "w8a8" else qwix.dequantize(
        qwix.quantize(x, jnp.int8, channelwise_axes=(0,), scale_dtype=jnp.float32))
    want = jnp.einsum("mk,abk->mab", lhs, qw.dequantize(), precision="highest")
    got = quantized_linear(x, qw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # ...and the quantization error itself is what the mode allows.
    err = float(jnp.abs(qw.dequantize() - w).max() / jnp.abs(w).max())
    assert err < (0.07 if mode == "fp8" else 0.005), err


def test_w8a8_rows_do_not_mix():
    """Each token's activation scale is its own: a row's product is bit-identical whether it
    is alone or beside rows 100x larger (a shared scale would crush it to zero)."""
    r = np.random.default_rng(1)
    x = r.standard_normal((7, 64)).astype(np.float32)
    x[3] *= 100
    qw = quantize_weight(jnp.asarray(r.standard_normal((24, 64)), jnp.float32),
                         QuantConfig("w8a8"), jnp.float32)
    product = jax.jit(quantized_linear)          # as every forward runs it
    together = np.asarray(product(jnp.asarray(x), qw))
    for i in range(7):
        assert np.array_equal(np.asarray(product(jnp.asarray(x[i:i + 1]), qw))[0], together[i])


def combos():
    for mode, kind, spec, size in itertools.product(
            ["int8", "fp8", "bf16"], KINDS,
            SPECS, [1, 4]):
        fast = (mode, kind, spec, size) in {("int8", "eagle3", "tree", 4), ("int8", "ngram", "chain", 1),
                                            ("fp8", "medusa", "chain", 1), ("int8", "dflash", "chain", 4),
                                            ("bf16", "mtp", "tree", 4)}
        yield pytest.param(mode, kind, spec, size, id=f"{mode}-{kind}-{spec}-{size}",
                           marks=() if fast else (pytest.mark.slow,))


@pytest.mark.parametrize("mode,kind,spec,size", list(combos()))
def test_greedy_speculative_equals_plain(quantized, stories, mode, kind, spec, size):
    """Weight-only modes. W8A8 is checked in tests/quant/test_batch_invariance.py, in a
    subprocess with an unrolled layer stack: it is exact there, and the suite scans the
    stack (docs/quantization.md)."""
    target = quantized[mode]
    prompts = stories[1][:1] if size == 1 else stories[1][1:5]
    limits = [NEW] if size == 1 else [NEW, 9, 21, 14]
    plain = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[])
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[],
                         drafter=drafter_of(kind, target.config), spec=SPECS[spec])
    assert res.tokens == plain.tokens


def test_quantized_target_is_not_the_float_one(quantized, stories):
    """The tests above would pass vacuously if quantization did nothing (greedy tokens can
    agree with the float target's for a while; the logprobs cannot)."""
    path, prompts = stories
    ids = prompts[0] + list(range(300, 310))
    base = np.array([e.logprob for e in teacher_forced(load_target(path), ids)[1:]])
    for mode, target in quantized.items():
        assert mode_of(target.params) == mode
        got = np.array([e.logprob for e in teacher_forced(target, ids)[1:]])
        assert 1e-4 < np.abs(got - base).max() < 1.0, mode


def test_engine_equals_generate(quantized, stories):
    target = quantized["int8"]
    prompts = stories[1][:5]
    limits = [23, 5, 31, 12, 17]
    d = random_drafter("eagle3", target.config, jax.random.key(1))
    want = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[]).tokens
    got = Engine(target, d, slots=2, max_new_tokens=32).generate(
        [Request(p, n, stop_ids=[]) for p, n in zip(prompts, limits)])
    assert [c.tokens for c in got] == want
