"""DFlash: the drafter's block forward against a dense numpy reference written from the
published semantics (fc then hidden_norm, per-head q/k norms before RoPE, a non-causal
block over the whole context), read from a checkpoint in the published layout; exactness
on the stories260K goldens (chain and tree, batch 1 and ragged); what the loader refuses;
the training objective."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.checkpoint import load_target
from jspec.drafters import DrafterMismatchError, load_drafter, random_drafter, save_hf_drafter
from jspec.drafters.base import target_embedding, target_head
from jspec.spec_config import SpecConfig

from helpers.drafter_layouts import HD, NH, NKV, TCFG, dflash_ckpt, target  # noqa: F401


# ------------------------------------------------------------ dense reference
def _rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    """Rotate-half RoPE (HF Llama/Qwen3): ``x [T, h, D]`` at ``pos [T]``."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]


def reference_logits(t, layers, ctx_feats, root, n, mask_id, emb, head):
    """The published forward over HF-named tensors ``t``: logits ``[n, V]`` of the block
    ``[root, mask x (n - 1)]`` after the context ``ctx_feats [T, F]``."""
    T = len(ctx_feats)
    ctx = _rms(ctx_feats @ t["fc.weight"].T, t["hidden_norm.weight"])
    x = emb[[root] + [mask_id] * (n - 1)]
    pc, pb = np.arange(T), T + np.arange(n)
    G = NH // NKV
    for i in range(layers):
        w = lambda name: t[f"layers.{i}.{name}"]
        xn = _rms(x, w("input_layernorm.weight"))
        heads = lambda y, proj, k: y @ w(f"self_attn.{proj}_proj.weight").T
        q = _rope(_rms(heads(xn, "q", NH).reshape(n, NH, HD), w("self_attn.q_norm.weight")), pb)
        kn = lambda y, m, pos: _rope(_rms((y @ w("self_attn.k_proj.weight").T).reshape(m, NKV, HD),
                                          w("self_attn.k_norm.weight")), pos)
        k = np.concatenate([kn(ctx, T, pc), kn(xn, n, pb)])                       # [T + n, NKV, D]
        v = np.concatenate([ctx, xn]) @ w("self_attn.v_proj.weight").T
        v = v.reshape(T + n, NKV, HD)
        o = np.zeros((n, NH, HD))
        for h in range(NH):
            s = q[:, h] @ k[:, h // G].T / np.sqrt(HD)                           # every key
            p = np.exp(s - s.max(-1, keepdims=True))
            o[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // G]
        x = x + o.reshape(n, -1) @ w("self_attn.o_proj.weight").T
        h = _rms(x, w("post_attention_layernorm.weight"))
        g, u = h @ w("mlp.gate_proj.weight").T, h @ w("mlp.up_proj.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ w("mlp.down_proj.weight").T
    return _rms(x, t["norm.weight"]) @ head


@pytest.mark.parametrize("serving", [False, True], ids=["checkpoint", "serving"])
def test_block_matches_the_published_forward(tmp_path, target, serving):  # noqa: F811
    path, tensors = dflash_ckpt(tmp_path / "dflash", layers=2, taps=(1, 3), block=6, mask=3)
    d = load_drafter(path, TCFG)
    if serving:
        d = d.serving
    m = d.module
    assert m.aux_layers == (2, 4) and m.block_size == 6 and m.mask_token_id == 3
    F = 2 * TCFG.hidden_size
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 6, F)), rng.standard_normal((2, 5, F))
    na, nb = np.array([5, 3]), np.array([4, 2])                     # ragged: 9 and 5 committed
    table = jnp.arange(2 * 2, dtype=jnp.int32).reshape(2, 2)
    state = m.init_state(2, table, 4, 8)
    state = m.prefill(d.params, (TCFG, target.params), state, jnp.asarray(a, jnp.float32), None,
                      jnp.asarray(na))
    state = m.extend(d.params, (TCFG, target.params), state, jnp.asarray(b, jnp.float32), None,
                     jnp.asarray(nb))
    assert state.cache.lengths.tolist() == [9, 5]
    roots = jnp.asarray([7, 11])
    logits = m.logits(TCFG, target.params,
                      m.block_hidden(d.params, target.params, state.cache, roots, 6))
    emb = np.asarray(target_embedding(target.params), np.float64)
    head = np.asarray(target_head(TCFG, target.params), np.float64)
    t64 = {k: v.astype(np.float64) for k, v in tensors.items()}
    for r in range(2):
        ctx = np.concatenate([a[r, :na[r]], b[r, :nb[r]]])
        want = reference_logits(t64, 2, ctx, int(roots[r]), 6, 3, emb, head)
        np.testing.assert_allclose(np.asarray(logits[r]), want, rtol=2e-4, atol=2e-4)


# ------------------------------------------------------------- exactness
@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    return target, cases


@pytest.fixture(scope="module")
def published(stories, tmp_path_factory):
    """A random head written in the published layout and read back."""
    target, _ = stories
    d = random_drafter("dflash", target.config, jax.random.key(5), num_layers=2, block_size=8,
                       mask_token_id=3)
    path = tmp_path_factory.mktemp("dflash") / "hf"
    save_hf_drafter(d, path, target_config=target.config)
    return load_drafter(path, target.config)


@pytest.mark.parametrize("spec", [None, SpecConfig(7, 2, 12)], ids=["chain", "tree"])
@pytest.mark.parametrize("size", [1, 4], ids=["batch1", "ragged"])
def test_goldens(stories, published, spec, size):
    target, cases = stories
    rows = cases[:1] if size == 1 else cases[1:5]
    res = jspec.generate(target, [c["prompt_token_ids"] for c in rows], max_new_tokens=100,
                         stop_ids=[], drafter=published, spec=spec)
    for row, case in zip(res.tokens, rows):
        assert row == case["continuation_token_ids"], case["prompt"]
    S, N = published.module.tree_shape(spec)
    assert (S, N) == ((7, 8) if spec is None else (7, 12))
    assert all(sum(s["accept_hist"]) == s["iterations"] for s in res.stats)


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw,match", [
    (dict(mask=500), "mask_token_id 500"),
    (dict(taps=(1, 5)), "target layers"),
    (dict(num_target_layers=32), "32-layer target"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding"),
    (dict(dflash_config={"target_layer_ids": [1, 3]}), "mask_token_id"),
], ids=["mask", "taps", "target-depth", "sliding", "no-mask"])
def test_refused_before_reading_weights(tmp_path, kw, match):
    path, _ = dflash_ckpt(tmp_path / "d", **kw)
    with pytest.raises(ValueError, match=match):
        load_drafter(path, TCFG)


