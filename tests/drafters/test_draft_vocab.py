"""Draft vocabularies for every drafter kind (:mod:`jspec.drafters.vocab`).

EAGLE-1, MTP and Medusa (and EAGLE-3, for parity) drafting over Vd=64 of the tiny random
target's 256 tokens with a non-trivial map: greedy speculative decoding still equals plain
decoding (chain and a small tree), the heads really have Vd columns and start as the
target head's kept columns, every proposed tree token is in the map's image, jspec's Orbax
format round-trips the vocab size and the map, a map of the wrong length is refused before
anything compiles, and ``python -m jspec.train train --draft-vocab`` trains (loss falls)
and saves a drafter that loads back.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import kv_cache as kvc
from jspec.bench.configs import random_config
from jspec.checkpoint import CheckpointError
from jspec.checkpoint.common import flatten
from jspec.checkpoint.orbax_io import save_orbax
from jspec.config import LlamaConfig
from jspec.decode import TRACE_COUNTS
from jspec.drafters import (Drafter, DrafterMismatchError, load_drafter, random_drafter,
                            save_drafter, save_hf_drafter)
from jspec.drafters import vocab as DV
from jspec.drafters.base import target_head
from jspec.llama import init_params
from jspec.spec_config import SpecConfig
from jspec.target import Target
from jspec.train import drafter as D
from jspec.train.sources import sample_batch
from jspec.train import features as F
from jspec.train import regen
from jspec.train.__main__ import main as train_main

CFG = random_config("tiny")                     # V = 256
VD = 64
KINDS = ["eagle1", "mtp", "medusa", "eagle3"]
# Draft ids 0..63 map to 64 ids spread over [8, 256): an unmapped draft id would mostly
# fall outside the image, so a missing to_target_ids shows.
IDS = np.sort(np.random.default_rng(5).choice(np.arange(8, CFG.vocab_size), VD, replace=False))
PROMPTS = [[1, 5, 9, 4, 33], [1, 7, 3]]
NEW = 24
MODES = {"chain": SpecConfig.chain(3), "tree": SpecConfig(3, 2, 5)}


@pytest.fixture(scope="module")
def target():
    return Target(CFG, init_params(CFG, jax.random.key(0)))


@pytest.fixture(scope="module")
def plain(target):
    return jspec.generate(target, PROMPTS, max_new_tokens=NEW, stop_ids=[]).tokens


@pytest.fixture(scope="module")
def drafters(target):
    """Random weights; the draft heads start as the target head's kept columns."""
    out = {}
    for kind in KINDS:
        d = random_drafter(kind, CFG, jax.random.key(3), vocab_size=VD)
        params = DV.set_draft_vocab(d.module, d.params, IDS, target_head(CFG, target.params))
        out[kind] = Drafter(d.module, params)
    return out


def _heads(d):
    flat = flatten(nn.unbox(d.params))
    return [flat[p] for p in d.module.draft_head_paths]


# ------------------------------------------------------------------ shapes and maps
@pytest.mark.parametrize("kind", KINDS)
def test_heads_have_vd_columns_and_the_map(drafters, target, kind):
    d = drafters[kind]
    assert d.module.vocab_size == VD and d.module.draft_vocab == VD
    heads = _heads(d)
    assert heads, kind
    full = np.asarray(target_head(CFG, target.params))
    for h in heads:
        assert h.shape == (CFG.hidden_size, VD)
        np.testing.assert_array_equal(np.asarray(h), full[:, IDS])
    np.testing.assert_array_equal(DV.kept_ids(d.params, VD), IDS)
    key = "token_map" if kind == "medusa" else "d2t"
    assert set(d.params) & set(DV.MAP_KEYS) == {key}
    np.testing.assert_array_equal(
        np.asarray(d.module.to_target_ids(d.params, jnp.arange(VD))), IDS)
    d.module.validate(CFG, d.params)


@pytest.mark.parametrize("kind", ["eagle1", "mtp", "medusa"])
def test_full_vocabulary_is_unchanged(kind):
    d = random_drafter(kind, CFG, jax.random.key(3))
    assert d.module.vocab_size == 0 and d.module.draft_vocab == CFG.vocab_size
    assert not set(d.params) & set(DV.MAP_KEYS)
    if kind == "eagle1":
        assert set(d.params) == {"net"}         # reads the target's head, as before


