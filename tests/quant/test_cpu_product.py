"""jspec.quant.product: which product each weight gets on XLA:CPU, and that the kernel's
product is the one XLA's stands for (W8A8: bit for bit)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jspec.quant import QuantConfig, quantize_weight
from jspec.quant import product as qp
from jspec.serving_layout import linear

from cpu_kernels import few_row_product as frp

pytestmark = pytest.mark.skipif(not frp.available(), reason=qp.kernel_status())


def _weight(mode, shape=(2, 24, 64)):
    w = jnp.asarray(np.random.default_rng(0).standard_normal(shape) * 0.1, jnp.float32)
    if mode == "float32":
        return w
    if mode == "bfloat16":
        return w.astype(jnp.bfloat16)
    qc = QuantConfig("int8", tile=32) if mode == "int8/32" else QuantConfig(mode)
    return quantize_weight(w, qc, jnp.float32)


@pytest.mark.parametrize("mode,kernel", [("float32", None), ("bfloat16", "jspec_rows_bf16"),
                                         ("int8", "jspec_rows_i8"), ("int8/32", "jspec_rows_i8"),
                                         ("bf16", "jspec_rows_bf16"), ("w8a8", "jspec_rows_i8i8"),
                                         ("fp8", None)])
def test_the_choice_and_the_result(mode, kernel):
    w = _weight(mode)
    for m in (1, 5, 64, 65):
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 64)), jnp.float32)
        hlo = jax.jit(linear).lower(x, w).as_text()
        with qp.xla_products():
            xla_hlo = jax.jit(lambda x, w: linear(x, w)).lower(x, w).as_text()
            want = np.asarray(jax.jit(lambda x, w: linear(x, w))(x, w))
        assert "jspec_rows" not in xla_hlo
        takes = kernel is not None and (m <= qp.KERNEL_MAX_ROWS or mode == "w8a8")
        if kernel == "jspec_rows_i8i8" and not frp.available_w8a8():
            takes = False
        assert (kernel in hlo) if takes else ("jspec_rows" not in hlo), (mode, m)
        got = np.asarray(jax.jit(linear)(x, w))
        if mode == "w8a8":
            np.testing.assert_array_equal(got, want)       # exact int32 sums, qwix's scaling
        else:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_never_on_other_platforms():
    from jspec.platform import building_for
    x = jnp.ones((4, 64), jnp.float32)
    w = _weight("int8")
    with building_for("tpu"):
        assert qp.cpu_rows(x, w.q.qvalue, w.q.scale) is None


def test_gradients_through_a_bf16_weight():
    """A drafter trained through a few-token forward: the kernel's product has XLA's
    gradients."""
    w = _weight("bfloat16", (24, 64))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.float32)
    loss = lambda x: jnp.sum(jnp.tanh(linear(x, w)))
    assert "jspec_rows_bf16" in jax.jit(jax.grad(loss)).lower(x).as_text()
    got = jax.grad(loss)(x)
    with qp.xla_products():
        want = jax.grad(lambda x: jnp.sum(jnp.tanh(linear(x, w))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
