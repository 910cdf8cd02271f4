"""Synthetic drafter checkpoints in each published layout (EAGLE-1, EAGLE-3, MTP, Medusa
FasterDecoding and vLLM, DFlash), written by hand: names and HF [out, in] shapes spelt out,
independently of the loader's tables, with random values so transposes show. Also the tiny
target they draft for (``TCFG``), its plain-decoding reference (the ``target`` and ``plain``
fixtures: import them into the test module) and :func:`assert_exact`.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import jspec
from jspec.config import LlamaConfig
from jspec.llama import init_params
from jspec.target import Target

V, H, I, L, NH, NKV, HD = 97, 32, 64, 6, 4, 2, 8
TCFG = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=L, num_heads=NH,
                   num_kv_heads=NKV, head_dim=HD)
PROMPT = [[1, 5, 9, 4]]
LAYER_CFG = {"hidden_size": H, "intermediate_size": I, "num_attention_heads": NH,
             "num_key_value_heads": NKV, "head_dim": HD, "rms_norm_eps": 1e-5, "vocab_size": V}


@pytest.fixture(scope="module")
def target():
    return Target(TCFG, init_params(TCFG, jax.random.key(1)))


@pytest.fixture(scope="module")
def plain(target):
    return jspec.generate(target, PROMPT, max_new_tokens=12, stop_ids=[]).tokens


def assert_exact(target, plain, drafter):
    out = jspec.generate(target, PROMPT, max_new_tokens=12, drafter=drafter, stop_ids=[]).tokens
    assert out == plain


_rng = np.random.default_rng(0)


def rnd(*shape):
    return _rng.standard_normal(shape).astype(np.float32) * 0.1


def write(path, config, tensors, shards=1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, path / "model.safetensors")
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, path / fname)
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def attn_mlp(prefix, in_width=H, inter=I):
    """HF-named attention + MLP weights ([out, in]) under ``prefix``."""
    return {
        f"{prefix}self_attn.q_proj.weight": rnd(NH * HD, in_width),
        f"{prefix}self_attn.k_proj.weight": rnd(NKV * HD, in_width),
        f"{prefix}self_attn.v_proj.weight": rnd(NKV * HD, in_width),
        f"{prefix}self_attn.o_proj.weight": rnd(H, NH * HD),
        f"{prefix}post_attention_layernorm.weight": 1 + rnd(H),
        f"{prefix}mlp.gate_proj.weight": rnd(inter, H),
        f"{prefix}mlp.up_proj.weight": rnd(inter, H),
        f"{prefix}mlp.down_proj.weight": rnd(H, inter),
    }


def eagle1_ckpt(path, bias, inter=48, hidden=H, drop=(), **cfg_over):
    t = {"fc.weight": rnd(hidden, 2 * hidden), "embed_tokens.weight": rnd(V, hidden)}
    if bias:
        t["fc.bias"] = rnd(hidden)
    t.update(attn_mlp("layers.0.", hidden, inter) if hidden == H else {
        k: rnd(*[hidden if s == H else s for s in v.shape])
        for k, v in attn_mlp("layers.0.", H, inter).items()})
    for k in drop:
        del t[k]
    cfg = {**LAYER_CFG, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
           "intermediate_size": inter, "bias": bias, **cfg_over}
    return write(path, cfg, t), t


def eagle3_ckpt(path, Vd=48, aux_ids=(0, 2, 4), d2t=None, drop=(), extra=None, **cfg_over):
    t = {"fc.weight": rnd(H, 3 * H),
         "midlayer.input_layernorm.weight": 1 + rnd(H),
         "midlayer.hidden_norm.weight": 1 + rnd(H),
         **attn_mlp("midlayer.", 2 * H),
         "norm.weight": 1 + rnd(H),
         "lm_head.weight": rnd(Vd, H),
         "t2d": np.zeros(V, bool),
         "embed_tokens.weight": rnd(V, H)}
    if d2t is None:   # draft id i -> target id 2i (even ids), stored as offsets
        d2t = np.arange(Vd, dtype=np.int64)
    t["d2t"] = np.asarray(d2t, np.int64)
    t.update(extra or {})
    for k in drop:
        del t[k]
    cfg = {**LAYER_CFG, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
           "draft_vocab_size": Vd, **cfg_over}
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    return write(path, cfg, t), t


def dflash_ckpt(path, layers=2, taps=(1, 3), block=6, mask=3, drop=(), **cfg_over):
    """z-lab / SpecForge DFlash: ``fc`` over the concatenated taps, per-head q/k norms, no
    embedding and no LM head (the target's)."""
    t = {"fc.weight": rnd(H, len(taps) * H), "hidden_norm.weight": 1 + rnd(H),
         "norm.weight": 1 + rnd(H)}
    for i in range(layers):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + rnd(H), p + "self_attn.q_norm.weight": 1 + rnd(HD),
                  p + "self_attn.k_norm.weight": 1 + rnd(HD), **attn_mlp(p)})
    for k in drop:
        del t[k]
    cfg = {**LAYER_CFG, "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "num_hidden_layers": layers, "block_size": block, "num_target_layers": L,
           "layer_types": ["full_attention"] * layers,
           "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(taps)}, **cfg_over}
    return write(path, cfg, t), t


def mtp_ckpt(path, M=1, head=True, hv=V, layers=L, drop=()):
    t = {"model.embed_tokens.weight": rnd(V, H)}   # the target's own tensors may sit beside
    for k in range(M):
        p = f"model.layers.{L + k}."
        t.update({p + "enorm.weight": 1 + rnd(H), p + "hnorm.weight": 1 + rnd(H),
                  p + "eh_proj.weight": rnd(H, 2 * H), p + "input_layernorm.weight": 1 + rnd(H),
                  p + "shared_head.norm.weight": 1 + rnd(H), p + "embed_tokens.weight": rnd(V, H),
                  **attn_mlp(p)})
        if head:
            t[p + "shared_head.head.weight"] = rnd(hv, H)
    for k in drop:
        del t[k]
    cfg = {**LAYER_CFG, "num_hidden_layers": layers, "num_nextn_predict_layers": M}
    return write(path, cfg, t), t


def medusa_fd_ckpt(path, heads=3, layers=1, hidden=H, vocab=V):
    t = {}
    for i in range(heads):
        for j in range(layers):
            t[f"{i}.{j}.linear.weight"] = rnd(hidden, hidden)
            t[f"{i}.{j}.linear.bias"] = rnd(hidden)
        t[f"{i}.{layers}.weight"] = rnd(vocab, hidden)
    cfg = {"medusa_num_heads": heads, "medusa_num_layers": layers,
           "base_model_name_or_path": "tiny"}
    return write(path, cfg, t), t


def medusa_vllm_ckpt(path, heads=3, layers=1, Vd=None, token_map=None, vocab=V):
    t = {}
    for i in range(heads):
        for j in range(layers):
            t[f"blocks.{i}.layers.{j}.weight"] = rnd(H, H)
            t[f"blocks.{i}.layers.{j}.bias"] = rnd(H)
        t[f"lm_heads.{i}.weight"] = rnd(Vd or vocab, H)
    if token_map is not None:
        t["token_map"] = np.asarray(token_map, np.int64)
    cfg = {"model_type": "medusa", "hidden_size": H, "vocab_size": vocab, "num_heads": heads,
           "num_hidden_layers": layers, "truncated_vocab_size": Vd}
    return write(path, cfg, t), t
