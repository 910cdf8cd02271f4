"""Draft trees: EAGLE-2 selection, tree building, packed masks, greedy walk, static trees.

Every property is checked against a plain numpy / Python reference written here.
Shapes are drawn from small fixed sets so each jitted function compiles a few times only.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jspec.shapes import check_shapes
from jspec.spec_config import SpecConfig
from jspec.tree import (MC_SIM_7B_63, StaticTree, build_tree, chain_parents, eagle2_tree,
                        pack_mask, select_tree, static_tree_tokens, unpack_mask)
from jspec.tree.build import mask_dtype
from jspec.tree.select import expand_frontier
from jspec.verify import emitted_tokens, greedy_walk

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.data_too_large])

eagle2_jit = jax.jit(eagle2_tree, static_argnames=("num_nodes",))
select_jit = jax.jit(select_tree, static_argnames=("num_nodes", "max_depth"))
build_jit = jax.jit(build_tree, static_argnames=("max_depth",))
walk_jit = jax.jit(greedy_walk, static_argnames=("max_depth",))
emit_jit = jax.jit(emitted_tokens)

F32 = np.float32
INF = float("inf")
NAN = float("nan")
# Values that make selection hard: ties, probability-1 edges (0), zeros (-inf), NaN,
# sums that overflow to -inf (underflowing probabilities), and a few "wrong" positive scores.
# -0.0 is left out here: lax.top_k orders -0.0 below +0.0 (see test_frontier_signed_zero_tie).
TIE_VALUES = [0.0, -1.0, -1.0, -0.5, -2.0]
SPECIAL_VALUES = [-INF, NAN, float(F32(-3e38)), float(F32(-2e38)), float(F32(-1e-30))]
WILD_VALUES = [INF, 1.0, 3.0]


def score_elems(wild: bool):
    # No subnormals: XLA on CPU flushes them to zero, numpy does not. Same-sign sums of
    # normal floats never become subnormal; mixed-sign (wild) values are multiples of 1/64.
    opts = [st.sampled_from(TIE_VALUES), st.sampled_from(SPECIAL_VALUES),
            st.floats(-20.0, 0.0, width=32, allow_subnormal=False).map(lambda x: x + 0.0)]  # +0
    if wild:
        opts.append(st.sampled_from(WILD_VALUES))
        opts.append(st.integers(-320, 320).map(lambda i: i / 64))
    return st.one_of(*opts)


def f32_array(draw, shape, wild):
    n = int(np.prod(shape))
    vals = draw(st.lists(score_elems(wild), min_size=n, max_size=n))
    return np.asarray(vals, dtype=F32).reshape(shape)


# ----------------------------------------------------------------------------- references

def ref_pool(step_tokens, step_logp):
    """numpy EAGLE-2 frontier recurrence for one row -> (tokens, scores, parents) [M]."""
    S, K, _ = step_tokens.shape
    toks = [step_tokens[0, 0]]
    scs = [step_logp[0, 0].astype(F32)]
    pars = [np.full(K, -1, np.int64)]
    f_scores = step_logp[0, 0].astype(F32)
    f_idx = np.arange(K)
    for s in range(1, S):
        with np.errstate(invalid="ignore", over="ignore"):
            cs = (f_scores[:, None] + step_logp[s]).astype(F32).reshape(K * K)
        cs = np.where(np.isnan(cs), F32(-np.inf), cs).astype(F32)
        keep = np.argsort(-cs, kind="stable")[:K]          # ties -> lower index
        toks.append(step_tokens[s].reshape(K * K))
        scs.append(cs)
        pars.append(np.repeat(f_idx, K))
        f_scores = cs[keep]
        f_idx = (K + (s - 1) * K * K) + keep
    return np.concatenate(toks), np.concatenate(scs), np.concatenate(pars)


def ref_select(pool_scores, pool_parents, n_draft):
    """Top-n_draft pool indices (sorted) by (-min score along path, depth, index)."""
    M = len(pool_scores)
    sc = np.where(np.isnan(pool_scores), -np.inf, pool_scores).astype(np.float64)
    eff = np.empty(M)
    depth = np.empty(M, np.int64)
    for i in range(M):
        p = pool_parents[i]
        assert p < i
        eff[i] = sc[i] if p < 0 else min(sc[i], eff[p])
        depth[i] = 1 if p < 0 else depth[p] + 1
    order = sorted(range(M), key=lambda i: (-eff[i], depth[i], i))
    return sorted(order[:n_draft]), eff, depth


def ref_tree_from_pool(root, pool_tokens, pool_parents, chosen):
    node_of = {c: i + 1 for i, c in enumerate(chosen)}
    tokens = [root] + [int(pool_tokens[c]) for c in chosen]
    parents = [-1] + [0 if pool_parents[c] < 0 else node_of.get(int(pool_parents[c]), -1)
                      for c in chosen]
    return np.array(tokens), np.array(parents)


def ref_build(parents):
    """Python reference of everything build_tree derives from one row of parents."""
    N = len(parents)
    depth = np.zeros(N, np.int64)
    mask = np.zeros((N, N), bool)
    first_child = np.full(N, -1, np.int64)
    next_sibling = np.full(N, -1, np.int64)
    for i in range(N):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]
        depth[i] = len(path) - 1
        mask[i, path] = True
    for i in range(N):
        kids = [j for j in range(N) if parents[j] == i]
        if kids:
            first_child[i] = kids[0]
        if parents[i] >= 0:
            sibs = [j for j in range(i + 1, N) if parents[j] == parents[i]]
            if sibs:
                next_sibling[i] = sibs[0]
    return depth, mask, first_child, next_sibling


def ref_walk(tokens, parents, argmax, S):
    cur, path = 0, [0]
    for _ in range(S):
        kids = [j for j in range(len(parents)) if parents[j] == cur and tokens[j] == argmax[cur]]
        if not kids:
            break
        cur = kids[0]
        path.append(cur)
    return path, int(argmax[cur])


def ref_pack(mask):
    n = mask.shape[-1]
    bits = 8 if n <= 8 else 16 if n <= 16 else 32
    words = 1 if n <= 32 else 2
    out = np.zeros(mask.shape[:-1] + (words,), np.uint64)
    for j in range(n):
        out[..., j // bits] |= mask[..., j].astype(np.uint64) << np.uint64(j % bits)
    return out


# ------------------------------------------------------------------ 1. EAGLE-2 selection

EAGLE_SHAPES = [(3, 2, 5), (5, 4, 8), (4, 3, 17), (2, 8, 64), (2, 2, 4), (3, 3, 12)]
B_EAGLE = 3


def unique_step_tokens(B, S, K):
    """Token of pool index p is p + 1 (root is 0), so tree tokens reveal pool indices.
    Step 0 rows k >= 1 are unused by eagle2_tree; give them junk tokens."""
    tok = np.full((B, S, K, K), 10_000, np.int32)
    tok[:, 0, 0] = np.arange(K) + 1
    for s in range(1, S):
        off = K + (s - 1) * K * K
        tok[:, s] = (off + np.arange(K * K) + 1).reshape(K, K)
    return tok


def check_selected_tree(tree, closed, b, root, ptoks, psc, ppar, n_nodes, S):
    tokens = np.asarray(tree.tokens[b])
    parents = np.asarray(tree.parents[b])
    assert bool(closed[b])
    chosen, eff, depth = ref_select(psc, ppar, n_nodes - 1)
    rt, rp = ref_tree_from_pool(root, ptoks, ppar, chosen)
    assert (rp[1:] >= 0).all()                           # the reference is closed too
    np.testing.assert_array_equal(tokens, rt)
    np.testing.assert_array_equal(parents, rp)
    assert parents[0] == -1
    assert (parents[1:] >= 0).all() and (parents[1:] < np.arange(1, n_nodes)).all()
    # node parents map exactly to the pool parent's node; the root only for root children
    pool_of = {i + 1: c for i, c in enumerate(chosen)}
    for i in range(1, n_nodes):
        pp = ppar[pool_of[i]]
        if pp < 0:
            assert parents[i] == 0
        else:
            assert parents[i] != 0 and pool_of[int(parents[i])] == pp
    # pool order is kept
    assert list(pool_of.values()) == sorted(pool_of.values())
    # depths agree with the pool depths and never exceed S
    d = np.asarray(tree.depths[b])
    np.testing.assert_array_equal(d[1:], depth[chosen])
    assert d.max() <= S


@st.composite
def eagle_inputs(draw):
    S, K, N = draw(st.sampled_from(EAGLE_SHAPES))
    wild = draw(st.booleans())
    logp = f32_array(draw, (B_EAGLE, S, K, K), wild)
    return S, K, N, logp


@settings(max_examples=60, **SETTINGS)
@given(eagle_inputs(), st.booleans(), st.integers(0, 2**32 - 1))
def test_eagle2_matches_reference_and_is_closed(inp, unique_tokens, seed):
    S, K, N, logp = inp
    SpecConfig(S, K, N)
    if unique_tokens:
        toks = unique_step_tokens(B_EAGLE, S, K)
    else:
        toks = np.random.default_rng(seed).integers(0, 3, (B_EAGLE, S, K, K)).astype(np.int32)
    root = np.array([7, 8, 9], np.int32)
    tree, closed = eagle2_jit(jnp.asarray(root), jnp.asarray(toks), jnp.asarray(logp), num_nodes=N)
    assert tree.tokens.shape == (B_EAGLE, N)
    for b in range(B_EAGLE):
        ptoks, psc, ppar = ref_pool(toks[b], logp[b])
        assert len(ptoks) == SpecConfig(S, K, N).pool_size
        check_selected_tree(tree, closed, b, root[b], ptoks, psc, ppar, N, S)
        if unique_tokens:   # node tokens are pool index + 1: recover them, check the mapping
            pool_idx = np.asarray(tree.tokens[b, 1:]) - 1
            assert (np.diff(pool_idx) > 0).all()
            par = np.asarray(tree.parents[b, 1:])
            for i, c in enumerate(pool_idx):
                want = 0 if ppar[c] < 0 else int(np.where(pool_idx == ppar[c])[0][0]) + 1
                assert par[i] == want
    # build_tree fields are consistent with the selected parents
    for b in range(B_EAGLE):
        d, m, fc, ns = ref_build(np.asarray(tree.parents[b]))
        np.testing.assert_array_equal(np.asarray(tree.depths[b]), d)
        np.testing.assert_array_equal(np.asarray(tree.mask()[b]), m)


@st.composite
def pool_inputs(draw):
    """Arbitrary topologically ordered pools (not necessarily EAGLE-shaped)."""
    M, N, S = draw(st.sampled_from([(6, 4, 3), (12, 8, 4), (20, 17, 5), (40, 33, 6), (10, 10, 3)]))
    B = 2
    parents = np.full((B, M), -1, np.int32)
    depth = np.ones((B, M), np.int32)
    for b in range(B):
        for i in range(1, M):
            p = draw(st.integers(-1, i - 1))
            if p >= 0 and depth[b, p] >= S:
                p = -1
            parents[b, i] = p
            depth[b, i] = 1 if p < 0 else depth[b, p] + 1
    scores = f32_array(draw, (B, M), draw(st.booleans()))
    return M, N, S, parents, scores


@settings(max_examples=60, **SETTINGS)
@given(pool_inputs())
def test_select_tree_arbitrary_pool(inp):
    M, N, S, parents, scores = inp
    B = parents.shape[0]
    tokens = np.broadcast_to(np.arange(M, dtype=np.int32) + 1, (B, M))
    root = np.zeros(B, np.int32)
    tree, closed = select_jit(jnp.asarray(root), jnp.asarray(tokens), jnp.asarray(scores),
                              jnp.asarray(parents), num_nodes=N, max_depth=S)
    for b in range(B):
        check_selected_tree(tree, closed, b, 0, tokens[b], scores[b], parents[b], N, S)


def test_select_ties_parent_first():
    """All scores equal (every edge probability 1): shallower first, then pool order; a
    child listed before a dropped parent's sibling must not leak in as a root child."""
    # pool: 0,1 root children; 2,3 children of 1; 4 child of 2
    parents = np.array([[-1, -1, 1, 1, 2]], np.int32)
    for sc in (0.0, -np.inf, np.nan):
        scores = np.full((1, 5), sc, np.float32)
        tree, closed = select_tree(jnp.zeros(1, jnp.int32), jnp.arange(1, 6)[None],
                                   jnp.asarray(scores), jnp.asarray(parents), 4, 3)
        assert bool(closed[0])
        np.testing.assert_array_equal(tree.tokens[0], [0, 1, 2, 3])
        np.testing.assert_array_equal(tree.parents[0], [-1, 0, 0, 2])
    # a child scoring higher than its parent (not a log-prob, but it must stay closed)
    scores = np.array([[-5.0, -1.0, 0.0, -9.0, 0.0]], np.float32)
    tree, closed = select_tree(jnp.zeros(1, jnp.int32), jnp.arange(1, 6)[None],
                               jnp.asarray(scores), jnp.asarray(parents), 3, 3)
    assert bool(closed[0])
    np.testing.assert_array_equal(tree.tokens[0], [0, 2, 3])      # pool 1 then its child 2
    np.testing.assert_array_equal(tree.parents[0], [-1, 0, 1])


