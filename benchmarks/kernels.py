"""``python -m jspec.bench kernels``: tree attention at Llama-3-8B attention shapes.

For each (batch, prefix): the tree-attention kernel with N nodes, the jnp reference on
the same inputs, and plain decode attention (the kernel with N = 1), in ms, with the
achieved bandwidth (KV bytes read / time) against the device's measured copy bandwidth.
Made to be run as one prepared script on a GPU/TPU machine; ``--impl reference`` and
small ``--prefix`` / ``--batch`` run it on a CPU for a smoke test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.common import format_table
from jspec.bench.registry import Command, run_module
from jspec.timing import round_robin
from jspec.tree.build import build_tree
from pallas_kernels.tree_attention import tree_attention

COLUMNS = ["batch", "prefix", "N", "kernel ms", "reference ms", "decode ms", "kernel GB/s",
           "decode GB/s", "copy GB/s", "kernel/decode"]


def copy_bandwidth(nbytes=1 << 28, repeats=10):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1)
    t, = round_robin([lambda: f(x)], repeats)
    return 2 * nbytes / t.median / 1e9          # read + write


def inputs(batch, prefix, N, H=32, KVH=8, D=128, page=16, dtype=jnp.bfloat16, seed=0):
    pages_per_row = -(-(prefix + N) // page)
    P = batch * pages_per_row
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k1, (batch, N, H, D), dtype)
    kp = jax.random.normal(k2, (KVH, P, page, D), dtype)
    vp = jax.random.normal(k3, (KVH, P, page, D), dtype)
    table = jax.random.permutation(k4, P).reshape(batch, pages_per_row).astype(jnp.int32)
    lengths = jnp.full((batch,), prefix, jnp.int32)
    parents = np.concatenate([[-1], np.arange(N - 1) // 2]).astype(np.int32)  # a binary tree
    tree = build_tree(jnp.zeros((batch, N), jnp.int32), jnp.broadcast_to(parents, (batch, N)), N)
    kv_bytes = 2 * KVH * (prefix + N) * D * jnp.dtype(dtype).itemsize * batch
    return (q, kp, vp, table, lengths, tree.mask_bits), kv_bytes


def run(batches, prefixes, N, impl, repeats):
    kernel = jax.jit(lambda *a: tree_attention(*a, backend=None if impl == "kernel" else "reference"))
    reference = jax.jit(lambda *a: tree_attention(*a, backend="reference"))
    copy = copy_bandwidth()
    rows = []
    for B in batches:
        for L in prefixes:
            args, nbytes = inputs(B, L, N)
            dargs, dbytes = inputs(B, L, 1)
            tk, tr, td = (t.median for t in round_robin(
                [lambda: kernel(*args), lambda: reference(*args), lambda: kernel(*dargs)],
                repeats))
            rows.append({"batch": B, "prefix": L, "N": N, "kernel ms": tk * 1e3,
                         "reference ms": tr * 1e3, "decode ms": td * 1e3,
                         "kernel GB/s": nbytes / tk / 1e9, "decode GB/s": dbytes / td / 1e9,
                         "copy GB/s": copy, "kernel/decode": tk / td})
    return rows


def add_args(p) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prefix", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--impl", choices=["kernel", "reference"], default="kernel")
    p.add_argument("--repeats", type=int, default=10)


def main(a):
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; Llama-3-8B attention: 32 q heads, "
          f"8 KV heads, head_dim 128, bf16, page 16")
    rows = run(a.batch, a.prefix, a.nodes, a.impl, a.repeats)
    print(format_table(rows, COLUMNS))
    return rows


COMMAND = Command("kernels", "tree attention at Llama-3-8B attention shapes, kernel vs reference "
                             "vs decode (a device script)", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