def test_fc_width_is_checked_by_name(tmp_path):
    path, _ = dflash_ckpt(tmp_path / "d", taps=(1, 3))
    cfg = json.loads((path / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 2, 3]           # three taps, fc has two
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="fc.weight"):
        load_drafter(path, TCFG)


def test_spec_deeper_than_the_block_is_refused(target):  # noqa: F811
    d = random_drafter("dflash", TCFG, jax.random.key(0), block_size=4)
    with pytest.raises(DrafterMismatchError, match="block_size=4"):
        jspec.generate(target, [[1, 2, 3]], max_new_tokens=4, drafter=d,
                       spec=SpecConfig.chain(4))


# ---------------------------------------------------------------- training
def test_loss_sees_only_the_context_before_each_anchor(target):  # noqa: F811
    """The objective's anchor rows read the sequence's pages with length ``a``: changing
    features at or after every anchor leaves the loss unchanged, changing one before an
    anchor does not."""
    from jspec.train import drafter as D
    d = random_drafter("dflash", TCFG, jax.random.key(1), block_size=4, aux_layers=(2,))
    T, k = 24, 4
    rng = np.random.default_rng(0)
    batch = dict(tokens=rng.integers(0, TCFG.vocab_size, (2, T)), lens=np.array([T, 16]),
                 feats=rng.standard_normal((2, T, TCFG.hidden_size)).astype(np.float32),
                 topk_vals=rng.standard_normal((2, T, k)).astype(np.float32),
                 topk_ids=rng.integers(0, TCFG.vocab_size, (2, T, k)),
                 rng=np.array([0, 7], np.uint32))
    lc = D.LossConfig(anchors=1)
    loss = lambda b: float(D.drafter_loss(d.module, d.params, TCFG, target.params,
                                          {k: jnp.asarray(v) for k, v in b.items()}, lc)[0])
    base = loss(batch)
    assert np.isfinite(base) and base > 0
    late, early = dict(batch), dict(batch)
    late["feats"] = batch["feats"].copy()
    late["feats"][:, T - 1] += 5.0            # past every anchor (anchors < len - 1)
    early["feats"] = batch["feats"].copy()
    early["feats"][:, 0] += 5.0               # before every anchor (anchors >= 1)
    assert loss(late) == pytest.approx(base, rel=1e-6)
    assert abs(loss(early) - base) > 1e-4
