"""Verify-walk kernels (pallas_kernels/verify_walk) against the jnp references.

Kernels run in Pallas interpret mode on CPU (TPU kernel under ``pltpu.InterpretParams``,
which simulates SMEM/VMEM/DMA and raises on out-of-bounds reads; GPU kernel under the
HLO interpreter). Each case packs several random trees of different shapes into one
ragged batch so that one compile covers many trees. Lowering tests cross-lower the
kernels for TPU (Mosaic) and CUDA (Triton) from this CPU-only machine.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.tree.build import build_tree
from pallas_kernels.verify_walk import (from_tree, greedy_walk_ref, parents_from_lists,
                                        sample_walk_ref, verify_walk_greedy, verify_walk_sample)
from pallas_kernels.verify_walk import kernel as K

KERNEL_IMPLS = ("tpu_interpret", "gpu_interpret")
TOKENS = 3          # tiny token alphabet: duplicate sibling tokens and frequent matches


def random_parents(rng, n: int, max_depth: int, kind: str) -> np.ndarray:
    """Topologically ordered parents with depth <= max_depth; root 0 has parent -1."""
    parents = np.full(n, -1, np.int32)
    depth = np.zeros(n, np.int32)
    for i in range(1, n):
        if kind == "chain":
            cands = [i - 1] if depth[i - 1] < max_depth else []
        elif kind == "star":
            cands = [0] if max_depth >= 1 else []
        else:
            cands = [j for j in range(i) if depth[j] < max_depth and parents[j] != -2]
            if kind == "orphans" and rng.random() < 0.2:
                cands = []          # a node whose parent was dropped: parent -1
        if cands:
            p = cands[rng.integers(len(cands))] if kind in ("random", "orphans") else cands[0]
            parents[i], depth[i] = p, depth[p] + 1
    return parents


def random_trees(seed: int, batch: int, n: int, max_depth: int):
    rng = np.random.default_rng(seed)
    kinds = ["random", "chain", "star", "orphans"]
    parents = np.stack([random_parents(rng, n, max_depth, kinds[b % 4]) for b in range(batch)])
    tokens = rng.integers(0, TOKENS, (batch, n)).astype(np.int32)
    tree = _build(jnp.asarray(tokens), jnp.asarray(parents), max_depth)
    return rng, tree, parents


_build = jax.jit(build_tree, static_argnums=2)


def greedy_argmax(rng, tokens, parents):
    """The target's argmax: usually the token of one of the node's children."""
    B, N = tokens.shape
    am = rng.integers(0, TOKENS + 1, (B, N)).astype(np.int32)
    for b in range(B):
        for i in range(N):
            kids = np.flatnonzero(parents[b] == i)
            if len(kids) and rng.random() < 0.85:
                am[b, i] = tokens[b, kids[rng.integers(len(kids))]]
    return jnp.asarray(am)


def dyadic_probs(rng, B, N, V):
    """Probabilities that are multiples of 2^-10 (sums exact in any order), with most
    mass on the draft alphabet so that acceptances happen, and some exact zeros."""
    counts = rng.integers(0, 6, (B, N, V))
    counts[..., :TOKENS] += rng.integers(0, 400, (B, N, TOKENS))
    counts *= rng.random((B, N, V)) < 0.7
    return jnp.asarray(counts / 1024.0, jnp.float32)


def assert_same(out, ref, what=""):
    for name, a, b in zip(("accept_index", "accept_len", "bonus"), out, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what} {name}")


# (N, S): N in {1, 4, 8, 16, 64}; S below, at and beyond the deepest possible node (N - 1).
SHAPES = [(1, 2), (4, 2), (8, 9), (16, 4), (64, 7)]
B = 8


def test_parents_from_lists_roundtrip():
    for seed, (n, s) in enumerate(SHAPES):
        _, tree, parents = random_trees(seed, B, n, s)
        np.testing.assert_array_equal(parents_from_lists(tree.first_child, tree.next_sibling),
                                      parents)


def test_references_are_jspec_walks():
    """The signature-adapting references are jspec.verify's walks on the original tree."""
    from jspec.verify import greedy_walk, tree_sample_walk
    n, s, v = 16, 4, 1000
    rng, tree, parents = random_trees(11, B, n, s)
    am = greedy_argmax(rng, np.asarray(tree.tokens), parents)
    assert_same(greedy_walk_ref(*from_tree(tree), am, max_depth=s), greedy_walk(tree, am, s))
    probs = dyadic_probs(rng, B, n, v)
    ua = jnp.asarray(rng.random((B, n)), jnp.float32)
    ub = jnp.asarray(rng.random(B), jnp.float32)
    assert_same(sample_walk_ref(*from_tree(tree), probs, ua, ub, max_depth=s),
                tree_sample_walk(tree, probs, ua, ub, s))