def test_frontier_signed_zero_tie():
    # frontier slot 2 has path score -0.0 (equal to 0.0); its child at flat index 6 scores
    # -0.0 + -0.0 = -0.0, index 7 scores -0.0 + 0.0 = +0.0: a tie, so index 6 must win.
    path = jnp.array([[0.0, 0.0, -0.0]], jnp.float32)
    child = jnp.array([[[0.0, 0.0, -1.0], [-1.0, -1.0, -1.0], [-0.0, 0.0, 0.0]]], jnp.float32)
    scores, keep = expand_frontier(path, child)
    assert (np.asarray(scores[0, 6]) == np.asarray(scores[0, 7]))
    np.testing.assert_array_equal(keep[0], [0, 1, 6])


# ------------------------------------------------------------------------- 2. K = 1 chain

@settings(max_examples=30, **SETTINGS)
@given(st.data())
def test_k1_is_chain(data):
    S = data.draw(st.sampled_from([1, 2, 3, 5]))
    B = 2
    logp = f32_array(data.draw, (B, S, 1, 1), data.draw(st.booleans()))
    toks = np.asarray(data.draw(st.lists(st.integers(0, 50), min_size=B * S, max_size=B * S)),
                      np.int32).reshape(B, S, 1, 1)
    root = np.array([3, 4], np.int32)
    tree, closed = eagle2_jit(jnp.asarray(root), jnp.asarray(toks), jnp.asarray(logp),
                              num_nodes=S + 1)
    assert np.asarray(closed).all()
    for b in range(B):
        np.testing.assert_array_equal(tree.parents[b], np.arange(-1, S))
        np.testing.assert_array_equal(tree.parents[b], chain_parents(S + 1))
        np.testing.assert_array_equal(tree.depths[b], np.arange(S + 1))
        np.testing.assert_array_equal(tree.tokens[b], np.concatenate([[root[b]], toks[b, :, 0, 0]]))
        np.testing.assert_array_equal(tree.first_child[b], list(range(1, S + 1)) + [-1])
        np.testing.assert_array_equal(tree.next_sibling[b], np.full(S + 1, -1))
        np.testing.assert_array_equal(tree.mask()[b], np.tril(np.ones((S + 1, S + 1), bool)))


