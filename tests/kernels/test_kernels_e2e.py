"""End to end: generation on stories260K with the Pallas kernels (interpret mode on CPU)
gives the same tokens as with the jnp references."""

import json

import jax
import pytest

import jspec
from jspec.checkpoint import load_target
from jspec.drafters import random_drafter
from jspec.spec_config import SpecConfig


@pytest.fixture(scope="module")
def setup(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    return target, [c["prompt_token_ids"] for c in cases[:2]], cases


@pytest.mark.parametrize("kernels", [
    "pallas_interpret", pytest.param("pallas_interpret_gpu", marks=pytest.mark.slow)])
def test_speculative_with_kernels_equals_references(setup, kernels):
    target, prompts, cases = setup
    d = random_drafter("eagle1", target.config, jax.random.key(5))
    spec = SpecConfig(3, 2, 5)
    ref = jspec.generate(target, prompts, max_new_tokens=16, stop_ids=[], drafter=d, spec=spec)
    got = jspec.generate(target, prompts, max_new_tokens=16, stop_ids=[], drafter=d, spec=spec,
                         kernels=kernels)
    assert got.tokens == ref.tokens
    assert got.tokens[0] == cases[0]["continuation_token_ids"][:16]


def test_plain_decode_with_kernel_equals_golden(setup):
    target, prompts, cases = setup
    got = jspec.generate(target, prompts, max_new_tokens=12, stop_ids=[], kernels="pallas_interpret")
    assert got.tokens == [c["continuation_token_ids"][:12] for c in cases[:2]]


def test_kernel_modes_are_checked_before_compiling(setup):
    target, prompts, _ = setup
    with pytest.raises(ValueError, match="kernels='pallas' needs a TPU or GPU"):
        jspec.generate(target, prompts, kernels="pallas")
    with pytest.raises(ValueError, match="choose one of"):
        jspec.generate(target, prompts, kernels="fast")


@pytest.mark.parametrize("kind", [pytest.param("eagle1", marks=pytest.mark.slow), "eagle3",
                                  pytest.param("mtp", marks=pytest.mark.slow)])
def test_drafter_attention_follows_the_decoder_kernels(setup, kind):
    """kernels= reaches the drafter: its committed blocks (prefill, extend) and its tree loop's
    prefix run the tree-attention kernel, and the draft is the one the reference attention
    gives."""
    import jax.numpy as jnp
    import numpy as np

    from jspec import kv_cache as kvc
    from jspec.sampling import SamplingConfig
    from jspec.spec_decode import SpecDecoder

    target, _, _ = setup
    d = random_drafter(kind, target.config, jax.random.key(1))
    dec = {m: SpecDecoder(target.config, d.module, SpecConfig(3, 2, 5), SamplingConfig(), 8, 16, 8,
                          kernels=m) for m in ("reference", "pallas_interpret")}
    # The mode is an argument of the drafter's calls, not a field: the architecture is as given.
    assert dec["pallas_interpret"].drafter is d.module

    c, B, T = target.config, 2, 6
    width = (3 if d.module.target_layers else 1) * c.hidden_size
    feats = jax.random.normal(jax.random.key(2), (B, T, width))
    toks = jax.random.randint(jax.random.key(3), (B, T), 0, c.vocab_size)
    table = jnp.arange(B * 2, dtype=jnp.int32).reshape(B, 2)

    def extend(m):
        dr = dec[m].drafter
        st = dr.init_state(B, table, B * 2, 16)
        return dr.extend(d.params, (c, target.params), st, feats, toks, jnp.array([T, 4]),
                         kernels=dec[m].kernels)

    jaxpr = str(jax.make_jaxpr(lambda: extend("pallas_interpret"))())
    assert "pallas_call" in jaxpr
    assert "pallas_call" not in str(jax.make_jaxpr(lambda: extend("reference"))())
    got, ref = extend("pallas_interpret"), extend("reference")
    np.testing.assert_allclose(got.logits, ref.logits, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(kvc.read_layer(got.cache, 0)[0], kvc.read_layer(ref.cache, 0)[0],
                               atol=1e-5)

    # The tree loop: its prefix through the kernel (with the log-sum-exp), the same pool.
    def pool(m):
        return dec[m].drafter.draft_pool(d.params, (c, target.params), ref, SpecConfig(3, 2, 5),
                                         kernels=dec[m].kernels)

    assert "_lse" in str(jax.make_jaxpr(lambda: pool("pallas_interpret"))())
    got_pool, ref_pool = pool("pallas_interpret"), pool("reference")
    np.testing.assert_array_equal(got_pool.tokens, ref_pool.tokens)
    np.testing.assert_allclose(got_pool.scores, ref_pool.scores, atol=2e-4, rtol=2e-4)

    def prefill_jaxpr(m):
        return str(jax.make_jaxpr(lambda: dec[m].prefill(
            target.params, d.params, toks, jnp.array([T, 4]), table, table, jax.random.key(0)))())

    # The decoder passes its mode on: its target prefill stays on the reference attention, so
    # a kernel in the traced prefill is the drafter's.
    assert "pallas_call" in prefill_jaxpr("pallas_interpret")
    assert "pallas_call" not in prefill_jaxpr("reference")
