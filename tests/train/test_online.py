"""Online training (the target's forward inside the step) trains the same drafter as
offline training on a feature cache: on the shipped default model, for every trained kind,
the same batch gives the same loss and the same gradients."""

from pathlib import Path

import jax
import numpy as np
import pytest

import jspec
from jspec.train import drafter as D
from jspec.train import features as F
from jspec.train.online import with_target_features
from jspec.train.sources import sample_batch, token_data

ROOT = Path(__file__).resolve().parents[2] / "checkpoints" / "default"
# EAGLE-3 (draft vocabulary, TTT) and Medusa in the default run; all five with -m slow.
KINDS = ["eagle3", "medusa"] + [pytest.param(k, marks=pytest.mark.slow)
                                for k in ("eagle1", "mtp", "dflash")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = jspec.load_target(ROOT)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, target.config.vocab_size, n) for n in (40, 23, 31, 48, 17, 36)]
    aux = F.aux_layers_for(target.config.num_layers)
    d = tmp_path_factory.mktemp("feat")
    F.compute_features(target, seqs, d, aux_layers=aux, topk=16, batch_size=6, progress=False)
    return target, seqs, aux, F.load_features(d)


def _drafter(kind, target, seqs, aux):
    kw = {}
    if kind == "eagle3":              # with a reduced draft vocabulary, as shipped
        tokens, lens = F.pad_sequences(seqs)
        kw = dict(aux_layers=aux, draft_vocab=512,
                  freqs=F.token_frequencies(tokens, lens, target.config.vocab_size))
    if kind == "dflash":
        kw = dict(aux_layers=aux, block_size=4)
    if kind == "medusa":
        kw = dict(num_heads=2)
    return D.build_drafter(kind, target.config, target.params, jax.random.key(3), **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_online_loss_and_grads_equal_offline(setup, kind):
    target, seqs, aux, cached = setup
    d = _drafter(kind, target, seqs, aux)
    m, cfg = d.module, target.config
    trainable, frozen = D.split_params(d.params)
    t2d = D.draft_t2d(m, frozen, cfg.vocab_size)
    lc = D.default_loss(kind)

    def grads(p, tp, b, online):
        if online:
            b = with_target_features(m, cfg, tp, b, 16)
        f = lambda q: D.drafter_loss(m, {**q, **frozen}, cfg, tp, b, lc, t2d)[0]
        return jax.value_and_grad(f)(p)

    offline = sample_batch(cached, m, 5, 4, 0)
    online = sample_batch(token_data(seqs), m, 5, 4, 0)
    assert set(online) == {"tokens", "lens", "rng"}
    np.testing.assert_array_equal(online["tokens"], offline["tokens"])
    run = jax.jit(grads, static_argnums=3)
    l_off, g_off = run(trainable, target.params, offline, False)
    l_on, g_on = run(trainable, target.params, online, True)
    assert np.isfinite(float(l_off)) and float(l_off) > 0
    np.testing.assert_allclose(float(l_on), float(l_off), rtol=1e-5)
    flat_on, flat_off = jax.tree.leaves(g_on), jax.tree.leaves(g_off)
    assert len(flat_on) == len(flat_off) and max(float(np.abs(g).max()) for g in flat_off) > 0
    for a, b in zip(flat_on, flat_off):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_tokens_only_data_refused_offline(setup):
    from jspec.train import trainer as T
    target, seqs, aux, _ = setup
    d = _drafter("eagle1", target, seqs, aux)
    with pytest.raises(ValueError, match="online"):
        T.train(d, target, token_data(seqs), T.TrainConfig(steps=1), progress=False)
