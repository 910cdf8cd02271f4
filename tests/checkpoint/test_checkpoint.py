import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jspec import kv_cache as kvc
from jspec.checkpoint import (CheckpointError, detect_format, load_hf, load_llama2c,
                              load_orbax, load_target, params_from_state_dict, save_hf,
                              save_llama2c, save_orbax, state_dict_from_params)
from jspec.checkpoint import orbax_io
from jspec.config import ConfigError
from jspec.llama import Llama, init_params
from jspec.tokenizer import Llama2cTokenizer

from helpers.tiny_targets import l2c_target, tiny_cfg, tiny_params, tiny_target, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_matches_init_params():
    for tied in (True, False):
        cfg = tiny_cfg(tied)
        params = init_params(cfg, jax.random.key(0))
        if not tied:
            params = dict(params, lm_head={"kernel": jnp.ones((16, 48))})
        assert (jax.tree.structure(params)
                == jax.tree.structure(tiny_params(cfg)))
        sd = state_dict_from_params(cfg, params)
        assert_params_equal(params_from_state_dict(cfg, sd), params)


def assert_params_equal(a, b):
    fa, ta = jax.tree_util.tree_flatten_with_path(a)
    fb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(fa, fb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert x.tobytes() == y.tobytes(), path  # bitwise


def logits(target, tokens):
    return np.asarray(_logits(target.config, target.params, jnp.asarray([tokens], jnp.int32)))[0]


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, tok):
    T = tok.shape[1]
    pages = kvc.pages_needed(T, 16)
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                           kvc.allocate_page_table([T], 16, pages), pages, 16, cfg.dtype)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    m = Llama(cfg)
    hidden, _, _ = m.apply({"params": params}, tok, pos, cache)
    return m.apply({"params": params}, hidden, method=Llama.logits)


# ------------------------------------------------------------------ HF safetensors
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_round_trip(tmp_path, tied, dtype):
    t = tiny_target(tied, dtype)
    save_hf(t, tmp_path)
    u = load_hf(tmp_path)
    assert u.config == t.config
    assert_params_equal(u.params, t.params)
    assert detect_format(tmp_path) == "hf"


def test_hf_sharded_index(tmp_path):
    t = tiny_target(tied=False, dtype="bfloat16")
    sd = state_dict_from_params(t.config, t.params)
    assert sd["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, tmp_path / fname, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(t.config.to_json())
    u = load_target(tmp_path)
    assert_params_equal(u.params, t.params)
    # dtype override casts on load
    v = load_target(tmp_path, dtype="float32")
    assert v.config.dtype == "float32"
    assert_params_equal(v.params, jax.tree.map(lambda x: x.astype(jnp.float32), t.params))


def test_tied_config_ignores_lm_head():
    t = tiny_target(tied=True)
    sd = state_dict_from_params(t.config, t.params)
    sd["lm_head.weight"] = np.zeros((48, 16), np.float32)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(2, np.float32)
    assert_params_equal(params_from_state_dict(t.config, sd), t.params)
    assert_params_equal(params_from_state_dict(t.config, sd.__getitem__), t.params)


def test_wrong_shape_names_tensor():
    t = tiny_target()
    sd = state_dict_from_params(t.config, t.params)
    sd["model.layers.1.mlp.down_proj.weight"] = np.zeros((16, 23), np.float32)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*"
                                              r"\(16, 23\).*\(16, 24\)"):
        params_from_state_dict(t.config, sd)


