"""jspec.topk's two-stage top-k is lax.top_k's answer (values and indices, ties in index
order) on the vocabulary-wide axes it cuts into chunks; top_k uses it when building for TPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import topk


def _inputs(rng, kind, shape):
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "ties":                          # a handful of distinct values
        return rng.integers(0, 5, shape).astype(np.float64)
    if kind == "masked":                        # mostly -inf, as a filtered vocabulary
        return np.where(rng.random(shape) < 0.99, -np.inf, rng.standard_normal(shape))
    x = np.full(shape, -np.inf)                 # one finite entry: the rest tie at -inf
    x[..., rng.integers(0, shape[-1])] = 1.0
    return x


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["normal", "ties", "masked", "one"])
@pytest.mark.parametrize("V,k", [(512, 1), (1000, 4), (32000, 8), (4099, 10), (70000, 20)])
def test_equals_lax_top_k(V, k, kind, dtype):
    rng = np.random.default_rng(V + k)
    x = jnp.asarray(_inputs(rng, kind, (2, 3, V)), dtype)
    got = jax.jit(topk.two_stage_top_k, static_argnums=1)(x, k)
    want = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_cuts_only_wide_axes(monkeypatch):
    """Narrow axes (and k * CHUNK >= V) go straight to lax.top_k; a wide one is cut (its
    lax.top_k calls are all narrower than the input)."""
    widths = []
    real = jax.lax.top_k
    monkeypatch.setattr(jax.lax, "top_k", lambda x, k: widths.append(x.shape[-1]) or real(x, k))
    topk.two_stage_top_k(jnp.zeros((1, 300)), 4)
    assert widths == [300]
    widths.clear()
    topk.two_stage_top_k(jnp.zeros((1, 32768)), 4)
    assert widths and max(widths) < 32768, widths


def test_two_stages_only_when_building_for_tpu(monkeypatch):
    from jspec.platform import building_for
    widths = []
    real = jax.lax.top_k
    monkeypatch.setattr(jax.lax, "top_k", lambda x, k: widths.append(x.shape[-1]) or real(x, k))
    topk.top_k(jnp.zeros((1, 32768)), 4)
    assert widths == [32768]                    # CPU: lax.top_k as it is
    widths.clear()
    with building_for("tpu"):
        topk.top_k(jnp.zeros((1, 32768)), 4)
    assert max(widths) < 32768, widths
