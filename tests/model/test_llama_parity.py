"""Logit parity of jspec's Llama forward with transformers ``LlamaForCausalLM`` (fp32).

Random tiny configs cover tied/untied embeddings, GQA ratios 1/2/4, llama3 RoPE
scaling in both the transformers-4 (``rope_theta`` + ``rope_scaling``) and
transformers-5 (``rope_parameters``) spellings with positions past
``original_max_position_embeddings``, and ``head_dim != hidden / heads``. Each case
checks full-sequence prefill logits, the post-norm final hidden state, the
``aux_layers`` residual streams against HF ``output_hidden_states[i]``, and
incremental decoding through the paged cache (prefill half, then one token at a
time) against HF's full-sequence logits.

``test_golden_parity`` needs no torch: it replays ``tests/data/parity_golden.npz``
(written by ``tests/data/make_parity_golden.py``).
"""

from __future__ import annotations

import json
import math
import os
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import kv_cache as kvc
from jspec import llama, rope, serving_layout
from jspec.config import LlamaConfig

TOL = 1e-4
GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "parity_golden.npz")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
THETA = 500000.0


# --------------------------------------------------------------- weight mapping
def _private_params_from_state_dict(cfg: LlamaConfig, sd: dict[str, np.ndarray]) -> dict:
    """HF names / ``[out, in]`` weights -> jspec's nested flax tree with ``[in, out]`` kernels."""
    def get(name):
        for key in (name, "model." + name):
            if key in sd:
                return np.asarray(sd[key], np.float32)
        raise KeyError(name)

    p = {"embed_tokens": {"embedding": get("embed_tokens.weight")},
         "norm": {"scale": get("norm.weight")}}
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        p[f"layers_{i}"] = {
            "self_attn": {f"{n}_proj": {"kernel": get(pre + f"self_attn.{n}_proj.weight").T}
                          for n in "qkvo"},
            "mlp": {f"{n}_proj": {"kernel": get(pre + f"mlp.{n}_proj.weight").T}
                    for n in ("gate", "up", "down")},
            "input_layernorm": {"scale": get(pre + "input_layernorm.weight")},
            "post_attention_layernorm": {"scale": get(pre + "post_attention_layernorm.weight")},
        }
    if not cfg.tie_word_embeddings:
        p["lm_head"] = {"kernel": np.asarray(sd["lm_head.weight"], np.float32).T}
    return jax.tree.map(jnp.asarray, p)


def _init_everything(module, tok, pos, cache):
    hidden, _, _ = module(tok, pos, cache)
    return module.logits(hidden)


def _reference_tree(cfg: LlamaConfig):
    """Shapes of every parameter the model uses, ``lm_head`` included.

    Built independently of ``llama.init_params`` (which once traced only ``__call__`` and
    so dropped ``lm_head`` for untied configs; see ``test_untied_lm_head_params``)."""
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                           np.zeros((1, 1), np.int32), 1, 8, cfg.dtype)
    tok = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(
        lambda k: nn.unbox(llama.Llama(cfg).init(k, tok, tok, cache,
                                                 method=_init_everything)["params"]),
        jax.random.key(0))


def _check_tree(cfg: LlamaConfig, params) -> None:
    """The tree must match what the model itself uses, leaf for leaf."""
    ref = _reference_tree(cfg)
    got = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), params)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, (a, b)


def to_params(cfg: LlamaConfig, sd: dict[str, np.ndarray]) -> dict:
    """jspec params via the real converter (``jspec.checkpoint.hf.params_from_state_dict``).

    The parity tests check the *forward*; if the converter itself fails (it is checked on
    its own in ``test_converter_matches_reference_mapping``), they fall back to this file's
    reference mapping, with a warning, so a converter bug does not hide forward results.
    """
    try:
        from jspec.checkpoint.hf import params_from_state_dict
        params = params_from_state_dict(cfg, sd)
    except Exception as e:  # noqa: BLE001 - reported by the converter test
        warnings.warn(f"jspec.checkpoint.hf.params_from_state_dict failed ({e!r}); "
                      "using the test's reference mapping")
        params = _private_params_from_state_dict(cfg, sd)
    _check_tree(cfg, params)
    return params


# --------------------------------------------------------------- jspec forward
def _jspec_forward(cfg, params, tokens, aux_layers=(), page_size=16):
    """Full-sequence prefill of one row. Returns (logits [T,V], hidden [T,H], aux list)."""
    T = len(tokens)
    num_pages = kvc.pages_needed(T, page_size) + 2
    pt = kvc.allocate_page_table([T], page_size=page_size, num_pages=num_pages)
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pt, num_pages, page_size)
    model = llama.Llama(cfg)
    tok = jnp.asarray(tokens, jnp.int32)[None]
    pos = jnp.arange(T, dtype=jnp.int32)[None]

    @jax.jit
    def fwd(params, tok, pos, cache):
        hidden, aux, _ = model.apply({"params": params}, tok, pos, cache,
                                     aux_layers=tuple(aux_layers))
        return model.apply({"params": params}, hidden, method=llama.Llama.logits), hidden, aux

    logits, hidden, aux = fwd(params, tok, pos, cache)
    return np.asarray(logits[0]), np.asarray(hidden[0]), [np.asarray(a[0]) for a in aux]


