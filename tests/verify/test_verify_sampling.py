"""Speculative sampling is lossless: chi-square tests of the first two emitted tokens
against the target's own distribution, for the tree rule and the chain p/q rule, and
the same tests fail for a deliberately broken rule (so they have power)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec.tree.build import build_tree
from jspec.verify import sampling as vs
from pallas_kernels.verify_walk import reference as walk_ref
from jspec.verify.commit import emitted_tokens

V = 6
DRAWS = 40_000
ALPHA = 1e-3


def dists(rng, n, zeros=True):
    p = rng.dirichlet(np.full(V, 0.7), size=n)
    if zeros:  # some tokens impossible under the target
        p[:, rng.choice(V, 2, replace=False)] = 0.0
        p /= p.sum(-1, keepdims=True)
    return p.astype(np.float32)


@pytest.fixture(scope="module")
def target():
    rng = np.random.default_rng(0)
    p1 = dists(rng, 1)[0]
    p2 = dists(rng, V)                         # p2[x]: next-token dist after x
    # Adversarial: make the drafts below likely *rejections*, and one impossible token.
    return p1, p2


def second_token(first, p2, u):
    """What any exact next step emits after a lone first token: a draw from p2[first]."""
    return np.asarray(vs.categorical_from_uniform(jnp.asarray(p2[first]), jnp.asarray(u)))


def chisquare(observed, probs):
    probs = np.asarray(probs, np.float64)
    return stats.chisquare(observed, probs / probs.sum() * observed.sum()).pvalue


def chi2_pvalue(first, second, p1, p2):
    expected = (p1[:, None] * p2.astype(np.float64)) * len(first)
    observed = np.zeros((V, V))
    np.add.at(observed, (first, second), 1)
    impossible = expected == 0
    assert observed[impossible].sum() == 0, "emitted a token the target gives probability 0"
    keep = ~impossible
    return chisquare(observed[keep], expected[keep])


# Root children: a duplicate token, a token the target never emits, and the target's
# favourite last; each child has its own children (also with a duplicate).
def adversarial_tree(p1, p2):
    fav = int(np.argmax(p1))
    never = int(np.flatnonzero(p1 == 0)[0])
    low = int(np.argsort(p1)[2])  # a low-probability but possible token
    toks = [0, low, never, low, fav, 1, 2, 1, 3, int(np.argmax(p2[fav]))]
    parents = [-1, 0, 0, 0, 0, 1, 1, 1, 4, 4]
    return np.array(toks, np.int32), np.array(parents, np.int32)


def run_tree_walk(p1, p2, seed):
    toks, parents = adversarial_tree(p1, p2)
    N = len(toks)
    B = DRAWS
    tree = build_tree(jnp.broadcast_to(toks, (B, N)), jnp.broadcast_to(parents, (B, N)), 2)
    p3 = np.full(V, 1.0 / V, np.float32)
    depth = np.asarray(tree.depths[0])
    node_probs = np.stack([p1 if d == 0 else p2[toks[i]] if d == 1 else p3
                           for i, d in enumerate(depth)])
    probs = jnp.broadcast_to(jnp.asarray(node_probs), (B, N, V))
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    idx, n, bonus = jax.jit(vs.tree_sample_walk, static_argnums=4)(
        tree, probs, jax.random.uniform(k1, (B, N)), jax.random.uniform(k2, (B,)), 2)
    out, _ = emitted_tokens(tree, idx, n, bonus)
    out, n = np.asarray(out), np.asarray(n)
    second = np.where(n >= 2, out[:, 1], second_token(out[:, 0], p2, jax.random.uniform(k3, (B,))))
    return out[:, 0], second, n


def run_chain_walk(p1, p2, seed):
    """Drafts sampled from a draft model q (q1 for the first token, q2[x] after x)."""
    rng = np.random.default_rng(1)
    q1 = dists(rng, 1, zeros=False)[0]
    q2 = dists(rng, V, zeros=False)
    B = DRAWS
    ks = jax.random.split(jax.random.key(seed), 6)
    x1 = np.asarray(jax.random.categorical(ks[0], jnp.log(jnp.asarray(q1)), shape=(B,)))
    x2 = np.asarray(jax.random.categorical(ks[1], jnp.log(jnp.asarray(q2[x1]))))
    tokens = np.stack([np.zeros(B, np.int32), x1, x2], 1)
    p3 = np.full((B, V), 1.0 / V, np.float32)
    probs = np.stack([np.broadcast_to(p1, (B, V)), p2[x1], p3], 1)
    qs = np.stack([np.broadcast_to(q1, (B, V)), q2[x1]], 1)
    idx, n, bonus = jax.jit(vs.chain_sample_walk)(
        jnp.asarray(tokens), jnp.asarray(probs), jnp.asarray(qs),
        jax.random.uniform(ks[2], (B, 2)), jax.random.uniform(ks[3], (B,)))
    n, bonus = np.asarray(n), np.asarray(bonus)
    first = np.where(n >= 2, x1, bonus)
    second = np.where(n >= 3, x2, np.where(n == 2, bonus,
                                           second_token(first, p2, jax.random.uniform(ks[4], (B,)))))
    return first, second, n


@pytest.mark.parametrize("walk", [run_tree_walk, run_chain_walk])
def test_first_two_tokens_match_target(target, walk):
    p1, p2 = target
    first, second, n = walk(p1, p2, seed=0)
    assert set(np.unique(n)) >= {1, 2}, "the test must exercise both accepts and rejections"
    p_first = chisquare(np.bincount(first, minlength=V)[p1 > 0], p1[p1 > 0])
    assert p_first > ALPHA
    assert chi2_pvalue(first, second, p1, p2) > ALPHA


@pytest.fixture
def fresh_traces():
    """The broken variants are monkeypatched in; drop cached traces of the real ones."""
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_tree_rule_without_removing_rejected_mass_is_caught(target, monkeypatch, fresh_traces):
    monkeypatch.setattr(walk_ref, "_residual", lambda r, x: r)
    p1, p2 = target
    first, second, _ = run_tree_walk(p1, p2, seed=0)
    assert chi2_pvalue(first, second, p1, p2) < ALPHA


def test_chain_rule_resampling_from_p_is_caught(target, monkeypatch, fresh_traces):
    monkeypatch.setattr(vs, "_chain_residual", lambda p, q: p)
    p1, p2 = target
    first, second, _ = run_chain_walk(p1, p2, seed=0)
    assert chi2_pvalue(first, second, p1, p2) < ALPHA


def test_greedy_probs_make_the_tree_rule_greedy():
    """With one-hot target rows the sampling walk is the greedy walk."""
    from jspec.verify.greedy import greedy_walk
    rng = np.random.default_rng(3)
    B, N = 64, 9
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 3, 6])
    toks = rng.integers(0, 3, (B, N))
    tree = build_tree(jnp.asarray(toks), jnp.broadcast_to(parents, (B, N)), 4)
    argmax = rng.integers(0, 3, (B, N))
    probs = jax.nn.one_hot(argmax, V)
    a = vs.tree_sample_walk(tree, probs, jnp.asarray(rng.random((B, N)), jnp.float32),
                            jnp.asarray(rng.random(B), jnp.float32), 4)
    b = greedy_walk(tree, jnp.asarray(argmax), 4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
