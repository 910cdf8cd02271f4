"""``python -m jspec.bench aot-kernels``: the Pallas kernels compiled for real accelerators,
without one (deviceless AOT, :mod:`jspec.aot`; nothing runs).

For each target (TPU v5e, v6e, v5p: Mosaic; the H200: Triton) and each configuration:

- tree attention (:mod:`pallas_kernels.tree_attention`) over N tree nodes, page sizes, GQA
  groups G (``H = KVH * G`` with KVH = 8 KV heads, as Llama-3-8B; batch 4, a 1024-token
  context; pools of 32 layers, fewer when they would pass 4 GiB), head dims and dtypes, called
  as the library does (:class:`jspec.kernels.KernelAttention`): the stacked pools
  ``[L, KVH, P, page_size, D]``, a traced layer index, the layer-independent inputs
  prepared once (``row_inputs``), the packed mask words of :func:`jspec.tree.build.pack_mask`;
- the TPU KV write (:mod:`pallas_kernels.kv_write`) over T tokens, page sizes, GQA groups and
  dtypes, as a layer calls it: the rotated ``[B, KVH, (G + 2) * T, D]`` block into the stacked
  pools at a traced layer (TPU targets only; the GPU keeps XLA's scatter);
- the verify walks (:mod:`pallas_kernels.verify_walk`), greedy and sampling, at the tree
  shapes of the EAGLE-3 default (N = 8, S = 5) and the widest tree (N = 64), sampling at
  Llama-3's and Llama-2's vocabularies (and at the largest vocabulary its validation accepts),
  with the ``impl`` that ``"auto"`` resolves to on the device.

Each cell is ``compiled`` (with the seconds of trace + lower + compile), ``failed`` (the first
line of the compiler's error), ``refused`` (the kernel's own ``validate`` rejects it: the
library never calls it so) or ``absent`` (no compiler for the target here). A cell that
``validate`` accepts and the compiler refuses is a bug in the kernel or in its validation.

GPU targets compile in a subprocess with ``$JSPEC_GPU_AOT_PYTHON`` when this interpreter has
no CUDA plugin (see :mod:`jspec.aot`: the plugin is kept out of the main environment).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import jax.numpy as jnp

from jspec import aot
from jspec.bench.common import format_table, write_json
from jspec.bench.registry import Command, run_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # where -m finds benchmarks

TREE_NODES = (1, 8, 64)
PAGE_SIZES = (16, 32)
GROUPS = (1, 4)
HEAD_DIMS = {"tpu": (128,), "gpu": (64, 128)}
DTYPES = ("float32", "bfloat16")
WALK_TREES = ((8, 5), (64, 10))                 # (N, S): EAGLE-3's default tree; the widest
VOCABS = (128256, 32000)                        # Llama-3, Llama-2
KV_HEADS, LAYERS, BATCH, CONTEXT = 8, 32, 4, 1024
POOL_BYTES = 4 << 30          # K + V pools at most (fewer layers for huge pages / head dims)
COLUMNS = ["target", "kernel", "config", "status", "compile_s", "error"]


def tree_cells(nodes=TREE_NODES, page_sizes=PAGE_SIZES, groups=GROUPS, head_dims=None,
               dtypes=DTYPES, platform="tpu") -> list[dict]:
    head_dims = head_dims or HEAD_DIMS[platform]
    return [tree_cell(*c) for c in itertools.product(nodes, page_sizes, groups, head_dims, dtypes)]


def kv_write_cells(tokens=TREE_NODES, page_sizes=PAGE_SIZES, groups=GROUPS, dtypes=DTYPES,
                   platform="tpu") -> list[dict]:
    if platform != "tpu":
        return []
    return [{"kernel": "kv_write", "T": t, "page_size": ps, "G": g, "head_dim": 128, "dtype": dt}
            for t, ps, g, dt in itertools.product(tokens, page_sizes, groups, dtypes)]


def walk_cells(trees=WALK_TREES, vocabs=VOCABS, platform="tpu", limit=True) -> list[dict]:
    """Both walks per tree; the sampling walk per vocabulary (plus, with ``limit``, the largest
    vocabulary the platform's validation accepts)."""
    from pallas_kernels.verify_walk import dispatch
    vocabs = tuple(vocabs) + ((dispatch.MAX_VOCAB_TPU if platform == "tpu" else dispatch.MAX_VOCAB_GPU,)
                              if limit else ())
    cells = []
    for n, s in trees:
        cells.append({"kernel": "walk_greedy", "N": n, "S": s})
        cells += [{"kernel": "walk_sample", "N": n, "S": s, "V": v} for v in vocabs]
    return cells


def edge_cells(platform: str) -> list[dict]:
    """The edges of what validation accepts, beyond the default matrix (``--edges``): other
    head dims (including ones the platform refuses), page sizes from 8 to 256, odd N and the
    mask-word boundaries, GQA up to 64 at N = 64 (Llama-3-70B's 8; 64 query heads on one KV
    head, as multi-query attention), head dim 256
    with wide GQA; the walks at N = 1, 2, 6, 64 (S up to 63), V = 1, 50257, 151936."""
    cells = []
    for dt in DTYPES:
        cells += [tree_cell(8, 16, 4, d, dt) for d in ((64, 256) if platform == "tpu" else (16, 32, 256))]
        cells += [tree_cell(8, ps, 4, 128, dt) for ps in (8, 64, 128, 256)]
        cells += [tree_cell(n, 16, 4, 128, dt) for n in (2, 6, 17, 32, 33, 63)]
        cells += [tree_cell(64, 16, g, 128, dt) for g in (2, 8, 16, 64)]
        cells += [tree_cell(64, ps, 8, 256, dt) for ps in (16, 128)]
        if platform == "tpu":       # page sizes past the tile, odd block lengths, wide GQA, D 256
            cells += [{"kernel": "kv_write", "T": t, "page_size": ps, "G": g, "head_dim": d, "dtype": dt}
                      for t, ps, g, d in ((8, 8, 4, 128), (8, 128, 4, 128), (17, 16, 4, 128),
                                          (33, 16, 4, 128), (64, 16, 8, 128), (8, 16, 4, 256))]
    for n, s in ((1, 0), (2, 1), (6, 5), (64, 63)):
        cells.append({"kernel": "walk_greedy", "N": n, "S": s})
        cells += [{"kernel": "walk_sample", "N": n, "S": s, "V": v} for v in (1, 50257, 151936)]
    return cells


def tree_cell(n, ps, g, d, dt) -> dict:
    return {"kernel": "tree_attention", "N": n, "page_size": ps, "G": g, "head_dim": d, "dtype": dt}


def prefill_cells(platform: str) -> list[dict]:
    """A prefill chunk's attention as ``kernels="auto"`` picks it (jspec.prefill_attention):
    jax's ragged paged attention on TPU, 512-token chunks over a 8k context, Llama-3-8B's
    heads; cuDNN's on the GPU needs cuDNN at compile time, which the gpu-aot extra lacks."""
    if platform != "tpu":
        return []
    return [{"kernel": "prefill", "C": 512, "page_size": ps, "G": 4, "head_dim": 128,
             "dtype": dt} for ps in (16, 32) for dt in ("bfloat16", "float32")]


def default_cells(platform: str, edges: bool = False) -> list[dict]:
    return tree_cells(platform=platform) + kv_write_cells(platform=platform) + \
        walk_cells(platform=platform) + prefill_cells(platform) + \
        (edge_cells(platform) if edges else [])


def describe(cell: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cell.items() if k != "kernel")


def _row(target: str, cell: dict) -> dict:
    return {"target": target, "kernel": cell["kernel"], "config": describe(cell), **cell}


# ------------------------------------------------------------------ one cell
def _pool(page_size: int, D: int, dt) -> tuple[jax.ShapeDtypeStruct, int]:
    """One stacked pool ``[layers, KVH, P, page_size, D]`` for BATCH rows of CONTEXT (+ a tree)
    and a row's pages; fewer layers when K + V would pass POOL_BYTES (the pools fit any target)."""
    max_pages = -(-(CONTEXT + 64) // page_size)
    num_pages = BATCH * max_pages
    layer_bytes = 2 * KV_HEADS * num_pages * page_size * D * dt.itemsize
    layers = max(1, min(LAYERS, POOL_BYTES // layer_bytes))
    return jax.ShapeDtypeStruct((layers, KV_HEADS, num_pages, page_size, D), dt), max_pages


def _tree_program(cell: dict, backend: str):
    """(validate thunk, fn, abstract args) of one tree-attention call as the library makes it."""
    from jspec.tree.build import mask_dtype
    from pallas_kernels.tree_attention import tree_attention, validate
    from pallas_kernels.tree_attention.dispatch import row_inputs

    N, ps, G, D, dt = cell["N"], cell["page_size"], cell["G"], cell["head_dim"], jnp.dtype(cell["dtype"])
    pool, max_pages = _pool(ps, D, dt)
    wdt, words = mask_dtype(N)
    sds = jax.ShapeDtypeStruct
    args = (sds((BATCH, N, KV_HEADS * G, D), dt), pool, pool,
            sds((BATCH, max_pages), jnp.int32), sds((BATCH,), jnp.int32), sds((BATCH, N, words), wdt),
            sds((), jnp.int32))

    def fn(q, k, v, table, lengths, bits, layer):
        rows = row_inputs(q, k, table, bits, backend=backend)
        return tree_attention(q, k, v, table, lengths, bits, layer, backend=backend, prepared=rows)

    return (lambda: validate(*args, backend=backend)), fn, args


def _kv_write_program(cell: dict, backend: str):
    from pallas_kernels.kv_write import kv_write_tpu, validate
    T, ps, G, D, dt = cell["T"], cell["page_size"], cell["G"], cell["head_dim"], jnp.dtype(cell["dtype"])
    pool, _ = _pool(ps, D, dt)
    sds = jax.ShapeDtypeStruct
    args = (sds((BATCH, KV_HEADS, (G + 2) * T, D), dt), pool, pool, sds((BATCH * T,), jnp.int32),
            sds((), jnp.int32))
    kw = dict(T=T, k_row0=G * T, v_row0=(G + 1) * T)
    return (lambda: validate(*args[:3], **kw)), (lambda *a: kv_write_tpu(*a, **kw)), args


def _prefill_program(cell: dict, backend: str):
    """One layer's chunk attention over the pool, as the prefill's forward calls it."""
    from jspec import kv_cache as kvc
    from jspec.prefill_attention import PrefillAttention, problem
    C, ps, G, D, dt = cell["C"], cell["page_size"], cell["G"], cell["head_dim"], jnp.dtype(cell["dtype"])
    pool, max_pages = _pool(ps, D, dt)
    sds = jax.ShapeDtypeStruct
    args = (sds((BATCH, C, KV_HEADS * G, D), dt), pool, pool,
            sds((BATCH, max_pages), jnp.int32), sds((BATCH,), jnp.int32), sds((), jnp.int32))
    att = PrefillAttention("rpa")

    def fn(q, k, v, table, lengths, layer):
        cache = kvc.PagedKVCache(k_pages=k, v_pages=v, page_table=table, lengths=lengths,
                                 capacity=jnp.full(lengths.shape, max_pages * ps, jnp.int32))
        return att(q, cache, layer, att.prepare(cache, None, q))

    def check():
        why = problem("rpa", head_dim=D, dtype=dt, page_size=ps)
        if why:
            raise ValueError(why)
    return check, fn, args


def _walk_program(cell: dict, backend: str):
    from pallas_kernels.verify_walk import (validate_greedy, validate_sample, verify_walk_greedy,
                                            verify_walk_sample)
    N, S = cell["N"], cell["S"]
    ints = jax.ShapeDtypeStruct((BATCH, N), jnp.int32)
    if cell["kernel"] == "walk_greedy":
        args = (ints,) * 4
        return (lambda: validate_greedy(*args, S),
                lambda *a: verify_walk_greedy(*a, max_depth=S, impl=backend), args)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    args = (ints, ints, ints, f32(BATCH, N, cell["V"]), f32(BATCH, N), f32(BATCH))
    return (lambda: validate_sample(*args, S, impl=backend),
            lambda *a: verify_walk_sample(*a, max_depth=S, impl=backend), args)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def compile_cell(cell: dict, target: str, device) -> dict:
    """Validate, then compile one cell for ``device`` (an abstract device of ``target``)."""
    backend = aot.target(target).platform
    build = {"tree_attention": _tree_program, "kv_write": _kv_write_program,
             "prefill": _prefill_program}.get(cell["kernel"], _walk_program)
    check, fn, args = build(cell, backend)
    row = _row(target, cell)
    try:
        check()
    except ValueError as e:
        return {**row, "status": "refused", "error": _first_line(e)}
    t0 = time.perf_counter()
    try:
        # Under a mesh of the target's device: kernels that ask the device kind while tracing
        # (ragged_paged_attention's block sizes) read the abstract device's, not the host's.
        with jax.sharding.set_mesh(jax.sharding.Mesh(np.array([device]), ("x",))):
            jax.jit(fn).trace(*aot.placed(args, device)).lower().compile()
    except Exception as e:     # the compiler's refusal, whatever its type
        return {**row, "status": "failed", "compile_s": time.perf_counter() - t0,
                "error": _first_line(e), "error_text": str(e)[:4000]}
    return {**row, "status": "compiled", "compile_s": time.perf_counter() - t0}


# ------------------------------------------------------------------ a target's matrix
def compile_matrix(target: str, cells: list[dict], progress=None) -> list[dict]:
    """Every cell for ``target`` in this interpreter (``absent`` rows when its compiler is)."""
    try:
        device = aot.device(target)
    except aot.CompilerMissing as e:
        return [{**_row(target, c), "status": "absent", "error": str(e)} for c in cells]
    rows = []
    for cell in cells:
        rows.append(compile_cell(cell, target, device))
        if progress:
            progress(rows[-1])
        jax.clear_caches()        # one program per cell: hold none of them
    return rows


def compile_matrix_in(python: str, target: str, cells: list[dict], timeout: float | None = None,
                      echo: bool = False) -> list[dict]:
    """:func:`compile_matrix` in another interpreter (one with the target's compiler)."""
    with tempfile.TemporaryDirectory(prefix="jspec-aot-") as d:
        spec, out = os.path.join(d, "cells.json"), os.path.join(d, "rows.json")
        with open(spec, "w") as f:
            json.dump(cells, f)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
        env.pop(aot.GPU_PYTHON_ENV, None)            # no further hop
        cmd = [python, "-m", "jspec.bench", "aot-kernels", "--targets", target,
               "--cells", spec, "--json", out, "--quiet"] + ([] if echo else ["--no-progress"])
        proc = subprocess.run(cmd, env=env, timeout=timeout, text=True, stderr=subprocess.PIPE,
                              stdout=None if echo else subprocess.PIPE, cwd=ROOT)
        if proc.returncode not in (0, 1) or not os.path.exists(out):     # 1: a cell failed
            tail = (proc.stderr or "")[-2000:]
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {tail}")
        with open(out) as f:
            return json.load(f)["rows"]


def run_target(target: str, cells: list[dict], progress=None) -> list[dict]:
    """Here when this interpreter has the compiler; GPU targets otherwise in
    ``$JSPEC_GPU_AOT_PYTHON`` (which prints its own progress lines when ``progress`` is set)."""
    python = aot.gpu_python() if aot.target(target).platform == "gpu" else None
    if aot.missing(target) and python and python != sys.executable:
        return compile_matrix_in(python, target, cells, echo=progress is not None)
    return compile_matrix(target, cells, progress)


def counts(rows: list[dict]) -> dict:
    """Per target: how many cells compiled, failed, were refused by validation, or had no compiler."""
    out: dict = {}
    for r in rows:
        c = out.setdefault(r["target"], {"compiled": 0, "failed": 0, "refused": 0, "absent": 0,
                                         "compile_s": 0.0})
        c[r["status"]] += 1
        c["compile_s"] += r.get("compile_s") or 0.0
    return out


# ------------------------------------------------------------------ CLI
def _progress(r: dict) -> None:
    print(f"   {r['target']:<5} {r['kernel']:<14} {r['config']:<52} {r['status']:<8} "
          f"{r.get('compile_s', 0.0):6.1f}s {r.get('error', '')[:120]}", flush=True)


def add_args(p) -> None:
    p.add_argument("--targets", nargs="+", choices=sorted(aot.TARGETS), default=["v5e", "v6e", "v5p", "h200"])
    p.add_argument("--kernels", nargs="+", choices=["tree_attention", "kv_write", "walk_greedy", "walk_sample",
                                                    "prefill"],
                   default=None, help="a subset of the kernels (default: all)")
    p.add_argument("--edges", action="store_true",
                   help="also the edges of what validation accepts (see edge_cells; slower)")
    p.add_argument("--cells", metavar="JSON", default=None,
                   help="compile exactly these cells (a JSON list of cell dicts) for every target")
    p.add_argument("--json", metavar="OUT", help="also write the rows and counts as JSON")
    p.add_argument("--quiet", action="store_true", help="no tables (with --json)")
    p.add_argument("--no-progress", action="store_true", help="no line per cell as it compiles")


def main(args) -> int:
    """The matrix; exits with status 1 when a cell failed to compile (0 otherwise)."""
    say = (lambda *a, **k: None) if args.quiet else print
    fixed = None
    if args.cells:
        with open(args.cells) as f:
            fixed = json.load(f)
    t0 = time.perf_counter()
    rows = []
    for target in args.targets:
        cells = fixed if fixed is not None else default_cells(aot.target(target).platform, args.edges)
        if args.kernels:
            cells = [c for c in cells if c["kernel"] in args.kernels]
        if not (args.no_progress or args.quiet):        # (a subprocess's parent printed it)
            print(f"-- {target}: {len(cells)} cells", flush=True)
        rows += run_target(target, cells, progress=None if args.no_progress else _progress)
    wall = time.perf_counter() - t0
    summary = counts(rows)
    say()
    say(format_table([{**r, "error": r.get("error", "")[:100]} for r in rows], COLUMNS))
    say()
    say(format_table([{"target": t, **c} for t, c in summary.items()],
                     ["target", "compiled", "failed", "refused", "absent", "compile_s"]))
    say(f"\nwall {wall:.1f} s")
    if args.json:
        write_json(args.json, {"rows": rows, "counts": summary, "wall_s": wall,
                               "jax": jax.__version__, "argv": sys.argv})
    if any(c["failed"] for c in summary.values()):
        raise SystemExit(1)
    return 0


COMMAND = Command("aot-kernels", "the Pallas kernels compiled deviceless for TPU v5e/v6e/v5p and "
                                 "the H200, cell by cell", add_args, main, description=__doc__)

if __name__ == "__main__":
    run_module(COMMAND)
