"""Drafter checkpoints: each published layout loads into the right params, drafts exactly,
round-trips through jspec's Orbax format, and fails before compiling when it does not fit.

The synthetic checkpoints are written by hand (names and HF [out, in] shapes spelt out,
independently of the loader's tables), with random values so transposes show: see
tests/helpers/drafter_layouts.py.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from jspec.checkpoint import CheckpointError
from jspec.checkpoint.common import flatten
from jspec.decode import TRACE_COUNTS
from jspec.drafters import (Drafter, DrafterMismatchError, detect_drafter_kind, load_drafter,
                            random_drafter, save_drafter, save_hf_drafter)
from jspec.target import Target

from helpers.drafter_layouts import (H, L, TCFG, V, assert_exact, eagle1_ckpt,  # noqa: F401
                                     eagle3_ckpt, medusa_fd_ckpt, medusa_vllm_ckpt, mtp_ckpt,
                                     plain, rnd, target, write)


def attn_mlp_paths(hf_prefix, path):
    """(HF name, param path, transposed) for the tensors :func:`attn_mlp` writes."""
    rows = [(f"self_attn.{p}_proj.weight", path + ("self_attn", f"{p}_proj", "kernel"), True)
            for p in "qkvo"]
    rows += [(f"mlp.{p}_proj.weight", path + ("mlp", f"{p}_proj", "kernel"), True)
             for p in ("gate", "up", "down")]
    rows.append(("post_attention_layernorm.weight", path + ("post_attention_layernorm", "scale"),
                 False))
    return [(hf_prefix + n, p, t) for n, p, t in rows]


def assert_params(drafter, tensors, rows):
    flat = flatten(drafter.params)
    for name, path, transpose in rows:
        want = tensors[name].T if transpose else tensors[name]
        got = np.asarray(flat[path])
        assert got.shape == want.shape, (name, path)
        np.testing.assert_array_equal(got, want, err_msg=f"{name} -> {path}")


def no_compile(fn, exc, *match):
    """``fn()`` raises ``exc`` whose message contains every ``match``; nothing was traced."""
    before = TRACE_COUNTS["spec"]
    with pytest.raises(exc) as e:
        fn()
    for m in match:
        assert m in str(e.value), (m, str(e.value))
    assert TRACE_COUNTS["spec"] == before
    return e.value


# ----------------------------------------------------------------- EAGLE-1
@pytest.mark.parametrize("bias", [True, False])
def test_eagle1(tmp_path, target, plain, bias):
    path, t = eagle1_ckpt(tmp_path / "e1", bias)
    assert detect_drafter_kind(path) == "eagle1"
    d = load_drafter(path, TCFG)
    assert d.kind == "eagle1" and d.module.fc_bias == bias
    assert d.module.layer.intermediate_size == 48 and d.module.layer.num_layers == 1
    rows = [("fc.weight", ("net", "fc", "kernel"), True)] + attn_mlp_paths("layers.0.", ("net",))
    if bias:
        rows.append(("fc.bias", ("net", "fc", "bias"), False))
    else:
        assert "bias" not in d.params["net"]["fc"]
    assert_params(d, t, rows)
    if bias:        # each exactness run compiles a driver; the other variant's is slow-marked
        assert_exact(target, plain, d)


def test_eagle1_sharded_and_bias_inferred(tmp_path):
    path, t = eagle1_ckpt(tmp_path / "e1", True)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["bias"]
    sharded = write(tmp_path / "sharded", cfg, t, shards=3)
    d = load_drafter(sharded, target_config=Target(TCFG, None))
    assert d.module.fc_bias
    assert_params(d, t, [("fc.bias", ("net", "fc", "bias"), False),
                         ("fc.weight", ("net", "fc", "kernel"), True)])


# ----------------------------------------------------------------- EAGLE-3
EAGLE3_ROWS = [("fc.weight", ("net", "fc", "kernel"), True),
               ("midlayer.input_layernorm.weight", ("net", "input_layernorm", "scale"), False),
               ("midlayer.hidden_norm.weight", ("net", "hidden_norm", "scale"), False),
               ("norm.weight", ("net", "norm", "scale"), False),
               ("lm_head.weight", ("net", "lm_head", "kernel"), True),
               ] + attn_mlp_paths("midlayer.", ("net",))


def test_eagle3_reduced_vocab(tmp_path, target, plain):
    path, t = eagle3_ckpt(tmp_path / "e3")
    d = load_drafter(path, TCFG)
    m = d.module
    # Config ids count layer outputs; jspec reads the input of the next layer.
    assert m.kind == "eagle3" and m.aux_layers == (1, 3, 5)
    assert m.draft_vocab == 48 and m.fc_norm == "none" and not m.norm_before_residual
    assert d.params["d2t"].dtype == np.int32
    np.testing.assert_array_equal(d.params["d2t"], np.arange(48))
    np.testing.assert_array_equal(m.to_target_ids(d.params, np.arange(48)), 2 * np.arange(48))
    assert_params(d, t, EAGLE3_ROWS)
    assert_exact(target, plain, d)


def test_eagle3_defaults_and_variants(tmp_path):
    # No aux ids in the config: the (2, L//2, L-3) default; Vd == V with a zero d2t: no map.
    path, _ = eagle3_ckpt(tmp_path / "a", Vd=V, aux_ids=None, d2t=np.zeros(V))
    d = load_drafter(path, TCFG)
    assert d.module.aux_layers == (2, 3, 3) and "d2t" not in d.params
    assert d.module.draft_vocab == V
    # aux_layers= overrides (input convention); fc-norm variants and norm_before_residual.
    path, t = eagle3_ckpt(tmp_path / "b", extra={f"fc_norm_{i}.weight": 1 + rnd(H) for i in range(3)},
                          norm_before_residual=True)
    d = load_drafter(path, TCFG, aux_layers=(0, 1, 2))
    assert d.module.aux_layers == (0, 1, 2)
    assert d.module.fc_norm == "per_chunk" and d.module.norm_before_residual
    assert_params(d, t, [(f"fc_norm_{i}.weight", ("net", f"fc_norm_{i}", "scale"), False)
                         for i in range(3)])
    path, t = eagle3_ckpt(tmp_path / "c", extra={"fc_norm.weight": 1 + rnd(3 * H)})
    d = load_drafter(path, TCFG)
    assert d.module.fc_norm == "full"
    assert_params(d, t, [("fc_norm.weight", ("net", "fc_norm", "scale"), False)])


# --------------------------------------------------------------------- MTP
def mtp_rows(M, head):
    rows = []
    for k in range(M):
        p, m = f"model.layers.{L + k}.", ("net", f"module_{k}")
        rows += [(p + "enorm.weight", m + ("enorm", "scale"), False),
                 (p + "hnorm.weight", m + ("hnorm", "scale"), False),
                 (p + "eh_proj.weight", m + ("eh_proj", "kernel"), True),
                 (p + "input_layernorm.weight", m + ("block", "input_layernorm", "scale"), False),
                 (p + "shared_head.norm.weight", m + ("shared_head_norm", "scale"), False)]
        rows += attn_mlp_paths(p, m + ("block",))
        if head:
            rows.append((p + "shared_head.head.weight", m + ("shared_head_head", "kernel"), True))
    return rows


@pytest.mark.parametrize("M,head", [(1, True), (2, True), (1, False)])
def test_mtp(tmp_path, target, plain, M, head):
    path, t = mtp_ckpt(tmp_path / "mtp", M, head)
    assert detect_drafter_kind(path) == "mtp"
    d = load_drafter(path, TCFG)
    assert d.kind == "mtp" and d.module.num_modules == M and d.module.own_head == head
    assert set(d.params["net"]) == {f"module_{k}" for k in range(M)}
    assert_params(d, t, mtp_rows(M, head))
    if M == 1:
        assert_exact(target, plain, d)


@pytest.mark.slow
def test_exact_more_variants(tmp_path, target, plain):
    """Exactness of the variants whose loading the fast tests check (a compile each)."""
    assert_exact(target, plain, load_drafter(eagle1_ckpt(tmp_path / "a", False)[0], TCFG))
    assert_exact(target, plain, load_drafter(mtp_ckpt(tmp_path / "b", 2, True)[0], TCFG))


# ------------------------------------------------------------------ Medusa
def medusa_rows(layout, heads=3, layers=1):
    rows = []
    for i in range(heads):
        for j in range(layers):
            w, b = ((f"{i}.{j}.linear.weight", f"{i}.{j}.linear.bias") if layout == "fd" else
                    (f"blocks.{i}.layers.{j}.weight", f"blocks.{i}.layers.{j}.bias"))
            rows += [(w, ("net", f"head_{i}_block_{j}", "kernel"), True),
                     (b, ("net", f"head_{i}_block_{j}", "bias"), False)]
        lm = f"{i}.{layers}.weight" if layout == "fd" else f"lm_heads.{i}.weight"
        rows.append((lm, ("net", f"head_{i}_lm", "kernel"), True))
    return rows


def test_medusa_fasterdecoding_and_vllm(tmp_path, target, plain):
    path, t = medusa_fd_ckpt(tmp_path / "fd", heads=3, layers=2)
    d = load_drafter(path, TCFG)
    m = d.module
    assert (m.kind, m.num_heads, m.num_layers, m.hidden, m.vocab_size, m.truncated) == \
        ("medusa", 3, 2, H, V, False)
    assert_params(d, t, medusa_rows("fd", 3, 2))
    assert_exact(target, plain, d)
    path, t = medusa_vllm_ckpt(tmp_path / "vllm", heads=3, layers=2)
    d2 = load_drafter(path, TCFG)
    assert d2.module == m          # same spec: the compiled driver is reused
    assert_params(d2, t, medusa_rows("vllm", 3, 2))
    assert_exact(target, plain, d2)


def test_medusa_vllm_truncated_vocab(tmp_path, target, plain):
    tm = np.sort(np.random.default_rng(3).choice(V, 40, replace=False))
    path, t = medusa_vllm_ckpt(tmp_path / "tv", Vd=40, token_map=tm)
    d = load_drafter(path, TCFG)
    assert d.module.truncated and d.module.vocab_size == 40
    np.testing.assert_array_equal(d.params["token_map"], tm)
    assert d.params["token_map"].dtype == np.int32
    assert_params(d, t, medusa_rows("vllm"))
    assert_exact(target, plain, d)


# ------------------------------------------------------------- jspec format
@pytest.mark.parametrize("kind,kw", [("eagle3", {"vocab_size": 50}), ("mtp", {"num_modules": 2}),
                                     ("medusa", {"vocab_size": 40, "truncated": True}),
                                     ("eagle1", {"fc_bias": True})])
def test_orbax_round_trip(tmp_path, kind, kw):
    d = random_drafter(kind, TCFG, key=jax.random.key(7), **kw)
    save_drafter(d, tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]    # no temp dir left behind
    assert detect_drafter_kind(tmp_path / "d") == kind
    back = load_drafter(tmp_path / "d", TCFG)
    assert back.module == d.module
    a = flatten(jax.tree_util.tree_map(np.asarray, nn.unbox(d.params)))
    b = flatten(back.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].dtype == b[k].dtype
    with pytest.raises(FileExistsError):
        save_drafter(d, tmp_path / "d")
    save_drafter(back, tmp_path / "d", overwrite=True)
    # The HF writer is the loader's inverse.
    save_hf_drafter(d, tmp_path / "hf", target_config=TCFG)
    again = load_drafter(tmp_path / "hf", TCFG)
    assert again.module == d.module
    for k, v in flatten(again.params).items():
        np.testing.assert_array_equal(v, a[k])


def test_orbax_drafter_runs(tmp_path, target, plain):
    path, _ = eagle1_ckpt(tmp_path / "e1", True)
    save_drafter(load_drafter(path, TCFG), tmp_path / "orbax")
    d = load_drafter(tmp_path / "orbax", TCFG)
    assert isinstance(d, Drafter)
    assert_exact(target, plain, d)      # same spec as test_eagle1[True]: no recompile needed


# ------------------------------------------------------------------ errors
def test_missing_and_misshapen_tensors(tmp_path):
    path, _ = eagle1_ckpt(tmp_path / "a", False, drop=["layers.0.mlp.up_proj.weight"])
    no_compile(lambda: load_drafter(path, TCFG), CheckpointError,
               "layers.0.mlp.up_proj.weight", "missing", "(48, 32)")
    path, _ = eagle1_ckpt(tmp_path / "b", True, drop=["fc.bias"])
    no_compile(lambda: load_drafter(path, TCFG), CheckpointError, "fc.bias", "missing")
    path, _ = eagle3_ckpt(tmp_path / "c", extra={"midlayer.self_attn.q_proj.weight": rnd(32, 32)})
    no_compile(lambda: load_drafter(path, TCFG), CheckpointError,
               "midlayer.self_attn.q_proj.weight", "(32, 32)", "expected (32, 64)")
    path, _ = mtp_ckpt(tmp_path / "d", M=2, drop=["model.layers.7.hnorm.weight"])
    no_compile(lambda: load_drafter(path, TCFG), CheckpointError, "model.layers.7.hnorm.weight")
    path, _ = mtp_ckpt(tmp_path / "e", M=2, drop=["model.layers.7.shared_head.head.weight"])
    no_compile(lambda: load_drafter(path, TCFG), CheckpointError, "shared_head.head.weight")
    path, _ = medusa_fd_ckpt(tmp_path / "f")
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    no_compile(lambda: load_drafter(path, TCFG), CheckpointError, "3.0.linear.weight", "missing")
    path, _ = eagle1_ckpt(tmp_path / "g", False)
    no_compile(lambda: load_drafter(path, TCFG, kind="eagle3"), CheckpointError,
               "fc.weight", "expected (32, 96)")


def test_d2t_errors(tmp_path):
    path, _ = eagle3_ckpt(tmp_path / "a", d2t=np.zeros(47))
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "d2t", "(47,)", "(48,)")
    bad = np.arange(48)
    bad[30] = 80        # draft id 30 -> target id 110 >= 97
    path, _ = eagle3_ckpt(tmp_path / "b", d2t=bad)
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError,
               "d2t maps draft id 30 to target id 110", "[0, 97)")
    path, _ = eagle3_ckpt(tmp_path / "c", drop=["d2t"])
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "no d2t")
    tm = np.arange(40)
    tm[5] = 200
    path, _ = medusa_vllm_ckpt(tmp_path / "d", Vd=40, token_map=tm)
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "token_map", "200")


@pytest.mark.parametrize("ids", [[1, 3], [0, 1, 2, 3]])
def test_aux_layer_count(tmp_path, ids):
    path, _ = eagle3_ckpt(tmp_path / "a", aux_ids=ids)
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError,
               "eagle_aux_hidden_state_layer_ids", f"lists {len(ids)} layers", "exactly 3")


def test_aux_layer_beyond_target(tmp_path):
    path, _ = eagle3_ckpt(tmp_path / "a", aux_ids=[0, 2, 5])   # output of layer 5 = input of 6
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError,
               "layer id 5", "6-layer target")
    path, _ = eagle3_ckpt(tmp_path / "b", aux_ids=None)
    no_compile(lambda: load_drafter(path, TCFG, aux_layers=(2, 3, 6)), DrafterMismatchError,
               "aux layer 6", "6-layer target")


def test_hidden_size_mismatch(tmp_path):
    path, _ = eagle1_ckpt(tmp_path / "a", False, hidden=48, hidden_size=48, head_dim=12)
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "hidden size 48", "32")
    path, _ = medusa_fd_ckpt(tmp_path / "b", hidden=48)     # no hidden_size in the config
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "hidden size 48", "32")


def test_vocab_mismatch(tmp_path):
    path, _ = eagle3_ckpt(tmp_path / "a", vocab_size=100)
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "100", "97")
    path, _ = eagle1_ckpt(tmp_path / "b", False, vocab_size=128)
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "128", "97")
    path, _ = medusa_fd_ckpt(tmp_path / "c", vocab=100)
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "100", "97")
    path, _ = medusa_vllm_ckpt(tmp_path / "d", vocab=120)
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "120", "97")


def test_mtp_depth_mismatch(tmp_path):
    path, _ = mtp_ckpt(tmp_path / "a", layers=8)
    no_compile(lambda: load_drafter(path, TCFG), DrafterMismatchError, "num_hidden_layers", "8")


def test_orbax_errors(tmp_path):
    d = random_drafter("eagle1", TCFG)
    save_drafter(d, tmp_path / "d")
    small = TCFG.replace(hidden_size=16)
    no_compile(lambda: load_drafter(tmp_path / "d", small), DrafterMismatchError, "hidden size")
    no_compile(lambda: load_drafter(tmp_path / "d", TCFG, kind="mtp"), CheckpointError, "eagle1")
    meta = json.loads((tmp_path / "d" / "jspec_drafter.json").read_text())
    meta["layer"]["intermediate_size"] = 80
    (tmp_path / "d" / "jspec_drafter.json").write_text(json.dumps(meta))
    no_compile(lambda: load_drafter(tmp_path / "d", TCFG), CheckpointError,
               "net/mlp/", "80")
    no_compile(lambda: load_drafter(tmp_path / "nope", TCFG), CheckpointError, "no such")