def test_d2t_helpers_and_reexports():
    from jspec.drafters.eagle3 import check_d2t as legacy
    assert legacy is DV.check_d2t and F.build_d2t is DV.build_d2t
    d2t = DV.d2t_from_ids(IDS)
    assert np.array_equal(np.arange(VD) + d2t, IDS)
    DV.check_d2t(d2t, VD, CFG.vocab_size)
    t2d = DV.target_to_draft(IDS, CFG.vocab_size)
    assert np.array_equal(t2d[IDS], np.arange(VD)) and (t2d >= 0).sum() == VD
    with pytest.raises(DrafterMismatchError, match="d2t maps draft id 3 to target id 300"):
        bad = d2t.copy()
        bad[3] = 300 - 3
        DV.check_d2t(bad, VD, CFG.vocab_size)


@pytest.mark.parametrize("kind", KINDS)
def test_proposed_tokens_are_in_the_image(drafters, target, kind):
    d = drafters[kind]
    m = d.module
    B, T, page = 2, 6, 16
    pages = kvc.pages_needed(64, page)
    table = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)
    width = 3 * CFG.hidden_size if m.target_layers else CFG.hidden_size
    feats = jax.random.normal(jax.random.key(1), (B, T, width), jnp.float32)
    nxt = jax.random.randint(jax.random.key(2), (B, T), 0, CFG.vocab_size)
    lens = jnp.array([T, T - 2], jnp.int32)
    spec = SpecConfig(3, 4, 8) if kind != "medusa" else SpecConfig(3, 2, 7)
    tgt = (CFG, target.params)

    @jax.jit
    def run(params):
        state = m.init_state(B, table, B * pages, page)
        state = m.prefill(params, tgt, state, feats, nxt, lens)
        return m.propose(params, tgt, state, jnp.array([11, 12], jnp.int32), spec)

    tree = run(d.params)
    toks = np.asarray(tree.tokens)
    assert toks[:, 0].tolist() == [11, 12]                          # the root
    assert np.isin(toks[:, 1:], IDS).all(), toks


# ------------------------------------------------------------------ exactness
# Each case compiles its own program: the default run takes every kind's tree (the map is
# applied to a whole candidate pool there); chains run with -m slow.
def combos():
    for kind in KINDS:
        for mode in MODES:
            marks = (pytest.mark.slow,) if mode == "chain" else ()
            yield pytest.param(kind, mode, id=f"{kind}-{mode}", marks=marks)