def test_missing_tensor_names_it(tmp_path):
    t = tiny_target(tied=False)
    sd = state_dict_from_params(t.config, t.params)
    del sd["lm_head.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(t.config.to_json())
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        load_hf(tmp_path)


def test_corrupt_safetensors(tmp_path):
    save_hf(tiny_target(), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_hf(tmp_path)


def test_yarn_rope_is_config_error(tmp_path):
    t = tiny_target()
    save_hf(t, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="yarn"):
        load_target(tmp_path)


def test_unrecognised_paths(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_target(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="neither"):
        load_target(tmp_path)
    (tmp_path / "w.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unrecognised"):
        load_target(tmp_path / "w.pt")


@pytest.mark.parametrize("tied", [True, False])
def test_load_vs_transformers(tmp_path, tied):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tied, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg)
    with torch.no_grad():  # norms start at ones; make them distinguishable
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p))
    model.save_pretrained(tmp_path)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    t = load_hf(tmp_path)
    assert t.config.tie_word_embeddings == tied and t.config.rms_norm_eps == 1e-6
    assert ("lm_head" in t.params) == (not tied)
    ref = params_from_state_dict(t.config, sd)
    assert_params_equal(t.params, ref)
    np.testing.assert_array_equal(
        t.params["layers_1"]["self_attn"]["k_proj"]["kernel"],
        sd["model.layers.1.self_attn.k_proj.weight"].T)
    # Same numbers out of the forward pass as transformers.
    ids = [1, 5, 9, 3, 7, 2]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits(t, ids), want, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------ llama2.c
@pytest.mark.parametrize("tied", [True, False])
def test_llama2c_round_trip(tmp_path, tied):
    t = l2c_target(tied)
    save_llama2c(t, tmp_path / "model.bin")
    tiny_tokenizer().save(tmp_path / "tok48.bin")
    assert detect_format(tmp_path / "model.bin") == "llama2c"
    u = load_target(tmp_path / "model.bin")
    assert u.config == t.config
    assert_params_equal(u.params, t.params)
    assert isinstance(u.tokenizer, Llama2cTokenizer) and u.tokenizer.vocab_size == 48
    header = np.fromfile(tmp_path / "model.bin", "<i4", 7)
    assert header[5] == (48 if tied else -48)


