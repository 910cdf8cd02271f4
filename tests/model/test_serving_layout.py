"""The output-major serving layout (``[out, in]`` kernels, :func:`jspec.serving_layout.linear`) computes
what the checkpoint layout computes: for the product itself at every token count (the CPU
path pads past 4 tokens), for a Flax ``Linear`` and for every drafter's draft and extend."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import kv_cache as kvc
from jspec.bench.configs import random_config
from jspec.drafters import random_drafter
from jspec.llama import Linear, init_params, out_major_params
from jspec.serving_layout import linear, pack_params
from jspec.spec_config import SpecConfig

CFG = random_config("tiny")


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 7, 9])
def test_linear_equals_the_plain_product(tokens):
    x = jax.random.normal(jax.random.key(0), (2, tokens, 24))
    w = jax.random.normal(jax.random.key(1), (3, 5, 24))           # out dims [3, 5], in 24
    got = linear(x, w, jax.lax.Precision.HIGHEST)
    assert got.shape == (2, tokens, 3, 5)
    want = np.einsum("btk,onk->bton", np.asarray(x), np.asarray(w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_out_major_linear_matches_in_major():
    x = jax.random.normal(jax.random.key(0), (3, 16))
    base = Linear(8, ("embed", "mlp"), use_bias=True)
    params = base.init(jax.random.key(1), x)["params"]
    params = jax.tree.map(lambda a: a + 0.5, nn.unbox(params))     # a non-zero bias
    served = out_major_params(params)
    assert served["kernel"].shape == (8, 16) and served["bias"].shape == (8,)
    om = Linear(8, ("embed", "mlp"), use_bias=True, out_major=True)
    np.testing.assert_allclose(om.apply({"params": served}, x), base.apply({"params": params}, x),
                               rtol=1e-5, atol=1e-5)


def test_packed_target_is_output_major():
    c = CFG
    p = jax.eval_shape(lambda k: pack_params(c, init_params(c, k), stacked=False),
                       jax.random.key(0))["layers"][0]
    G = c.num_heads // c.num_kv_heads
    assert p["qkv"].shape == (c.num_kv_heads, G + 2, c.head_dim, c.hidden_size)
    assert p["o"].shape == (c.hidden_size, c.num_heads * c.head_dim)
    assert p["gate_up"].shape == (2, c.intermediate_size, c.hidden_size)
    assert p["down"].shape == (c.hidden_size, c.intermediate_size)


@pytest.fixture(scope="module")
def target_params():
    return jax.jit(lambda k: pack_params(CFG, init_params(CFG, k)))(jax.random.key(0))


@pytest.mark.parametrize("kind,kw", [("eagle3", {}), ("eagle1", {}), ("eagle1", {"vocab_size": 64}),
                                     ("mtp", {"num_modules": 2})])
def test_drafter_serving_layout_drafts_the_same(target_params, kind, kw):
    d = random_drafter(kind, CFG, jax.random.key(1), **kw)
    s = d.serving
    assert s.module.out_major and not d.module.out_major and s is d.serving     # made once
    # Only the layout differs (it is part of the spec's hash: a different compiled program).
    assert dataclasses.replace(s.module, out_major=False) == d.module
    B, T = 2, 5
    width = (3 if d.module.target_layers else 1) * CFG.hidden_size
    feats = jax.random.normal(jax.random.key(2), (B, T, width))
    toks = jax.random.randint(jax.random.key(3), (B, T), 0, CFG.vocab_size)
    table = jnp.arange(B * 3, dtype=jnp.int32).reshape(B, 3)

    def run(dr):
        m = dr.module

        @jax.jit
        def go(params, tp):
            st = m.init_state(B, table, B * 3, 16)
            st = m.prefill(params, (CFG, tp), st, feats, toks, jnp.array([T, 3]))
            return st, m.propose(params, (CFG, tp), st, toks[:, 0], SpecConfig(3, 2, 5))
        return go(dr.params, target_params)

    (st_a, tree_a), (st_b, tree_b) = run(d), run(s)
    np.testing.assert_allclose(st_b.logits, st_a.logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(kvc.read_layer(st_b.cache, 0)[0], kvc.read_layer(st_a.cache, 0)[0],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(tree_b.tokens, tree_a.tokens)
