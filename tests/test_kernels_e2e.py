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