# ------------------------------------------------------------------- 3. shapes and masks

@pytest.mark.parametrize("S,K,N,dtype,words", [
    (3, 2, 5, jnp.uint8, 1), (5, 4, 8, jnp.uint8, 1), (3, 2, 9, jnp.uint16, 1),
    (5, 2, 16, jnp.uint16, 1), (4, 3, 17, jnp.uint32, 1), (6, 8, 32, jnp.uint32, 1),
    (3, 4, 33, jnp.uint32, 2), (2, 8, 64, jnp.uint32, 2), (3, 1, 4, jnp.uint8, 1),
])
def test_shapes_and_widths(S, K, N, dtype, words):
    SpecConfig(S, K, N)
    B = 2
    rng = np.random.default_rng(S * 100 + K * 10 + N)
    logp = np.log(rng.uniform(size=(B, S, K, K))).astype(np.float32)
    toks = rng.integers(0, 1000, (B, S, K, K)).astype(np.int32)
    tree, closed = eagle2_jit(jnp.zeros(B, jnp.int32), jnp.asarray(toks), jnp.asarray(logp),
                              num_nodes=N)
    assert np.asarray(closed).all()
    for f in ("tokens", "parents", "depths", "first_child", "next_sibling"):
        assert getattr(tree, f).shape == (B, N), f
    assert tree.mask_bits.dtype == dtype and tree.mask_bits.shape == (B, N, words)
    assert mask_dtype(N) == (dtype, words)
    dims = check_shapes(tree)
    assert dims == {"B": B, "N": N, "W": words}
    assert tree.num_nodes == N and tree.mask().shape == (B, N, N)
    idx, alen, bonus = greedy_walk(tree, jnp.zeros((B, N), jnp.int32), S)
    assert idx.shape == (B, S + 1) and alen.shape == (B,) and bonus.shape == (B,)