def _jspec_incremental(cfg, params, tokens, n_prefill, page_size, seed=0):
    """Prefill ``n_prefill`` tokens, then decode the rest one at a time through the
    paged cache (pages handed out in shuffled order). Returns logits [T, V]."""
    T = len(tokens)
    need = kvc.pages_needed(T, page_size)
    num_pages = need + 3
    perm = np.random.default_rng(seed).permutation(num_pages)[:need].astype(np.int32)
    pt = np.full((1, need + 1), num_pages, np.int32)   # one spare, unallocated entry
    pt[0, :need] = perm
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pt, num_pages, page_size)
    model = llama.Llama(cfg)

    @jax.jit
    def step(params, tok, pos, cache):
        hidden, _, cache = model.apply({"params": params}, tok, pos, cache)
        return model.apply({"params": params}, hidden, method=llama.Llama.logits), cache

    tok = jnp.asarray(tokens, jnp.int32)[None]
    out = []
    logits, cache = step(params, tok[:, :n_prefill],
                         jnp.arange(n_prefill, dtype=jnp.int32)[None], cache)
    cache = kvc.advance(cache, n_prefill)
    out.append(logits[0])
    for t in range(n_prefill, T):
        logits, cache = step(params, tok[:, t:t + 1], cache.lengths[:, None], cache)
        cache = kvc.advance(cache, 1)
        out.append(logits[0])
    assert int(cache.lengths[0]) == T
    return np.asarray(jnp.concatenate(out, axis=0))


def _maxdiff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))


# --------------------------------------------------------------- HF side
# name: (hf kwargs, rope spelling, seq len, page size)
CASES = {
    # MHA (GQA 1), tied, default RoPE.
    "tied_gqa1_default": dict(
        hf=dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
        rope="default", T=37, page_size=16),
    # GQA 2, untied, llama3 scaling in the transformers-4 spelling, head_dim != hidden/heads
    # (48 / 4 = 12 but head_dim 16); L=6 -> aux layers {2, 3}.
    "untied_gqa2_llama3_v4_hd16": dict(
        hf=dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                tie_word_embeddings=False),
        rope="v4", T=80, page_size=7),
    # GQA 4, untied, llama3 scaling in the transformers-5 spelling, L=7 -> aux {2, 3, 4}.
    "untied_gqa4_llama3_v5": dict(
        hf=dict(vocab_size=89, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
        rope="v5", T=80, page_size=12),
    # GQA 2, tied, llama3 (v5 spelling), head_dim < hidden/heads.
    "tied_gqa2_llama3_v5_hd8": dict(
        hf=dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                tie_word_embeddings=True),
        rope="v5", T=50, page_size=16),
}