def test_llama2c_rope_permutation(tmp_path):
    # A q row at interleaved index 2j+1 of head h lands at j + head_dim/2 in rotate-half.
    t = l2c_target(True)
    save_llama2c(t, tmp_path / "m.bin")
    raw = np.fromfile(tmp_path / "m.bin", "<f4", offset=28)
    V, D, L = 48, 16, 2
    wq0 = raw[V * D + L * D:][: D * D].reshape(D, D)  # layer 0, [out, in]
    q = np.asarray(t.params["layers_0"]["self_attn"]["q_proj"]["kernel"]).T
    h, j, hd = 2, 1, 4
    np.testing.assert_array_equal(wq0[h * hd + 2 * j + 1], q[h * hd + j + hd // 2])
    np.testing.assert_array_equal(wq0[h * hd + 2 * j], q[h * hd + j])


def test_llama2c_truncated(tmp_path):
    save_llama2c(l2c_target(False), tmp_path / "m.bin")
    data = (tmp_path / "m.bin").read_bytes()
    (tmp_path / "m.bin").write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match=r"implies \d+ bytes"):
        load_llama2c(tmp_path / "m.bin")
    (tmp_path / "m.bin").write_bytes(data[:10])
    with pytest.raises(CheckpointError, match="too short"):
        load_llama2c(tmp_path / "m.bin")


def test_llama2c_refuses_unrepresentable(tmp_path):
    with pytest.raises(CheckpointError, match="rms_norm_eps"):
        save_llama2c(tiny_target(rms_norm_eps=1e-6), tmp_path / "m.bin")


# ------------------------------------------------------------------ Orbax
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip(tmp_path, dtype):
    t = tiny_target(tied=False, dtype=dtype, tokenizer=tiny_tokenizer())
    save_orbax(t, tmp_path / "ck")
    assert detect_format(tmp_path / "ck") == "orbax"
    meta = json.loads((tmp_path / "ck" / "jspec_config.json").read_text())
    assert meta["jspec"]["tokenizer"] == "tokenizer.bin"
    u = load_orbax(tmp_path / "ck")
    assert u.config == t.config
    assert_params_equal(u.params, t.params)
    assert u.tokenizer.pieces == t.tokenizer.pieces
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp dirs left behind


def test_orbax_overwrite(tmp_path):
    t = tiny_target()
    save_orbax(t, tmp_path / "ck")
    with pytest.raises(FileExistsError):
        save_orbax(t, tmp_path / "ck")
    t2 = tiny_target(tied=False)
    save_orbax(t2, tmp_path / "ck", overwrite=True)
    assert_params_equal(load_orbax(tmp_path / "ck").params, t2.params)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.mark.parametrize("where", ["params", "tokenizer"])
def test_orbax_failure_leaves_nothing(tmp_path, monkeypatch, where):
    def boom(*a, **k):
        raise RuntimeError("disk on fire")
    if where == "params":
        monkeypatch.setattr(orbax_io.ocp.PyTreeCheckpointer, "save", boom)
    else:
        monkeypatch.setattr(Llama2cTokenizer, "save", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        save_orbax(tiny_target(tokenizer=tiny_tokenizer()), tmp_path / "ck")
    assert os.listdir(tmp_path) == []


def test_orbax_shape_mismatch_names_tensor(tmp_path):
    save_orbax(tiny_target(), tmp_path / "ck")
    f = tmp_path / "ck" / "jspec_config.json"
    meta = json.loads(f.read_text())
    meta["intermediate_size"] = 20
    f.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"layers_0/mlp/down_proj/kernel.*\(24, 16\)"):
        load_target(tmp_path / "ck")


def _convert(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jspec.convert", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def test_convert_cli_error_is_one_line(tmp_path):
    t = l2c_target(True)
    save_llama2c(t, tmp_path / "m.bin")
    with open(tmp_path / "m.bin", "r+b") as f:
        f.truncate(100)
    r = _convert(tmp_path / "m.bin", tmp_path / "out")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "implies" in last
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ stories260K
@pytest.fixture(scope="module")
def stories(stories_dir):
    return load_hf(stories_dir)


def test_stories_greedy_matches_runc(stories, stories_dir):
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    assert isinstance(stories.tokenizer, Llama2cTokenizer)
    assert stories.config.eos_token_ids == (1, 2)  # from generation_config.json
    for case in ref["cases"]:
        prompt = stories.tokenizer.encode(case["prompt"])
        cont = case["continuation_token_ids"]
        seq = prompt + cont[:-1]  # teacher-forced: one forward per case
        # Same padded length for every case so it compiles once; causal, so padding is inert.
        lg = logits(stories, seq + [0] * (128 - len(seq)))
        pred = lg[len(prompt) - 1:len(seq)].argmax(-1).tolist()
        assert pred == cont, case["prompt"]


def test_stories_llama2c_round_trip(stories, stories_dir, tmp_path):
    save_llama2c(stories, tmp_path / "stories260K.bin")
    # The original export is 1,056,540 bytes (SOURCE.md); same layout, same size.
    assert (tmp_path / "stories260K.bin").stat().st_size == 1_056_540
    u = load_target(tmp_path / "stories260K.bin", tokenizer=stories_dir / "tok512.bin")
    assert u.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert_params_equal(u.params, stories.params)
    ids = [1, 403, 407, 261, 378]
    np.testing.assert_array_equal(logits(u, ids), logits(stories, ids))
    assert np.argmax(logits(u, ids)[-1]) == 432


def test_stories_convert_cli(stories, stories_dir, tmp_path):
    r = _convert(stories_dir, tmp_path / "orbax")
    assert r.returncode == 0, r.stderr
    u = load_target(tmp_path / "orbax")
    assert u.config == stories.config
    assert_params_equal(u.params, stories.params)
    assert u.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    r = _convert(stories_dir, tmp_path / "orbax")
    assert r.returncode == 2 and "already exists" in r.stderr
