"""Budgets on the compiled decode programs (``python -m jspec.bench anatomy``), and a CLI smoke test.

Nothing is timed: the programs are compiled from abstract inputs and their optimized HLO,
cost analysis and memory analysis are read (see :mod:`benchmarks.hlo` for the
counting rule). A budget fails when a change makes a program bigger than it is allowed to be.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import anatomy, hlo, hlo_bytes
from jspec.bench import configs
from jspec.bench.__main__ import main as bench_main
from jspec.spec_config import SpecConfig

# ---------------------------------------------------------------------------------------------
# BUDGETS: upper bounds, set a little above what the code measured when this test was written
# (tiny config, batch 2, context 64, CPU, jax 0.10.2). Measured at 79ec670 (packed, scanned
# layer stack; drafter window instead of a pool copy), and in brackets at 8da0781 (before it).
# Tighten them as optimisations land; never loosen one without saying why in the commit.
#   *_per_layer: kernels in the compiled program / target layers (kernel rule: hlo.py;
#                a scanned layer stack's body counts once, so this is not "per layer" literally)
#   *_bytes_x:   XLA "bytes accessed" of one speculative iteration / that of one plain step
# ---------------------------------------------------------------------------------------------
BUDGETS = {
    "plain_step_kernels_per_layer": 38,           # measured 35.5  [47.0]
    # eagle3 (5, 4, 8); measured 144.0 [151.0]; 152.5 at 9968721, whose per-iteration
    # accept-by-position bookkeeping (jspec.position_stats: a bucket search and a scatter-add
    # into [B, 10, 2]) the issue asked for: loosened to 154 for it. Loosened again to 166
    # (measured 164.5; chain 140.5 -> 156.0) when the layer stack began to stop at the aux
    # layers instead of writing an aux buffer in every layer (jspec.llama.forward): this
    # config's 2 layers with aux (1, 1, 0) are now two inline layers, both counted, where
    # one loop body counted once before. At 8B on v5p the same change takes the iteration's
    # layer body from 15 kernels to 13 and its HBM bytes down 103 MB (the chain).
    "tree_iteration_kernels_per_layer": 166,
    "chain_iteration_kernels_per_layer": 158,     # eagle3 (4, 1, 5); measured 156.0 [140.5 before]
    # XLA's bytes accessed count a loop body once, so the unrolled stack above (both layers
    # counted) raised them: tree 4.29 -> 5.69, chain 3.45 -> 4.16; the loop-weighted count
    # (io_MB) fell at the same time, 9.88 -> 9.81 and 6.11 -> 6.07 MB. Loosened for that.
    "tree_iteration_bytes_x": 5.8,                # measured 5.69  [3.67: the plain step shrank more]
    "chain_iteration_bytes_x": 4.3,               # measured 4.16  [2.98]
}

CFG = configs.random_config("tiny")
BATCH, CONTEXT = 2, 64
TREE, CHAIN = SpecConfig(5, 4, 8), SpecConfig(4, 1, 5)


# The programs users get, whatever XLA_FLAGS the test run sets (see anatomy.DEFAULT_CPU_OPTIONS).
OPTIONS = anatomy.DEFAULT_CPU_OPTIONS if jax.default_backend() == "cpu" else None


def _rows(result):
    return {r["program"]: r for r in result["rows"]}


@pytest.fixture(scope="module")
def tree():
    return _rows(anatomy.anatomy(CFG, "eagle3", TREE, BATCH, CONTEXT,
                                 programs=("plain_step", "iteration"), compiler_options=OPTIONS))


@pytest.fixture(scope="module")
def chain(tree):
    rows = _rows(anatomy.anatomy(CFG, "eagle3", CHAIN, BATCH, CONTEXT, programs=("iteration",),
                                 compiler_options=OPTIONS))
    base = tree["plain_step"]           # the plain step does not depend on the spec knobs
    rows["iteration"]["bytes_x"] = rows["iteration"]["bytes"] / base["bytes"]
    return {"plain_step": base, **rows}


def test_plain_step_kernels(tree):
    r = tree["plain_step"]
    assert r["kernels"] / CFG.num_layers == r["per_layer"]
    assert r["per_layer"] <= BUDGETS["plain_step_kernels_per_layer"], r


@pytest.mark.parametrize("name", ["tree", "chain"])
def test_iteration_kernels_and_bytes(name, request):
    rows = request.getfixturevalue(name)
    it = rows["iteration"]
    assert it["per_layer"] <= BUDGETS[f"{name}_iteration_kernels_per_layer"], it
    assert it["bytes_x"] <= BUDGETS[f"{name}_iteration_bytes_x"], it
    assert it["bytes_x"] > 1.0          # an iteration does at least one target forward


# At 8da0781 the iteration copied the whole draft pool (k and v) every time: the drafter's tree
# loop carried the pool through a lax.scan while extend still needed the original. 79ec670 keeps
# the loop's transient KV in a dense window instead; this guards it.
@pytest.mark.parametrize("name, program", [("tree", "plain_step"), ("tree", "iteration"),
                                           ("chain", "iteration")])
def test_no_full_pool_copy(name, program, request):
    r = request.getfixturevalue(name)[program]
    assert r["pool_copies"] == 0, r


def test_count_kernels_rule():
    """While bodies count once (kernels); dot flops can be weighted by trip counts; copies of
    the given shape count as pool copies."""
    def f(n):
        return lambda x, y: jax.lax.fori_loop(0, n, lambda i, c: c @ y + 1, x).sum()

    sds = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    text = jax.jit(f(3)).lower(sds, sds).compile().as_text()
    one = hlo.count_kernels(text)
    assert one["while_loops"] == 1 and one["kernels"] >= 3
    text30 = jax.jit(f(30)).lower(sds, sds).compile().as_text()
    assert hlo.count_kernels(text30) == one
    # Dot flops: a loop body once (as XLA's cost analysis), or weighted by its trip count.
    assert hlo.dot_flops(text) == {"once": 2 * 8 ** 3, "weighted": 3 * 2 * 8 ** 3}
    assert hlo.dot_flops(text30)["weighted"] == 30 * 2 * 8 ** 3
    # x is not donated, so the loop's carry starts from a copy of it: an [8, 8] f32 "pool".
    assert hlo.count_kernels(text, [("f32", (8, 8))])["pool_copies"] >= 1
    assert hlo.count_kernels(text, [("f32", (9, 8))])["pool_copies"] == 0


def test_count_kernels_counts_the_biggest_branch():
    """One branch of a conditional runs, so its kernels count as the biggest branch's."""
    def f(branches):
        return lambda i, x: jax.lax.switch(i, branches, x)

    small = lambda x: jnp.sin(x @ x)
    big = lambda x: jnp.sin(jnp.cos(x @ x) @ x) @ x
    i = jax.ShapeDtypeStruct((), jnp.int32)
    sds = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    count = lambda fn: hlo.count_kernels(jax.jit(fn).lower(i, sds).compile().as_text())["kernels"]
    n_big, n_small = count(f([big, big])), count(f([small, small]))
    assert n_big > n_small
    assert count(f([small, big])) == count(f([big, small])) == n_big
    flops = lambda fn: hlo.dot_flops(jax.jit(fn).lower(i, sds).compile().as_text())
    assert flops(f([small, big])) == flops(f([big, small])) == flops(f([big, big]))
    assert flops(f([big, big]))["once"] == 3 * 2 * 8 ** 3


