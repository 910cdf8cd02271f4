"""Width confusion (issue 14's bug class): the peers' illegal memory accesses came from
buffers sized by the node width N and indexed by the accepted width S + 1, or the reverse.
Here every array the speculative loop carries or hands between phases is traced (no compile)
for shapes where the two widths differ, and checked against the width its indices reach:
node arrays N, accepted paths and emitted blocks S + 1, the accept histogram S + 2, the
output buffer max_new + S + 1. The named dimensions of every state dataclass are bound once
and must agree (:func:`jspec.shapes.check_shapes`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import kv_cache as kvc
from jspec.drafters import ngram_drafter, random_drafter
from jspec.llama import init_params
from jspec.shapes import check_shapes
from jspec.spec_config import SpecConfig
from jspec.spec_decode import SpecDecoder

CFG = jspec.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8)
B, MAX_NEW, PAGE, P, T = 3, 9, 4, 96, 8


def drafter(kind):
    if kind == "ngram":
        return ngram_drafter(CFG)
    return random_drafter(kind, CFG, jax.random.key(1), **({"vocab_size": 32}
                                                           if kind == "eagle3" else {}))


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "ngram"])
@pytest.mark.parametrize("spec", [SpecConfig(1, 1, 2), SpecConfig.chain(4), SpecConfig(3, 4, 10),
                                  SpecConfig(6, 10, 64), None], ids=str)
def test_every_buffer_has_the_width_its_indices_reach(kind, spec):
    d = drafter(kind)
    spec = spec if spec is not None else d.default_spec
    dec = SpecDecoder(CFG, d.module, spec, jspec.SamplingConfig(temperature=1.0), MAX_NEW, PAGE, P)
    try:
        d.module.check_spec(spec)
        S, N = dec.shape
    except ValueError:      # SpecConfigError, DrafterMismatchError: refused before tracing
        pytest.skip(f"{kind} refuses {spec} (checked by its own tests)")
    params = init_params(CFG, jax.random.key(0))
    pt = jnp.asarray(kvc.allocate_page_table([40] * B, PAGE, P, 12))
    args = (params, d.params, jnp.zeros((B, T), jnp.int32), jnp.full((B,), 5), pt, pt,
            jnp.full((B, 8), -1), jnp.full((B,), MAX_NEW), jax.random.key(0))
    state = jax.eval_shape(lambda *a: dec._loop(*a[:-1], jax.random.split(a[-1], B)), *args)
    dims = check_shapes(state)
    assert dims["out"] == MAX_NEW + S + 1 and dims["A1"] == S + 2 and dims["B"] == B

    tree = jax.eval_shape(lambda s: dec.draft_phase(params, d.params, s), state)
    assert check_shapes(tree)["N"] == N
    logits, feats, cache = jax.eval_shape(lambda s, t: dec.verify(params, s.cache, t), state, tree)
    assert logits.shape == (B, N, CFG.vocab_size) and feats.shape[:2] == (B, N)
    check_shapes(cache)
    keys = jax.random.split(jax.random.key(0), B)
    for walk in (dec.walk, dec.force_accept):
        idx, n, bonus = jax.eval_shape(walk, tree, logits, keys)
        assert idx.shape == (B, S + 1) and n.shape == bonus.shape == (B,)
    after = jax.eval_shape(lambda s, t, lg, f, c: dec.finish_phase(
        params, d.params, s, t, lg, f, c, jnp.full((B, 8), -1), jnp.full((B,), MAX_NEW)),
        state, tree, logits, feats, cache)
    assert check_shapes(after) == dims
    assert jax.tree_util.tree_structure(after) == jax.tree_util.tree_structure(state)
    assert all(np.shape(a) == np.shape(b) for a, b in zip(jax.tree_util.tree_leaves(after),
                                                         jax.tree_util.tree_leaves(state)))
