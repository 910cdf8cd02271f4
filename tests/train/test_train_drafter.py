"""Drafter training on a tiny random target: losses are finite and fall, resume is exact,
d2t is consistent, trained heads load through jspec.drafters and decode exactly."""

import dataclasses

import jax
import numpy as np
import pytest

import jspec
from jspec.config import LlamaConfig
from jspec.drafters import load_drafter, save_drafter
from jspec.drafters.eagle3 import check_d2t
from jspec.llama import init_params
from jspec.spec_config import SpecConfig
from jspec.target import Target
from jspec.train import drafter as D
from jspec.train import trainer as T
from jspec.train.sources import sample_batch
from jspec.train import features as F
from jspec.train import regen

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_ids=())
KINDS = ["eagle3", "eagle1", "mtp", "medusa", "dflash"]


@pytest.fixture(scope="module")
def target():
    return Target(CFG, init_params(CFG, jax.random.key(0)))


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    prompts = [[1, 5, 9], [1, 7], [1, 3, 4, 8]]
    seqs, pl = regen.regenerate(target, prompts, 8, max_new_tokens=13, temperature=1.0,
                                batch_size=8, progress=False)
    assert len(seqs) == 8 and [len(s) for s in seqs[:3]] == [16, 15, 17]
    d = tmp_path_factory.mktemp("feat")
    F.compute_features(target, seqs, d, topk=16, prompt_lens=pl, batch_size=8, shard_size=4,
                       progress=False)
    out = F.load_features(d)
    assert out["aux"].shape[-1] == 3 * CFG.hidden_size and out["meta"]["aux_layers"] == [1, 2, 3]
    assert out["tokens"].shape[0] == 8 and out["topk_ids"].shape[-1] == 16
    return out


def _build(kind, target, data, **kw):
    extra = {}
    if kind == "eagle3":
        extra = dict(aux_layers=tuple(data["meta"]["aux_layers"]), draft_vocab=48,
                     freqs=F.token_frequencies(data["tokens"], data["lens"], CFG.vocab_size))
    if kind == "dflash":               # taps the cached layers, as the CLI does
        extra = dict(aux_layers=tuple(data["meta"]["aux_layers"]), block_size=4)
    return D.build_drafter(kind, target.config, target.params, jax.random.key(1), **extra, **kw)


def _loss(d, target, data):
    _, frozen = D.split_params(d.params)
    t2d = D.draft_t2d(d.module, frozen, CFG.vocab_size)
    batch = sample_batch(data, d.module, 0, 8, 0)
    fn = jax.jit(lambda p, tp, b, t2d: D.drafter_loss(d.module, p, CFG, tp, b,
                                                      D.default_loss(d.module.kind), t2d)[0])
    return float(fn(d.params, target.params, batch, t2d))


TC = T.TrainConfig(steps=6, batch_size=8, lr=1e-2, warmup=1, log_every=100, ckpt_every=100)


@pytest.fixture(scope="module")
def trained(target, data):
    out = {}
    for kind in KINDS:
        d = _build(kind, target, data)
        before = _loss(d, target, data)
        t, _ = T.train(d, target, data, TC, progress=False, log=lambda m: None)
        out[kind] = (d, t, before, _loss(t, target, data))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_loss_finite_and_decreases(trained, kind):
    _, _, before, after = trained[kind]
    assert np.isfinite(before) and np.isfinite(after)
    assert after < before, (kind, before, after)


def test_ttt_mask_matches_tree_visibility():
    m = D.ttt_masks(6, 3)
    # step 0 causal; step 2 at i=4: step-0 keys 0..2, step-1 key 3, step-2 key 4 (itself).
    assert np.array_equal(m[0, :, :6], np.tril(np.ones((6, 6), bool))) and not m[0, :, 6:].any()
    assert np.flatnonzero(m[2, 4]).tolist() == [0, 1, 2, 6 + 3, 12 + 4]
    assert np.flatnonzero(m[1, 0]).tolist() == [6]          # no prefix: only itself


