"""Packed rows train exactly as their records would on rows of their own: the target's
features (online), every packing kind's loss and its gradients are the unpacked batch's;
the grain pipeline packs whole records and its position still resumes exactly."""

import jax
import numpy as np
import pytest

from jspec.config import LlamaConfig
from jspec.llama import init_params
from jspec.target import Target
from jspec.train import drafter as D
from jspec.train import features as F
from jspec.train.online import with_target_features
from jspec.train.packing import pack_sequences
from jspec.train.sources import token_data

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_ids=())
LENS = (21, 9, 14, 30, 6, 17, 11)


@pytest.fixture(scope="module")
def setup():
    target = Target(CFG, init_params(CFG, jax.random.key(0)))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, CFG.vocab_size, n).astype(np.int32) for n in LENS]
    return target, seqs


def test_pack_sequences_keeps_every_sequence_whole_and_once(setup):
    _, seqs = setup
    p = pack_sequences(seqs, 32)
    assert p["tokens"].shape[1] == 32 and len(p["tokens"]) < len(seqs)     # it packed
    got = []
    for tok, n, seg, pos in zip(p["tokens"], p["lens"], p["segments"], p["positions"]):
        assert (seg[:n] > 0).all() and (seg[n:] == 0).all()
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            assert (np.diff(at) == 1).all() and (pos[at] == np.arange(len(at))).all()
            got.append(tuple(tok[at]))
    assert sorted(got) == sorted(tuple(s) for s in seqs)


def test_packed_target_features_are_each_records_own(setup):
    target, seqs = setup
    run = F.make_target_pass(CFG, (1, 2), 8)
    un = token_data(seqs)
    h_un, a_un, v_un, i_un = run(target.params, un["tokens"])
    p = pack_sequences(seqs, 32)
    h_p, a_p, v_p, i_p = run(target.params, p["tokens"], p["segments"], p["positions"])
    where = {tuple(s): k for k, s in enumerate(seqs)}
    for r in range(len(p["tokens"])):
        seg = p["segments"][r]
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            k = where[tuple(p["tokens"][r, at])]
            n = len(at)
            np.testing.assert_allclose(h_p[r, at], h_un[k, :n], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(a_p[r, at], a_un[k, :n], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(v_p[r, at], v_un[k, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"] + [pytest.param(k, marks=pytest.mark.slow)
                                                         for k in ("mtp", "eagle1")])
def test_packed_loss_and_grads_equal_unpacked(setup, kind):
    target, seqs = setup
    kw = dict(aux_layers=(0, 1, 2)) if kind == "eagle3" else {}
    if kind == "medusa":
        kw = dict(num_heads=2)
    d = D.build_drafter(kind, CFG, target.params, jax.random.key(3), **kw)
    m = d.module
    trainable, frozen = D.split_params(d.params)
    lc = D.default_loss(kind)
    rng = np.array([0, 0], np.uint32)

    def loss(p, b):
        b = with_target_features(m, CFG, target.params, b, 16)
        return D.drafter_loss(m, {**p, **frozen}, CFG, target.params, b, lc)

    run = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (l_un, met_un), g_un = run(trainable, {**token_data(seqs), "rng": rng})
    (l_p, met_p), g_p = run(trainable, {**pack_sequences(seqs, 32), "rng": rng})
    assert np.isfinite(float(l_un)) and float(l_un) > 0
    np.testing.assert_allclose(float(l_p), float(l_un), rtol=1e-5)
    for k in met_un:
        np.testing.assert_allclose(float(met_p[k]), float(met_un[k]), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_un)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_a_packed_row_without_segments_would_leak_across_records(setup):
    """The checks above could fail: ignoring the segments (one causal row) changes the later
    records' features and the loss well beyond those checks' tolerances."""
    target, seqs = setup
    d = D.build_drafter("medusa", CFG, target.params, jax.random.key(3), num_heads=2)
    lc = D.default_loss("medusa")

    def loss(b):
        b = with_target_features(d.module, CFG, target.params, b, 16)
        return D.drafter_loss(d.module, d.params, CFG, target.params, b, lc)[0]

    p = pack_sequences(seqs, 32)
    leaky = {"tokens": p["tokens"], "lens": p["lens"], "rng": np.zeros(2, np.uint32)}
    un = {**token_data(seqs), "rng": np.zeros(2, np.uint32)}
    assert abs(float(loss(leaky)) - float(loss(un))) > 10 * 1e-5 * float(loss(un))
    run = F.make_target_pass(CFG, (), 8)
    h_leak = run(target.params, p["tokens"])[0]
    h_own = run(target.params, p["tokens"], p["segments"], p["positions"])[0]
    later = p["segments"] > 1                   # tokens after another record in their row
    assert later.any()
    assert float(np.abs(np.asarray(h_leak - h_own))[later].max()) > 1e-2


def test_dflash_refuses_packed_rows(setup):
    target, seqs = setup
    d = D.build_drafter("dflash", CFG, target.params, jax.random.key(3), aux_layers=(0, 1, 2),
                        block_size=4)
    assert not D.packs("dflash") and D.packs("eagle3")
    b = with_target_features(d.module, CFG, target.params,
                             {**pack_sequences(seqs, 32), "rng": np.zeros(2, np.uint32)}, 16)
    with pytest.raises(ValueError, match="unpacked rows"):
        D.drafter_loss(d.module, d.params, CFG, target.params, b, D.default_loss("dflash"))