@pytest.mark.parametrize("kind,mode", list(combos()))
def test_greedy_identical_to_plain(drafters, target, plain, kind, mode):
    res = jspec.generate(target, PROMPTS, max_new_tokens=NEW, stop_ids=[], drafter=drafters[kind],
                         spec=MODES[mode])
    assert res.tokens == plain
    assert all(st["new_tokens"] == NEW for st in res.stats)


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("kind", KINDS)
def test_orbax_round_trip(drafters, tmp_path, kind):
    d = drafters[kind]
    save_drafter(d, tmp_path / "d")
    meta = json.loads((tmp_path / "d" / "jspec_drafter.json").read_text())
    assert meta["module"]["vocab_size"] == VD
    back = load_drafter(tmp_path / "d", CFG)
    assert back.module == d.module
    a, b = flatten(jax.tree_util.tree_map(np.asarray, nn.unbox(d.params))), flatten(back.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(DV.kept_ids(back.params, VD), IDS)


def test_medusa_vllm_round_trip(drafters, tmp_path):
    d = drafters["medusa"]
    save_hf_drafter(d, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["truncated_vocab_size"] == VD
    back = load_drafter(tmp_path / "hf", CFG)
    assert back.module == d.module
    np.testing.assert_array_equal(np.asarray(back.params["token_map"]), IDS)


@pytest.mark.parametrize("kind", ["eagle1", "mtp"])
def test_no_hf_layout_for_recurrent_draft_vocab(drafters, tmp_path, kind):
    with pytest.raises(ValueError, match="no published layout"):
        save_hf_drafter(drafters[kind], tmp_path / "hf", target_config=CFG)


def _no_compile(fn, exc, *match):
    before = TRACE_COUNTS["spec"]
    with pytest.raises(exc) as e:
        fn()
    for s in match:
        assert s in str(e.value), (s, str(e.value))
    assert TRACE_COUNTS["spec"] == before


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_length_map_refused_before_compiling(drafters, target, tmp_path, kind):
    d = drafters[kind]
    key = d.module.map_key
    bad = Drafter(d.module, {**d.params, key: d.params[key][:VD - 1]})
    _no_compile(lambda: jspec.generate(target, PROMPTS, max_new_tokens=4, drafter=bad),
                DrafterMismatchError, key, f"({VD - 1},)", f"({VD},)")
    save_drafter(bad, tmp_path / "bad")
    _no_compile(lambda: load_drafter(tmp_path / "bad", CFG), (DrafterMismatchError, CheckpointError),
                key, f"({VD - 1},)")


@pytest.mark.parametrize("kind", ["eagle1", "mtp"])
def test_misshapen_head_names_the_tensor(drafters, tmp_path, kind):
    d = drafters[kind]
    path = d.module.draft_head_paths[0]
    params = flatten(nn.unbox(d.params))
    params[path] = np.zeros((CFG.hidden_size, VD + 1), np.float32)
    from jspec.checkpoint.common import unflatten
    save_drafter(Drafter(d.module, unflatten(params)), tmp_path / "bad")
    _no_compile(lambda: load_drafter(tmp_path / "bad", CFG), CheckpointError,
                "/".join(path), f"{(CFG.hidden_size, VD)}")


def test_mtp_draft_vocab_needs_own_head():
    d = random_drafter("mtp", CFG, vocab_size=VD, own_head=False)
    with pytest.raises(DrafterMismatchError, match="own_head"):
        d.module.validate(CFG, d.params)


# ------------------------------------------------------------------ training
TCFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_ids=())
TVD = 24


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    target = Target(TCFG, init_params(TCFG, jax.random.key(0)))
    seqs, pl = regen.regenerate(target, [[1, 5, 9], [1, 7], [1, 3, 4, 8]], 8, max_new_tokens=13,
                                temperature=1.0, batch_size=8, progress=False)
    root = tmp_path_factory.mktemp("train")
    F.compute_features(target, seqs, root / "feat", topk=16, prompt_lens=pl, batch_size=8,
                       shard_size=8, progress=False)
    save_orbax(target, root / "target")
    return target, F.load_features(root / "feat"), root


def _losses(ds, target, data):
    """Loss of each drafter (one spec) on batch 0, one compiled function."""
    m = ds[0].module
    batch = sample_batch(data, m, 0, 8, 0)
    fn = jax.jit(lambda p, tp, b, t2d: D.drafter_loss(m, p, TCFG, tp, b, D.default_loss(m.kind),
                                                      t2d)[0])
    out = []
    for d in ds:
        t2d = D.draft_t2d(m, D.split_params(d.params)[1], TCFG.vocab_size)
        out.append(float(fn(nn.unbox(d.params), target.params, batch, t2d)))
    return out


# One kind in the default run (the path through the CLI is shared); the others with -m slow.
@pytest.mark.parametrize("kind", ["eagle1", pytest.param("mtp", marks=pytest.mark.slow),
                                  pytest.param("medusa", marks=pytest.mark.slow)])
def test_train_cli_with_draft_vocab(train_setup, kind):
    target, data, root = train_setup
    out = root / kind
    train_main(["train", "--target", str(root / "target"), "--features", str(root / "feat"),
                "--kind", kind, "--out", str(out), "--steps", "6", "--batch-size", "8",
                "--lr", "1e-2", "--warmup", "1", "--draft-vocab", str(TVD), "--medusa-heads", "2"])
    trained = load_drafter(out / "drafter", TCFG)
    assert trained.kind == kind and trained.module.draft_vocab == TVD
    for h in _heads(trained):
        assert h.shape == (TCFG.hidden_size, TVD)
    freqs = F.token_frequencies(data["tokens"], data["lens"], TCFG.vocab_size)
    _, ids = DV.build_d2t(freqs, TVD)
    np.testing.assert_array_equal(DV.kept_ids(trained.params, TVD), ids)
    arch = {"num_heads": 2} if kind == "medusa" else {}       # the CLI's --medusa-heads 2
    fresh = D.build_drafter(kind, TCFG, target.params, jax.random.key(0), draft_vocab=TVD,
                            freqs=freqs, **arch)
    assert fresh.module == trained.module
    before, after = _losses([fresh, trained], target, data)
    assert np.isfinite(before) and after < before, (kind, before, after)