def test_kernel_bytes_charges_slices_in_place_writes_and_loops():
    """Sliced reads are charged the slice, an in-place update its update (not the buffer),
    a loop body its trip count times."""
    big = jax.ShapeDtypeStruct((64, 1024), jnp.float32)          # 256 KiB
    i = jax.ShapeDtypeStruct((), jnp.int32)
    row = 1024 * 4

    def io(fn, *args, donate=()):
        text = jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()
        return hlo_bytes.kernel_bytes(text)

    read = io(lambda x, k: jax.lax.dynamic_slice_in_dim(x, k, 1) * 2.0, big, i)["weighted"]
    assert row <= read <= 3 * row + 64, read          # one row in, one out (not 256 KiB)
    write = io(lambda x, k: jax.lax.dynamic_update_slice_in_dim(x, jnp.ones((1, 1024)), k, 0),
               big, i, donate=(0,))["weighted"]
    assert row <= write <= 3 * row + 64, write
    whole = io(lambda x: x * 2.0, big)["weighted"]
    assert whole == 2 * 64 * row                       # read and written in full

    def loop(n):
        return lambda x: jax.lax.fori_loop(0, n, lambda j, c: c + jax.lax.dynamic_slice_in_dim(
            x, j, 1)[0], jnp.zeros((1024,)))
    two, ten = io(loop(2), big), io(loop(10), big)
    assert ten["once"] == two["once"]                  # a body once, as XLA's cost analysis
    body = (ten["weighted"] - two["weighted"]) / 8     # the carry and one row in, one out
    assert 3 * row <= body <= 3 * row + 64, body