def test_resume_is_exact(target, data, tmp_path):
    """Orbax checkpoints: a run stopped at step 3 and resumed ends bitwise where an
    uninterrupted run ends; an existing checkpoint without resume is refused."""
    d = _build("eagle3", target, data)
    full, _ = T.train(d, target, data, TC, progress=False, log=lambda m: None)
    ck = tmp_path / "ckpt"
    T.train(d, target, data, dataclasses.replace(TC, stop_after=3), ckpt_dir=ck,
            progress=False, log=lambda m: None)
    with pytest.raises(ValueError, match="resume"):
        T.train(d, target, data, TC, ckpt_dir=ck, progress=False, log=lambda m: None)
    logs = []
    resumed, _ = T.train(d, target, data, TC, ckpt_dir=ck, resume=True, progress=False,
                         log=logs.append)
    assert any("resumed" in m and "step 3" in m for m in logs)
    for a, b in zip(jax.tree_util.tree_leaves(full.params), jax.tree_util.tree_leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_d2t_in_range_and_consistent():
    rng = np.random.default_rng(0)
    freqs = rng.integers(0, 1000, 100)
    d2t, ids = F.build_d2t(freqs, 30)
    check_d2t(d2t, 30, 100)
    assert np.array_equal(np.arange(30) + d2t, ids) and np.all(np.diff(ids) > 0)
    # The draft vocabulary is the 30 most frequent ids.
    assert set(ids) == set(np.argsort(-freqs, kind="stable")[:30])
    t2d = F.target_to_draft(ids, 100)
    assert np.array_equal(t2d[ids], np.arange(30)) and (t2d >= 0).sum() == 30
    with pytest.raises(ValueError):
        F.build_d2t(freqs, 0)


def test_eagle3_draft_vocab(trained):
    _, t, _, _ = trained["eagle3"]
    assert t.module.draft_vocab == 48 and t.params["d2t"].shape == (48,)
    t.module.validate(CFG, t.params)
    assert t.params["net"]["lm_head"]["kernel"].shape == (CFG.hidden_size, 48)


@pytest.mark.parametrize("kind", KINDS)
def test_trained_params_load_and_decode_exactly(trained, target, tmp_path, kind):
    _, t, _, _ = trained[kind]
    save_drafter(t, tmp_path / kind)
    loaded = load_drafter(tmp_path / kind, CFG)
    assert loaded.kind == kind
    for a, b in zip(jax.tree_util.tree_leaves(t.params), jax.tree_util.tree_leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if kind not in ("eagle3", "medusa", "dflash"):   # a recurrent, a static-tree, a block drafter
        return
    prompts = [[1, 5, 9], [1, 7, 2, 2]]
    plain = jspec.generate(target, prompts, max_new_tokens=12, stop_ids=[])
    spec = SpecConfig(3, 2, 5) if kind == "eagle3" else None
    res = jspec.generate(target, prompts, max_new_tokens=12, stop_ids=[], drafter=loaded, spec=spec)
    assert res.tokens == plain.tokens


def test_init_fine_tunes_a_saved_head_and_refuses_flags_that_would_rebuild_it(target, tmp_path):
    """``train --init DIR`` starts from the saved drafter's parameters (its architecture, aux
    layers and draft vocabulary); a different kind, aux layers or a fresh --draft-vocab is
    refused before anything trains."""
    import argparse

    from jspec.train.train_cli import _initial_drafter
    d = D.build_drafter("eagle3", CFG, target.params, jax.random.key(3), draft_vocab=32,
                        freqs=np.arange(CFG.vocab_size, dtype=np.int64))
    save_drafter(d, tmp_path / "head")
    a = argparse.Namespace(init=str(tmp_path / "head"), kind="eagle3", aux_layers="",
                           draft_vocab=0)
    got = _initial_drafter(a, target)
    for x, y in zip(jax.tree.leaves(got.params), jax.tree.leaves(d.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for bad, msg in ((dict(kind="mtp"), "is a eagle3 drafter"),
                     (dict(aux_layers="0,1,2"), "differs from --init"),
                     (dict(draft_vocab=16), "--init keeps")):
        with pytest.raises(SystemExit, match=msg):
            _initial_drafter(argparse.Namespace(**{**vars(a), **bad}), target)