@pytest.mark.parametrize("n,s", SHAPES)
def test_greedy_matches_reference(n, s):
    rng, tree, parents = random_trees(100 + n * 7 + s, B, n, s)
    am = greedy_argmax(rng, np.asarray(tree.tokens), parents)
    ref = greedy_walk_ref(*from_tree(tree), am, max_depth=s)
    if n > 1:   # the case generator must actually exercise acceptance
        assert int(jnp.max(ref[1])) > 1
    for impl in KERNEL_IMPLS:
        assert_same(verify_walk_greedy(*from_tree(tree), am, max_depth=s, impl=impl), ref, impl)


# (N, S, V): V a multiple of 128 or not, S at / beyond the tree depth.
SAMPLE_SHAPES = [(1, 0, 5), (4, 3, 200), (8, 5, 128), (16, 4, 1000), (64, 7, 300)]


def _uniforms(rng, n):
    return (jnp.asarray(rng.random((B, n)), jnp.float32),
            jnp.asarray(rng.random(B), jnp.float32))


@pytest.mark.parametrize("n,s,v", SAMPLE_SHAPES)
def test_sample_matches_reference(n, s, v):
    rng, tree, _ = random_trees(200 + n * 7 + s, B, n, s)
    probs = dyadic_probs(rng, B, n, v)
    ua, ub = _uniforms(rng, n)
    ref = sample_walk_ref(*from_tree(tree), probs, ua, ub, max_depth=s)
    if n > 1:
        assert int(jnp.max(ref[1])) > 1
    last = np.asarray(ref[0])[np.arange(B), np.asarray(ref[1]) - 1]
    assert np.all(np.asarray(probs)[np.arange(B), last, np.asarray(ref[2])] > 0)
    for impl in KERNEL_IMPLS:
        out = verify_walk_sample(*from_tree(tree), probs, ua, ub, max_depth=s, impl=impl)
        assert_same(out, ref, impl)


def test_sample_softmax_probs():
    """General (non-dyadic) probabilities: sums are rounded in different orders; with
    these fixed draws no uniform lies within rounding of a boundary, so all agree.
    (Shapes reuse a case above, so the kernels are not compiled again.)"""
    n, s, v = 16, 4, 1000
    rng, tree, _ = random_trees(7, B, n, s)
    logits = rng.normal(size=(B, n, v)) * 2.0
    logits[..., :TOKENS] += 7.0
    probs = jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    ua, ub = _uniforms(rng, n)
    ref = sample_walk_ref(*from_tree(tree), probs, ua, ub, max_depth=s)
    assert int(jnp.max(ref[1])) > 1
    for impl in KERNEL_IMPLS:
        out = verify_walk_sample(*from_tree(tree), probs, ua, ub, max_depth=s, impl=impl)
        assert_same(out, ref, impl)


