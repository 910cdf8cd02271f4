"""``python -m jspec.bench products``: every weight product SmolLM2 runs, in each weight dtype,
for 1-32 token rows, through XLA's forms and through the few-row CPU kernel, side by side in
one run (:mod:`jspec.quant.product` chooses between them in the model).

Each (shape, dtype, rows, form) is one jitted product, called in turn on ``C`` copies of the
weight, ``C`` enough that the copies overflow the last-level cache twice (so every call
streams its weight from DRAM, as a model step does), at most ``--max-copies``. A call's
time has jax's dispatch removed (an empty jitted call on the same arguments, timed the same
way). GB/s counts the weight's bytes as stored (scales included), against the DRAM read
bandwidth measured in the same run (``bench memory-floor``'s measure).

XLA's forms are what :func:`jspec.serving_layout.linear` and
:func:`jspec.quant.quantized_linear` build with the kernel off: a matrix-vector loop for one
row, Eigen's GEMM on the transposed product for 2-64 rows, and a bf16 or int8 weight
converted to float32 before either.
"""

from __future__ import annotations

import platform
import time

import numpy as np

from jspec.bench.registry import Command, run_module

# SmolLM2-135M's products as (inputs, outputs): q/k/v fused (576 -> 960), o (576 -> 576),
# gate/up fused (576 -> 3072), down (1536 -> 576), k or v alone (576 -> 192), the LM head.
SHAPES = ((576, 1536), (1536, 576), (576, 192), (576, 49152))
DTYPES = ("float32", "bfloat16", "int8", "int8/32", "w8a8")
ROWS = (1, 2, 4, 8, 16, 32)


def add_args(s) -> None:
    s.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in SHAPES],
                   help="IN x OUT products (default: SmolLM2's)")
    s.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    s.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    s.add_argument("--repeats", type=int, default=5, help="rounds over the copies (best)")
    s.add_argument("--cache-mib", type=int, default=32, help="last-level cache (default 32)")
    s.add_argument("--max-copies", type=int, default=256)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_weight(dtype: str, k: int, n: int, seed: int):
    """An output-major weight ``[n, k]`` as the model holds it: a float array, or a
    :class:`jspec.quant.QWeight` (``int8``: one scale per output; ``int8/32``: per 32 inputs;
    ``w8a8``: per output, the activations quantized per row inside the product)."""
    import jax.numpy as jnp
    from jspec.quant import QuantConfig, quantize_weight
    w = jnp.asarray(np.random.default_rng(seed).standard_normal((n, k), np.float32) * 0.05)
    if dtype in ("float32", "bfloat16"):
        return w.astype(dtype)
    qc = {"int8": QuantConfig("int8"), "int8/32": QuantConfig("int8", tile=32),
          "w8a8": QuantConfig("w8a8")}[dtype]
    return quantize_weight(w, qc, jnp.float32)


def nbytes(w) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(w))


def time_copies(fn, x, copies, repeats) -> float:
    """Best over ``repeats`` rounds of the mean seconds of one call, each round calling
    ``fn(x, w)`` once per copy in turn."""
    import jax
    jax.block_until_ready([fn(x, w) for w in copies[:2]])
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in copies:
            y = fn(x, w)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - t0) / len(copies))
    return best


def measure(k, n, dtype, rows, repeats, cache_bytes, max_copies) -> dict:
    """Seconds per product, dispatch removed, for each form and row count."""
    import jax
    import jax.numpy as jnp
    from cpu_kernels.few_row_product import available as kernel_available, rows_product
    from jspec.quant.product import xla_products
    from jspec.serving_layout import linear
    one = make_weight(dtype, k, n, 0)
    count = int(min(max_copies, max(2, np.ceil(2 * cache_bytes / nbytes(one)))))
    copies = [one] + [make_weight(dtype, k, n, s) for s in range(1, count)]
    empty = jax.jit(lambda x, w: x[0, 0])
    hi = jax.lax.Precision.HIGHEST if dtype == "float32" else None
    xdt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    out = {"bytes": nbytes(one), "copies": count}
    for m in rows:
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k), np.float32), xdt)
        overhead = time_copies(empty, x, copies, repeats)
        prod = lambda x, w: linear(x, w, hi)
        with xla_products():
            xla = jax.jit(prod).lower(x, one).compile()
        # fp32 weights keep XLA's product in the model (jspec.quant.product); the kernel's
        # column times the kernel itself.
        forms = {"xla": xla}
        if kernel_available():
            forms["kernel"] = jax.jit(rows_product if dtype == "float32" else prod).lower(
                x, one).compile()
        for form, fn in forms.items():
            out[form, m] = max(time_copies(fn, x, copies, repeats) - overhead, 1e-7)
    return out


def main(a) -> None:
    from benchmarks.memory_floor import read_bandwidth
    from jspec.quant.product import kernel_status
    bw = max(read_bandwidth(1024, 3).values())
    print(f"CPU: {cpu_name()}; DRAM read bandwidth {bw / 1e9:.1f} GB/s (a 1 GiB sum, best of "
          f"3); products: {kernel_status()}")
    print("ms per product (dispatch removed), GB/s of weight bytes read; each call streams a "
          f"weight not in the cache (copies x bytes >= 2 x {a.cache_mib} MiB, at most "
          f"{a.max_copies} copies)\n")
    head = (f"{'product':<12} {'dtype':<9} {'MB':>6} {'rows':>4} {'xla ms':>8} {'GB/s':>6} "
            f"{'kern ms':>8} {'GB/s':>6} {'speedup':>7} {'kern/1row':>9}")
    print(head)
    for shape in a.shapes:
        k, n = (int(v) for v in shape.lower().split("x"))
        for dtype in a.dtype:
            r = measure(k, n, dtype, a.rows, a.repeats, a.cache_mib << 20, a.max_copies)
            mb = r["bytes"] / 1e6
            t1 = r.get(("kernel", 1))
            for m in a.rows:
                tx, tk = r["xla", m], r.get(("kernel", m))
                rel = f"{tk / t1:9.2f}" if tk and t1 else f"{'-':>9}"
                kern = (f"{tk * 1e3:8.3f} {r['bytes'] / tk / 1e9:6.1f} {tx / tk:6.2f}x {rel}"
                        if tk else f"{'-':>8} {'-':>6} {'-':>7} {rel}")
                print(f"{shape:<12} {dtype:<9} {mb:6.2f} {m:4d} {tx * 1e3:8.3f} "
                      f"{r['bytes'] / tx / 1e9:6.1f} {kern}", flush=True)


COMMAND = Command("products", "every SmolLM2 weight product per dtype and row count: XLA's "
                  "forms against the few-row CPU kernel, ms and GB/s beside the DRAM bandwidth",
                  add_args, main, description=__doc__)

if __name__ == "__main__":
    run_module(COMMAND)