def test_mask_dtype_limits():
    assert mask_dtype(1) == (jnp.uint8, 1)
    assert mask_dtype(16) == (jnp.uint16, 1)
    assert mask_dtype(33) == (jnp.uint32, 2)
    with pytest.raises(ValueError):
        mask_dtype(65)


@settings(max_examples=40, **SETTINGS)
@given(st.sampled_from([1, 7, 8, 9, 16, 17, 32, 33, 64]), st.integers(0, 2**32 - 1),
       st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
def test_pack_unpack_roundtrip(n, seed, density):
    m = np.random.default_rng(seed).uniform(size=(2, n, n)) < density
    packed = pack_mask(jnp.asarray(m))
    dt, words = mask_dtype(n)
    assert packed.dtype == dt and packed.shape == (2, n, words)
    np.testing.assert_array_equal(np.asarray(packed).astype(np.uint64), ref_pack(m))
    np.testing.assert_array_equal(np.asarray(unpack_mask(packed, n)), m)


# ---------------------------------------------------------------------- 4. build_tree

BUILD_SHAPES = [(3, 5, 4), (2, 8, 7), (2, 17, 5), (2, 33, 6), (1, 64, 9), (2, 2, 1)]


@st.composite
def random_trees(draw, shapes=BUILD_SHAPES, vocab=None):
    B, N, S = draw(st.sampled_from(shapes))
    parents = np.full((B, N), -1, np.int32)
    depth = np.zeros((B, N), np.int32)
    for b in range(B):
        for i in range(1, N):
            # bias towards recent nodes so deep trees are common
            p = draw(st.one_of(st.integers(0, i - 1), st.integers(max(0, i - 3), i - 1)))
            while depth[b, p] >= S:
                p = parents[b, p]
            parents[b, i] = p
            depth[b, i] = depth[b, p] + 1
    v = vocab or 1000
    tokens = np.asarray(draw(st.lists(st.integers(0, v - 1), min_size=B * N, max_size=B * N)),
                        np.int32).reshape(B, N)
    return B, N, S, parents, tokens


@settings(max_examples=60, **SETTINGS)
@given(random_trees())
def test_build_tree_matches_reference(inp):
    B, N, S, parents, tokens = inp
    tree = build_jit(jnp.asarray(tokens), jnp.asarray(parents), max_depth=S)
    check_shapes(tree)
    np.testing.assert_array_equal(tree.tokens, tokens)
    np.testing.assert_array_equal(tree.parents, parents)
    for b in range(B):
        d, m, fc, ns = ref_build(parents[b])
        np.testing.assert_array_equal(tree.depths[b], d)
        np.testing.assert_array_equal(tree.mask()[b], m)
        np.testing.assert_array_equal(np.asarray(tree.mask_bits[b]).astype(np.uint64), ref_pack(m))
        np.testing.assert_array_equal(tree.first_child[b], fc)
        np.testing.assert_array_equal(tree.next_sibling[b], ns)


# ---------------------------------------------------------------------- 5. greedy walk

WALK_SHAPES = [(3, 5, 4), (3, 8, 5), (2, 17, 5), (2, 33, 6), (2, 8, 2)]


@settings(max_examples=80, **SETTINGS)
@given(random_trees(shapes=WALK_SHAPES, vocab=3), st.data())
def test_greedy_walk_matches_reference(inp, data):
    B, N, S, parents, tokens = inp
    vocab = 3
    argmax = np.asarray(data.draw(st.lists(st.integers(0, vocab - 1), min_size=B * N,
                                           max_size=B * N)), np.int32).reshape(B, N)
    tree = build_jit(jnp.asarray(tokens), jnp.asarray(parents), max_depth=S)
    idx, alen, bonus = walk_jit(tree, jnp.asarray(argmax), max_depth=S)
    assert idx.shape == (B, S + 1)
    etoks, count = emit_jit(tree, idx, alen, bonus)
    assert etoks.shape == (B, S + 1)
    for b in range(B):
        path, rbonus = ref_walk(tokens[b], parents[b], argmax[b], S)
        L = len(path)
        assert int(alen[b]) == L >= 1
        np.testing.assert_array_equal(idx[b], path + [-1] * (S + 1 - L))
        assert int(bonus[b]) == rbonus
        # the accepted path is the ancestor row of the last accepted node
        np.testing.assert_array_equal(np.flatnonzero(tree.mask()[b, path[-1]]), path)
        want = [int(tokens[b, j]) for j in path[1:]] + [rbonus]
        want += [0] * (S + 1 - len(want))
        np.testing.assert_array_equal(etoks[b], want)
        assert int(count[b]) == L


def test_greedy_walk_duplicate_siblings_first_wins():
    # root has children 1, 2 both token 5; 2 has a child matching, 1 does not.
    tokens = np.array([[0, 5, 5, 6]], np.int32)
    parents = np.array([[-1, 0, 0, 2]], np.int32)
    tree = build_tree(jnp.asarray(tokens), jnp.asarray(parents), 2)
    argmax = np.array([[5, 1, 6, 9]], np.int32)
    idx, alen, bonus = greedy_walk(tree, jnp.asarray(argmax), 2)
    np.testing.assert_array_equal(idx[0], [0, 1, -1])
    assert int(alen[0]) == 2 and int(bonus[0]) == 1


# ---------------------------------------------------------------------- 6. static trees

def test_static_mc_sim_7b_63():
    t = StaticTree.from_paths(MC_SIM_7B_63)
    assert len(set(MC_SIM_7B_63)) == 63
    assert t.num_nodes == 64 and t.depth == 4 and t.topk == 10
    assert t.parents[0] == -1 and t.heads[0] == -1 and t.ranks[0] == -1
    assert set(t.paths) == set(MC_SIM_7B_63)
    assert list(t.paths) == sorted(t.paths, key=lambda p: (len(p), p))
    for i in range(1, t.num_nodes):
        p = t.paths[i - 1]
        par = t.parents[i]
        assert 0 <= par < i
        assert (par == 0) if len(p) == 1 else (t.paths[par - 1] == p[:-1])
        assert t.heads[i] == len(p) - 1 and t.ranks[i] == p[-1]
    tree = static_tree_tokens(t, jnp.zeros(1, jnp.int32), jnp.zeros((1, 4, 10), jnp.int32))
    assert tree.mask_bits.dtype == jnp.uint32 and tree.mask_bits.shape == (1, 64, 2)
    d, m, fc, ns = ref_build(np.array(t.parents))
    np.testing.assert_array_equal(tree.depths[0], d)
    np.testing.assert_array_equal(tree.mask()[0], m)


def test_static_cartesian():
    t = StaticTree.cartesian([3, 2, 2])
    assert t.num_nodes == 1 + 3 + 6 + 12
    assert t.depth == 3 and t.topk == 3
    assert len(t.paths) == 21
    counts = np.bincount(np.array(ref_build(np.array(t.parents))[0]))
    np.testing.assert_array_equal(counts, [1, 3, 6, 12])


@settings(max_examples=20, **SETTINGS)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["mc", "cart"]))
def test_static_tree_tokens(seed, which):
    t = StaticTree.from_paths(MC_SIM_7B_63) if which == "mc" else StaticTree.cartesian([3, 2, 2])
    rng = np.random.default_rng(seed)
    B, heads, k = 2, t.depth + 1, t.topk + 1
    head_topk = rng.integers(0, 32000, (B, heads, k)).astype(np.int32)
    root = rng.integers(0, 32000, B).astype(np.int32)
    tree = static_tree_tokens(t, jnp.asarray(root), jnp.asarray(head_topk))
    for b in range(B):
        assert int(tree.tokens[b, 0]) == root[b]
        for i, p in enumerate(t.paths, start=1):
            assert int(tree.tokens[b, i]) == head_topk[b, len(p) - 1, p[-1]]
        np.testing.assert_array_equal(tree.parents[b], t.parents)