def test_kernel_bytes_custom_calls_and_vmem():
    """A custom call's operand aliased to its output (the Pallas KV write) costs nothing, a
    KV pool operand costs one layer of it, and arrays in TPU VMEM (``S(1)``) are not HBM."""
    text = """HloModule m

ENTRY %main (p0: f32[4,256], p1: f32[8,1024], p2: f32[16]) -> (f32[4,256], f32[16]) {
  %p0 = f32[4,256]{1,0} parameter(0)
  %p1 = f32[8,1024]{1,0} parameter(1)
  %p2 = f32[16]{0} parameter(2)
  %w = f32[4,256]{1,0} custom-call(%p0, %p2), custom_call_target="write", output_to_operand_aliasing={{}: (0, {})}
  %a = f32[16]{0} custom-call(%p1, %p2), custom_call_target="attend"
  %v = f32[8,1024]{1,0:S(1)} copy-start(%p1)
  ROOT %t = (f32[4,256]{1,0}, f32[16]{0}) tuple(%w, %a)
}
"""
    pool = ("f32", (8, 1024))
    got = hlo_bytes.kernel_bytes(text, {pool: 8})["weighted"]
    write = 16 * 4                                     # only the new rows operand
    attend = 1024 * 4 + 16 * 4 + 16 * 4                # one of 8 layers, the rows, the result
    prefetch = 8 * 1024 * 4                            # read from HBM, written to VMEM
    assert got == write + attend + prefetch
    assert hlo_bytes.kernel_bytes(text)["weighted"] == write + 8 * 1024 * 4 + 16 * 4 + 16 * 4 + prefetch


def test_kernel_bytes_looks_into_nested_fusions():
    """XLA:TPU nests fusions: a stacked weight dynamically sliced inside an inner fusion is
    charged the slice; one an inner fusion hands on whole (a bitcast root) is charged whole."""
    text = """HloModule m

%inner_slice (a: f32[32,16], i: s32[]) -> f32[1,16] {
  %a = f32[32,16]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,16]{1,0} dynamic-slice(%a, %i, %z), dynamic_slice_sizes={1,16}
}

%inner_pass (b: f32[8,8]) -> f32[64] {
  %b = f32[8,8]{1,0} parameter(0)
  ROOT %bc = f32[64]{0} bitcast(%b)
}

%outer (p0: f32[32,16], p1: s32[], p2: f32[8,8]) -> (f32[1,16], f32[64]) {
  %p0 = f32[32,16]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[8,8]{1,0} parameter(2)
  %s = f32[1,16]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%inner_slice
  %w = f32[64]{0} fusion(%p2), kind=kLoop, calls=%inner_pass
  ROOT %t = (f32[1,16]{1,0}, f32[64]{0}) tuple(%s, %w)
}

ENTRY %main (x: f32[32,16], i: s32[], y: f32[8,8]) -> (f32[1,16], f32[64]) {
  %x = f32[32,16]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %y = f32[8,8]{1,0} parameter(2)
  ROOT %f = (f32[1,16]{1,0}, f32[64]{0}) fusion(%x, %i, %y), kind=kLoop, calls=%outer
}
"""
    written = (16 + 64) * 4
    read = 16 * 4 + 4 + 64 * 4                         # the slice, the index, y whole
    assert hlo_bytes.kernel_bytes(text)["weighted"] == written + read


