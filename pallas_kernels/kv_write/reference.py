"""The KV write's jnp reference: one scatter per pool (what :func:`jspec.kv_cache.write_layer`
does for the reference backend)."""

from __future__ import annotations

import jax.numpy as jnp


def kv_write_ref(rows, k_pages, v_pages, slots, layer, *, T: int, k_row0: int, v_row0: int):
    """Shapes as :func:`pallas_kernels.kv_write.kernel_tpu.kv_write_tpu`."""
    B, KVH, _, D = rows.shape
    L, _, P, ps, _ = k_pages.shape
    flat = slots.reshape(B, T)
    heads = jnp.arange(KVH)[None, :, None]

    def put(pages, row0):
        x = rows[:, :, row0:row0 + T].astype(pages.dtype)                # [B, KVH, T, D]
        view = pages.reshape(L, KVH, P * ps, D)
        return view.at[layer, heads, flat[:, None, :]].set(x, mode="drop").reshape(pages.shape)

    return put(k_pages, k_row0), put(v_pages, v_row0)