def test_static_tree_errors():
    with pytest.raises(ValueError, match="no parent path"):
        StaticTree.from_paths([(0,), (1, 0)])
    with pytest.raises(ValueError, match="no parent path"):
        StaticTree.from_paths([(0, 1)])
    with pytest.raises(ValueError):
        StaticTree.from_paths([])
    with pytest.raises(ValueError):
        StaticTree.from_paths([(0,), (-1,)])
    with pytest.raises(ValueError, match="at most 64"):
        StaticTree.cartesian([8, 8])
    t = StaticTree.cartesian([2, 2])
    with pytest.raises(ValueError, match="heads"):
        static_tree_tokens(t, jnp.zeros(1, jnp.int32), jnp.zeros((1, 1, 2), jnp.int32))


# ------------------------------------------------------------ 7. everything under one jit

@functools.partial(jax.jit, static_argnames=("num_nodes",))
def draft_and_verify(root, step_tokens, step_logp, bigram, num_nodes):
    """EAGLE-2 tree, a bigram "target" (argmax after token t = bigram[b, t]), greedy walk."""
    S = step_tokens.shape[1]
    tree, closed = eagle2_tree(root, step_tokens, step_logp, num_nodes)
    argmax = jnp.take_along_axis(bigram, tree.tokens, axis=1)
    idx, alen, bonus = greedy_walk(tree, argmax, S)
    toks, count = emitted_tokens(tree, idx, alen, bonus)
    return tree, closed, argmax, idx, alen, bonus, toks