def test_sample_edge_cases():
    """A child holding all the residual is accepted for any u < 1; u = 0 accepts any
    child with mass; a draft token without mass is always rejected; an all-zero residual
    draws V - 1 like categorical_from_uniform. Shapes reuse the (4, 3, 200) case."""
    n, s, v = 4, 3, 200
    tree = _build(jnp.asarray([[0, 1, 1, 2]] * B, jnp.int32),
                  jnp.asarray([[-1, 0, 0, 1]] * B, jnp.int32), s)
    p = np.zeros((B, n, v), np.float32)
    p[0, :, 1] = 1.0                 # row 0: node 1 takes all of the root's mass
    p[0, 1, 2] = 1.0                 #        node 3 (token 2) holds half of node 1's
    p[1, 0, 1] = 0.5                 # row 1: u = 0 accepts
    p[1, 0, 129] = 0.5
    p[1, 1, 2] = 0.25
    p[1, 1, 7] = 0.75
    p[2, 0, 5] = 1.0                 # row 2: draft token 1 has no mass: both rejected
    p[4:] = p[:4]                    # rows 4..7 repeat 0..3 with other uniforms
    probs = jnp.asarray(p)           # row 3: all-zero distribution
    ua = np.asarray([[0.5, 0.999999, 0.5, 0.25], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    ua = jnp.asarray(np.concatenate([ua, 1 - ua * 0.5 - 0.4]), jnp.float32)
    ub = jnp.asarray([0.3, 0.999999, 0.0, 0.5, 0.9, 0.1, 0.7, 0.0], jnp.float32)
    ref = sample_walk_ref(*from_tree(tree), probs, ua, ub, max_depth=s)
    np.testing.assert_array_equal(np.asarray(ref[1])[:4], [3, 3, 1, 1])
    np.testing.assert_array_equal(np.asarray(ref[2])[[2, 3]], [5, v - 1])
    for impl in KERNEL_IMPLS:
        out = verify_walk_sample(*from_tree(tree), probs, ua, ub, max_depth=s, impl=impl)
        assert_same(out, ref, impl)


def test_auto_on_cpu_is_reference():
    n, s = 16, 4
    rng, tree, parents = random_trees(3, B, n, s)
    am = greedy_argmax(rng, np.asarray(tree.tokens), parents)
    assert jax.default_backend() == "cpu"
    assert_same(verify_walk_greedy(*from_tree(tree), am, max_depth=s),
                greedy_walk_ref(*from_tree(tree), am, max_depth=s))


def test_dispatch_under_jit():
    n, s = 16, 4
    rng, tree, parents = random_trees(4, B, n, s)
    am = greedy_argmax(rng, np.asarray(tree.tokens), parents)
    f = jax.jit(lambda t, fc, ns, a: verify_walk_greedy(t, fc, ns, a, max_depth=s,
                                                        impl="gpu_interpret"))
    assert_same(f(*from_tree(tree), am), greedy_walk_ref(*from_tree(tree), am, max_depth=s))


# ------------------------------------------------------------------------ validation


def _ints(B, N, dtype=jnp.int32):
    return jnp.zeros((B, N), dtype)


@pytest.mark.parametrize("impl", ("tpu", "gpu", "reference", "tpu_interpret"))
def test_validation_errors(impl):
    z = _ints(2, 8)
    with pytest.raises(ValueError, match="N <= 64"):
        verify_walk_greedy(*(_ints(2, 65),) * 4, max_depth=3, impl=impl)
    with pytest.raises(ValueError, match="int32"):
        verify_walk_greedy(z, z, z, _ints(2, 8, jnp.uint32), max_depth=3, impl=impl)
    with pytest.raises(ValueError, match="int32"):
        verify_walk_greedy(z.astype(jnp.float32), z, z, z, max_depth=3, impl=impl)
    with pytest.raises(ValueError, match="shape"):
        verify_walk_greedy(z, z, _ints(2, 4), z, max_depth=3, impl=impl)
    with pytest.raises(ValueError, match="max_depth"):
        verify_walk_greedy(z, z, z, z, max_depth=-1, impl=impl)
    with pytest.raises(ValueError, match="max_depth"):
        verify_walk_greedy(z, z, z, z, max_depth=jnp.int32(3), impl=impl)
    u, ub = jnp.zeros((2, 8), jnp.float32), jnp.zeros((2,), jnp.float32)
    p = jnp.zeros((2, 8, 16), jnp.float32)
    with pytest.raises(ValueError, match="float32"):
        verify_walk_sample(z, z, z, p.astype(jnp.bfloat16), u, ub, max_depth=3, impl=impl)
    with pytest.raises(ValueError, match=r"\[B, N, V\]"):
        verify_walk_sample(z, z, z, jnp.zeros((2, 7, 16), jnp.float32), u, ub, max_depth=3,
                           impl=impl)
    with pytest.raises(ValueError, match="u_accept"):
        verify_walk_sample(z, z, z, p, u[:, :4], ub, max_depth=3, impl=impl)
    with pytest.raises(ValueError, match="u_bonus"):
        verify_walk_sample(z, z, z, p, u, ub.astype(jnp.float16), max_depth=3, impl=impl)
    with pytest.raises(ValueError, match="impl"):
        verify_walk_greedy(z, z, z, z, max_depth=3, impl="cpu")


def test_vocab_limit_is_static():
    """V beyond the TPU VMEM budget is refused at trace time (no allocation)."""
    f = lambda p: verify_walk_sample(jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 8), jnp.int32),
                                     jnp.zeros((2, 8), jnp.int32), p,
                                     jnp.zeros((2, 8), jnp.float32),
                                     jnp.zeros((2,), jnp.float32), max_depth=3, impl="tpu")
    with pytest.raises(ValueError, match="vocabulary size"):
        jax.eval_shape(f, jax.ShapeDtypeStruct((2, 8, (1 << 18) + 1), jnp.float32))


# ------------------------------------------------------------------------ lowering

B_L, N_L, S_L, V_L = 4, 64, 8, 128256       # Llama-3 vocabulary, the largest tree


def _lower(fn, args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _abstract_args(sample: bool, v: int = V_L):
    i32 = jax.ShapeDtypeStruct((B_L, N_L), jnp.int32)
    if not sample:
        return (i32,) * 4
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return (i32,) * 3 + (f32(B_L, N_L, v), f32(B_L, N_L), f32(B_L))


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("platform,impl,target", [("tpu", "tpu", "tpu_custom_call"),
                                                  ("cuda", "gpu", "__gpu$xla.gpu.triton")])
def test_kernels_lower(platform, impl, target, sample):
    fn = verify_walk_sample if sample else verify_walk_greedy
    text = _lower(lambda *a: fn(*a, max_depth=S_L, impl=impl), _abstract_args(sample), platform)
    assert target in set(re.findall(r'custom_call @?"?([\w$.]+)', text))


def test_tpu_sample_lowers_with_padded_vocab():
    text = _lower(lambda *a: verify_walk_sample(*a, max_depth=S_L, impl="tpu"),
                  _abstract_args(True, 32001), "tpu")
    assert "tpu_custom_call" in text


def test_output_width_is_lane_dense_power_of_two():
    for s in (0, 1, 7, 63, 125, 126, 1000):
        w = K.out_width(s)
        assert w >= s + 3 and w % 128 == 0 and w & (w - 1) == 0
