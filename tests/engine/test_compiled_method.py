"""jspec.compiled: a method jitted with its instance static and compiled with the instance's
XLA options, however it is reached (through the instance, or the class with the instance
first, as ahead-of-time tools do)."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from jspec.checkpoint import load_target
from jspec.compiled import compiled, options_for
from jspec.engine import Engine

LEGACY = (("xla_cpu_use_fusion_emitters", False),)


@dataclasses.dataclass(frozen=True)
class Scale:
    factor: float
    compiler_options: tuple = ()

    @compiled(static=("twice",), donate=("x",))
    def apply(self, x, twice: bool = False):
        return x * self.factor * (2 if twice else 1)


def test_each_set_of_options_gets_its_own_jitted_function_shared_by_equal_instances():
    a, b, c = Scale(2.0), Scale(2.0), Scale(2.0, LEGACY)
    assert np.allclose(a.apply(jnp.ones(3)), 2.0)
    assert np.allclose(c.apply(jnp.ones(3), twice=True), 4.0)
    assert np.allclose(Scale.apply(b, jnp.ones(3)), 2.0)
    assert set(Scale.apply.by_options) == {(), LEGACY}
    assert Scale.apply.jitted(())._cache_size() == 1        # a and b share one program


def test_through_the_class_it_compiles_ahead_of_time_with_the_instance_options():
    exe = Scale.apply.trace(Scale(3.0, LEGACY), jnp.ones(2)).lower().compile()
    assert np.allclose(exe(jnp.ones(2)), 3.0)
    assert LEGACY in Scale.apply.by_options


def test_only_a_w8a8_engine_compiles_with_the_legacy_emitters(stories_dir):
    """The serving engine's programs and its prompt scorer take the options generate's do
    (jspec.invariant_attention.compiler_options): without them its W8A8 speculative output
    parted from plain decoding (tests/quant/test_batch_invariance.py)."""
    for mode, want in (("w8a8", LEGACY), (None, ()), ("int8", ())):
        target = load_target(stories_dir, quantize=mode)
        assert options_for(target.serving_params) == want
        eng = Engine(target, slots=1, max_new_tokens=4, logprobs_k=0)
        assert eng.programs.compiler_options == want
