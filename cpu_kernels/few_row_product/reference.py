"""What the few-row product computes, in jnp: ``y[M, N] = x[M, K] . W[N, K]^T`` in float32,
with an int8 weight's scales applied per output row or per block of inputs. The kernel sums
in another order (16-lane partial sums, then a horizontal sum), so it agrees with this to
float32 rounding, not bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rows_product_ref(x, w, scale=None):
    """``x [M, K]`` (float32) times ``w [N, K]`` (float32, bfloat16 or int8) -> ``[M, N]``
    float32. ``scale [N, 1]``: one per weight row; ``[N, K / B]``: one per B inputs."""
    hi = jax.lax.Precision.HIGHEST
    x = x.astype(jnp.float32)
    wf = w.astype(jnp.float32)
    if scale is None:
        return jnp.einsum("mk,nk->mn", x, wf, precision=hi)
    N, K = w.shape
    nb = scale.shape[-1]
    if nb == 1:
        return jnp.einsum("mk,nk->mn", x, wf, precision=hi) * scale[:, 0].astype(jnp.float32)
    part = jnp.einsum("mbk,nbk->mnb", x.reshape(-1, nb, K // nb), wf.reshape(N, nb, K // nb),
                      precision=hi)
    return jnp.sum(part * scale.astype(jnp.float32)[None], -1)


def w8a8_product_ref(xq, xscale, wq, wscale):
    """int8 ``xq [M, K]`` times int8 ``wq [N, K]`` summed in int32, then scaled as qwix's
    product scales it: ``(float(sum) * xscale[m]) * wscale[n]`` (bit for bit the kernel's)."""
    acc = jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * xscale.astype(jnp.float32).reshape(-1, 1)) * \
        wscale.astype(jnp.float32).reshape(1, -1)