def test_kernel_bytes_sees_through_a_relayout_before_the_slice():
    """XLA:TPU relayouts a stacked int8 weight in a copy fusion nested inside the matmul's
    fusion, then slices one layer out of the copy: charged the layer, not the whole stack.
    float8 elements are one byte."""
    text = """HloModule m

%relayout (a: s8[32,16]) -> s8[32,16] {
  %a = s8[32,16]{1,0:T(32,128)(4,1)} parameter(0)
  ROOT %c = s8[32,16]{1,0:T(8,128)(4,1)} copy(%a)
}

%dequant (w: s8[32,16], i: s32[]) -> f8e4m3fn[1,16] {
  %w = s8[32,16]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %r = s8[32,16]{1,0} fusion(%w), kind=kLoop, output_to_operand_aliasing={{}: (0, {})}, calls=%relayout
  %ds = s8[1,16]{1,0} dynamic-slice(%r, %i, %z), dynamic_slice_sizes={1,16}
  ROOT %cv = f8e4m3fn[1,16]{1,0} convert(%ds)
}

ENTRY %main (x: s8[32,16], i: s32[]) -> f8e4m3fn[1,16] {
  %x = s8[32,16]{1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = f8e4m3fn[1,16]{1,0} fusion(%x, %i), kind=kLoop, calls=%dequant
}
"""
    assert hlo_bytes.kernel_bytes(text)["weighted"] == 16 + 4 + 16    # a row, the index, out
    assert hlo_bytes._hbm_bytes("(f8e4m3fn[4,4]{1,0}, f8e5m2[2])") == 18
    assert hlo.shape_key("f8e4m3fn[2,3]{1,0}") == ("f8e4m3fn", (2, 3))


def test_cli_smoke(tmp_path, capsys):
    out = tmp_path / "anatomy.json"
    bench_main(["anatomy", "--random-config", "tiny", "--drafter", "eagle3", "--spec", "2,1,3",
                "--batch", "1", "--context", "16", "--programs", "plain_step",
                "--json", str(out)])
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.lstrip().startswith("program"))
    for c in anatomy.COLUMNS:
        assert c in header
    data = json.loads(out.read_text())
    assert [r["program"] for r in data["rows"]] == ["plain_step"]
    assert data["info"]["spec"] == [2, 1, 3] and data["info"]["config"] == "tiny"
    assert data["rows"][0]["bytes_x"] == 1.0 and data["rows"][0]["compile_s"] > 0
    assert set(data["info"]["pool_shapes"]) == {"plain target", "target", "draft"}


def test_llama3_8b_config():
    cfg = configs.random_config("llama3-8b", configs.natural_dtype("llama3-8b"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == (128256, 4096, 32, 8)
    assert cfg.dtype == "bfloat16" and configs.natural_dtype("tiny") == "float32"
    assert configs.random_config("llama3-8b").dtype == "float32"
    n = sum(x.size for x in jax.tree.leaves(anatomy.abstract_target_params(cfg)))
    assert 8.0e9 < n < 8.1e9          # 8.03B parameters, none allocated
