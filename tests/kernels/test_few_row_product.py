"""The few-row CPU product (cpu_kernels/few_row_product) against its reference, and the
property it exists for: a row's result does not depend on the other rows in the block."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from cpu_kernels import few_row_product as frp

pytestmark = pytest.mark.skipif(not frp.available(),
                                reason=f"few-row kernel: {frp.unavailable_reason()}")

SHAPES = [(96, 64), (40, 48), (13, 37), (8, 576)]      # N, K (odd N and a K tail included)
ROWS = [1, 2, 3, 8, 9, 17]


def _weights(rng, n, k):
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    wi = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    cases = {"float32": (w, None), "bfloat16": (w.astype(jnp.bfloat16), None),
             "int8/channel": (wi, jnp.asarray(rng.random((n, 1)) + 0.1, jnp.float32))}
    if k % 32 == 0:
        cases["int8/block32"] = (wi, jnp.asarray(rng.random((n, k // 32)) + 0.1, jnp.float32))
    if k % 16 == 0:
        cases["int8/block16"] = (wi, jnp.asarray(rng.random((n, k // 16)) + 0.1, jnp.float32))
    return cases


@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_reference_and_rows_never_mix(n, k):
    rng = np.random.default_rng(n * 1000 + k)
    product = jax.jit(frp.rows_product)
    for name, (w, s) in _weights(rng, n, k).items():
        for m in ROWS:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            y = np.asarray(product(x, w, s))
            ref = np.asarray(frp.rows_product_ref(x, w, s))
            scale = np.abs(ref).max()
            assert np.abs(y - ref).max() <= 2e-6 * scale * np.sqrt(k), (name, m)
            # Each row alone, and beside rows 1000x larger, gives the same bits.
            for i in {0, m - 1}:
                alone = np.asarray(product(x[i:i + 1], w, s))[0]
                np.testing.assert_array_equal(alone, y[i], err_msg=f"{name} m={m} row {i}")
            big = x.at[: m - 1].multiply(1000.0) if m > 1 else x
            np.testing.assert_array_equal(np.asarray(product(big, w, s))[m - 1], y[m - 1])


def test_inside_a_compiled_loop():
    """The custom call stays inside ``lax.fori_loop`` (the speculative loop's shape)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    body = lambda i, h: jnp.tanh(frp.rows_product(h, w))
    ref_body = lambda i, h: jnp.tanh(frp.rows_product_ref(h, w))
    got = jax.jit(lambda h: jax.lax.fori_loop(0, 5, body, h))(x)
    hlo = jax.jit(lambda h: jax.lax.fori_loop(0, 5, body, h)).lower(x).as_text()
    assert "jspec_rows_f32" in hlo and "while" in hlo
    np.testing.assert_allclose(got, jax.lax.fori_loop(0, 5, ref_body, x), rtol=1e-5, atol=1e-6)


def test_bad_shapes_refused():
    x = jnp.ones((2, 32), jnp.float32)
    w = jnp.ones((8, 32), jnp.int8)
    with pytest.raises(Exception, match="scale"):
        jax.jit(frp.rows_product)(x, w, jnp.ones((8, 3), jnp.float32))
    assert not frp.supports(jnp.int8, 32, (8, 4))          # blocks of 8 inputs: not taken
    assert not frp.supports(jnp.float8_e4m3fn, 32)
    assert frp.supports(jnp.int8, 64, (8, 2)) and frp.supports(jnp.bfloat16, 7)


@pytest.mark.skipif(not frp.available_w8a8(), reason="no AVX-512 VNNI")
@pytest.mark.parametrize("n,k", SHAPES + [(24, 200)])
def test_w8a8_bit_for_bit_and_rows_never_mix(n, k):
    """The int32 sums are exact and the scales applied in the reference's order, so the
    kernel equals its reference bit for bit, extremes (-128, 127) included."""
    rng = np.random.default_rng(k)
    wq = jnp.asarray(rng.integers(-128, 128, (n, k)), jnp.int8).at[0].set(-128)
    ws = jnp.asarray(rng.random((n, 1)) + 1e-3, jnp.float32)
    product = jax.jit(frp.w8a8_product)
    for m in ROWS:
        xq = jnp.asarray(rng.integers(-128, 128, (m, k)), jnp.int8).at[-1].set(127)
        xs = jnp.asarray(rng.random((m, 1)) + 1e-3, jnp.float32)
        y = np.asarray(product(xq, xs, wq, ws))
        np.testing.assert_array_equal(y, np.asarray(frp.w8a8_product_ref(xq, xs, wq, ws)))
        np.testing.assert_array_equal(np.asarray(product(xq[-1:], xs[-1:], wq, ws))[0], y[-1])