def aux_indices(L):
    return (2, L // 2, L - 3) if L >= 5 else tuple(sorted({min(2, L - 1), L // 2}))


def _hf_kwargs(case):
    kw = dict(case["hf"], rms_norm_eps=1e-5, max_position_embeddings=256,
              attn_implementation="eager", bos_token_id=1, eos_token_id=2)
    if case["rope"] == "v4":
        kw.update(rope_theta=THETA, rope_scaling=dict(LLAMA3_SCALING))
    elif case["rope"] == "v5":
        kw.update(rope_parameters=dict(LLAMA3_SCALING, rope_theta=THETA))
    else:
        kw.update(rope_theta=10000.0)
    return kw


def _v4_dict(hf_config) -> dict:
    """The config as a transformers-4 ``config.json`` spells it (rope_theta + rope_scaling,
    no rope_parameters)."""
    d = hf_config.to_dict()
    rp = dict(d.pop("rope_parameters", None) or {})
    d["rope_theta"] = rp.pop("rope_theta", 10000.0)
    d["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
    d["torch_dtype"] = d.pop("dtype", None) or "float32"
    return d


def randomize_(model, seed):
    """Replace HF's tiny init with O(1)-activation random weights so parity is meaningful.

    ``seed``: an int, or a ``torch.Generator`` to draw from (the golden-file script keeps
    drawing its input ids from the same generator afterwards)."""
    import torch
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:  # [out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    name = request.param
    case = CASES[name]
    seed = sorted(CASES).index(name) + 1
    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(**_hf_kwargs(case))
    model = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    randomize_(model, seed)
    if hf_cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    tokens = torch.randint(0, hf_cfg.vocab_size, (1, case["T"]),
                           generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True)
        base = model.model(tokens)
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return dict(
        name=name, case=case, hf_cfg=hf_cfg, sd=sd, tokens=tokens[0].numpy(),
        logits=out.logits[0].numpy(),
        hidden_states=[h[0].numpy() for h in out.hidden_states],
        last_hidden=base.last_hidden_state[0].numpy())


# --------------------------------------------------------------- tests
def test_from_hf_both_spellings(hf_case):
    hf_cfg, case = hf_case["hf_cfg"], hf_case["case"]
    v5 = LlamaConfig.from_hf(hf_cfg.to_dict())
    v4 = LlamaConfig.from_hf(_v4_dict(hf_cfg))
    assert v4 == v5
    h = case["hf"]
    assert v5.num_layers == h["num_hidden_layers"]
    assert v5.num_kv_heads == h["num_key_value_heads"]
    assert v5.head_dim == h.get("head_dim", h["hidden_size"] // h["num_attention_heads"])
    assert v5.tie_word_embeddings == h["tie_word_embeddings"]
    assert v5.dtype == "float32"
    if case["rope"] == "default":
        assert v5.rope.rope_type == "default" and v5.rope.theta == 10000.0
    else:
        assert v5.rope.rope_type == "llama3" and v5.rope.theta == THETA
        assert v5.rope.original_max_position_embeddings == 32
        assert (v5.rope.factor, v5.rope.low_freq_factor, v5.rope.high_freq_factor) == (8.0, 1.0, 4.0)
        assert case["T"] > 32
    # Legacy key ``type`` instead of ``rope_type`` (transformers <= 4.4x checkpoints).
    d = _v4_dict(hf_cfg)
    if d["rope_scaling"]:
        d["rope_scaling"]["type"] = d["rope_scaling"].pop("rope_type")
        assert LlamaConfig.from_hf(d) == v5


def test_rope_inv_freq_matches_hf(hf_case):
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = LlamaConfig.from_hf(hf_case["hf_cfg"].to_dict())
    rot = LlamaRotaryEmbedding(hf_case["hf_cfg"])
    ours = rope.rope_inv_freq(cfg.rope, cfg.head_dim)
    theirs = rot.inv_freq.to(torch.float32).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)


def test_prefill_parity(hf_case):
    # The config is read in the spelling the case was written in (the two spellings give
    # equal configs: test_from_hf_both_spellings).
    hf_cfg = hf_case["hf_cfg"]
    spelling = hf_case["case"]["rope"]
    d = _v4_dict(hf_cfg) if spelling == "v4" else hf_cfg.to_dict()
    cfg = LlamaConfig.from_hf(d)
    params = to_params(cfg, hf_case["sd"])
    aux_idx = aux_indices(cfg.num_layers)
    logits, hidden, aux = _jspec_forward(cfg, params, hf_case["tokens"], aux_idx,
                                         page_size=hf_case["case"]["page_size"])
    assert np.all(np.isfinite(logits))
    d_logits = _maxdiff(logits, hf_case["logits"])
    d_hidden = _maxdiff(hidden, hf_case["last_hidden"])
    d_aux = max(_maxdiff(a, hf_case["hidden_states"][i]) for a, i in zip(aux, aux_idx))
    print(f"{hf_case['name']}[{spelling}] logits {d_logits:.2e} hidden {d_hidden:.2e} "
          f"aux{aux_idx} {d_aux:.2e} (|logits| max {np.abs(hf_case['logits']).max():.1f})")
    assert d_logits <= TOL
    assert d_hidden <= TOL
    assert d_aux <= TOL


def test_incremental_parity(hf_case):
    case = hf_case["case"]
    cfg = LlamaConfig.from_hf(hf_case["hf_cfg"].to_dict())
    params = to_params(cfg, hf_case["sd"])
    T = case["T"]
    n0 = T // 2
    ps = case["page_size"]
    assert T % ps and n0 % ps, "page size should not divide the prompt or the prefill"
    logits = _jspec_incremental(cfg, params, hf_case["tokens"], n0, ps)
    diffs = np.max(np.abs(logits.astype(np.float64) - hf_case["logits"]), axis=-1)
    print(f"{hf_case['name']} incremental: prefill {diffs[:n0].max():.2e} "
          f"decode {diffs[n0:].max():.2e}")
    assert diffs.max() <= TOL, np.nonzero(diffs > TOL)[0]


def test_golden_parity():
    """Replays transformers' fp32 logits stored in the repo; needs no torch."""
    if not os.path.exists(GOLDEN):
        pytest.fail(f"{GOLDEN} is missing; run tests/data/make_parity_golden.py")
    with np.load(GOLDEN, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    hf_dict = json.loads(str(data.pop("config_json")))
    tokens = data.pop("input_ids").astype(np.int32)
    want = data.pop("logits")
    cfg = LlamaConfig.from_hf(hf_dict)
    assert cfg.rope.rope_type == "llama3"
    assert len(tokens) > cfg.rope.original_max_position_embeddings
    assert cfg.head_dim * cfg.num_heads != cfg.hidden_size
    assert cfg.num_heads == 2 * cfg.num_kv_heads and not cfg.tie_word_embeddings
    params = to_params(cfg, data)
    got, _, _ = _jspec_forward(cfg, params, tokens, page_size=10)  # 48 % 10 != 0
    d = _maxdiff(got, want)
    print(f"golden logits max diff {d:.2e}")
    assert d <= TOL


def test_untied_lm_head_params():
    """An untied config's parameter tree has ``lm_head``: ``init_params``/``abstract_params``
    (and so the checkpoint converter's expected shapes) must include it."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
    assert "lm_head" in llama.abstract_params(cfg)
    params = llama.init_params(cfg, jax.random.key(0))
    assert "lm_head" in params
    logits = llama.Llama(cfg).apply({"params": params}, jnp.zeros((1, 1, 32)),
                                    method=llama.Llama.logits)
    assert logits.shape == (1, 1, 64)


def test_converter_matches_reference_mapping(hf_case):
    """``params_from_state_dict`` maps HF names/layouts exactly like the reference mapping."""
    from jspec.checkpoint.hf import params_from_state_dict
    cfg = LlamaConfig.from_hf(hf_case["hf_cfg"].to_dict())
    got = params_from_state_dict(cfg, hf_case["sd"])
    want = _private_params_from_state_dict(cfg, hf_case["sd"])
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stacked_scan_equals_per_layer():
    """The packed layout TPUs/GPUs run (stacked layers, one lax.scan, aux states selected
    inside the scan) gives the per-layer (CPU) forward's hidden states, aux states and KV."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    raw = llama.init_params(cfg, jax.random.key(0))
    table = np.arange(4, dtype=np.int32).reshape(2, 2)
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, table, 4, 8)
    toks = jax.random.randint(jax.random.key(1), (2, 5), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    outs = []
    for stacked in (True, False):
        p = serving_layout.pack_params(cfg, raw, stacked=stacked)
        assert serving_layout.is_stacked(p) == stacked
        outs.append(jax.jit(lambda p, c: llama.forward(cfg, p, toks, pos, c,
                                                       aux_layers=(3, 1, 1)))(p, cache))
    (h1, a1, c1), (h2, a2, c2) = outs
    np.testing.assert_allclose(h1, h2, rtol=1e-5, atol=1e-5)
    assert len(a1) == len(a2) == 3
    for x, y in zip(a1, a2):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c1.k_pages, c2.k_pages, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c1.v_pages, c2.v_pages, rtol=1e-5, atol=1e-5)
    # Converting between the layouts round-trips.
    p = serving_layout.pack_params(cfg, serving_layout.pack_params(cfg, raw, stacked=True), stacked=False)
    q = serving_layout.pack_params(cfg, raw, stacked=False)
    jax.tree_util.tree_map(np.testing.assert_array_equal, p, q)


@pytest.mark.parametrize("chunk", [64, 100, 1000], ids=["divides", "does-not-divide", "larger"])
def test_chunked_prefill_parity_on_long_prompts(chunk):
    """Prompts of 300-500 tokens, prefilled in chunks (jspec.prefill), against transformers:
    the last position's logits and 8 greedy tokens (llama3 RoPE scaling, GQA 2, pages of 7)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import jspec
    from jspec.plan import KVConfig, plan

    case = CASES["untied_gqa2_llama3_v4_hd16"]
    hf_cfg = transformers.LlamaConfig(**{**_hf_kwargs(case), "max_position_embeddings": 640})
    model = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    randomize_(model, 7)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, hf_cfg.vocab_size, n).tolist() for n in (300, 417, 500)]
    cfg = LlamaConfig.from_hf(_v4_dict(hf_cfg))
    target = jspec.Target(cfg, to_params(cfg, {k: v.detach().numpy().copy()
                                               for k, v in model.state_dict().items()}))
    kv = KVConfig(page_size=7, prefill_chunk=chunk)
    p = plan(target, prompts, max_new_tokens=1, kv=kv)
    prompt, lens, table = p.args[:3]
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, table,
                           p.decoder.num_pages, 7, cfg.dtype)
    logits, _ = jax.jit(p.decoder.prefill)(target.serving_params, prompt, lens, cache)
    res = jspec.generate(target, prompts, max_new_tokens=8, stop_ids=[], page_size=7,
                         prefill_chunk=chunk)
    for r, ids in enumerate(prompts):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, -1].numpy()
            greedy = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert _maxdiff(np.asarray(logits[r]), want) <= TOL
        assert res.tokens[r] == greedy