def _check_jitted(root, toks, logp, bigram, N):
    B, S, K, _ = toks.shape
    tree, closed, argmax, idx, alen, bonus, etoks = draft_and_verify(
        jnp.asarray(root), jnp.asarray(toks), jnp.asarray(logp), jnp.asarray(bigram), num_nodes=N)
    assert np.asarray(closed).all()
    for b in range(B):
        ptoks, psc, ppar = ref_pool(toks[b], logp[b])
        chosen, _, _ = ref_select(psc, ppar, N - 1)
        rt, rp = ref_tree_from_pool(root[b], ptoks, ppar, chosen)
        np.testing.assert_array_equal(tree.tokens[b], rt)
        np.testing.assert_array_equal(tree.parents[b], rp)
        path, rbonus = ref_walk(rt, rp, bigram[b][rt], S)
        assert int(alen[b]) == len(path)
        np.testing.assert_array_equal(idx[b, :len(path)], path)
        assert int(bonus[b]) == rbonus
    return tree, alen


def test_jit_rows_differ():
    S, K, N, B, V = 3, 2, 6, 2, 16
    toks = np.zeros((B, S, K, K), np.int32)
    toks[:, 0, 0] = [1, 2]
    toks[:, 1] = [[3, 4], [5, 6]]
    toks[:, 2] = [[7, 8], [9, 10]]
    logp = np.full((B, S, K, K), np.log(0.1), np.float32)
    # row 0: a confident chain 1 -> 3 -> 7 (deep tree)
    logp[0, 0, 0] = np.log([0.99, 0.01])
    logp[0, 1] = np.log([[0.99, 0.01], [0.5, 0.5]])
    logp[0, 2] = np.log([[0.99, 0.01], [0.5, 0.5]])
    # row 1: flat (bushy tree)
    logp[1, 0, 0] = np.log([0.5, 0.5])
    logp[1, 1] = np.log([[0.5, 0.5], [0.5, 0.5]])
    logp[1, 2] = np.log([[0.1, 0.1], [0.1, 0.1]])
    root = np.array([0, 0], np.int32)
    bigram = np.full((B, V), 15, np.int32)
    bigram[0, [0, 1, 3, 7]] = [1, 3, 7, 11]     # row 0 accepts 1, 3, 7; bonus 11
    bigram[1, 0] = 2                            # row 1 accepts 2 only; 2 -> 15 unmatched
    tree, alen = _check_jitted(root, toks, logp, bigram, N)
    assert not np.array_equal(tree.parents[0], tree.parents[1])
    assert np.asarray(tree.depths[0]).max() == 3 and np.asarray(tree.depths[1]).max() == 2
    np.testing.assert_array_equal(alen, [4, 2])


@settings(max_examples=25, **SETTINGS)
@given(st.sampled_from([(3, 2, 5), (5, 4, 8)]), st.integers(0, 2**32 - 1))
def test_jit_random(shape, seed):
    S, K, N = shape
    B, V = 4, 4
    rng = np.random.default_rng(seed)
    logp = np.log(rng.dirichlet(np.ones(K) * 0.3, size=(B, S, K))).astype(np.float32)
    logp = np.sort(logp, axis=-1)[..., ::-1].copy()
    toks = rng.integers(0, V, (B, S, K, K)).astype(np.int32)
    bigram = rng.integers(0, V, (B, V)).astype(np.int32)
    root = rng.integers(0, V, B).astype(np.int32)
    _check_jitted(root, toks, logp, bigram, N)
