"""GGUF targets: every tensor type jspec reads, llama.cpp's Q/K permutation, configs and
tokenizers from the metadata, and the errors damaged or foreign files get."""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from helpers.gguf_files import (hf_bpe_tokenizer_meta, llama2c_tokenizer_meta,  # noqa: E402
                                write_llama_gguf)

import jspec  # noqa: E402
from jspec.checkpoint import (CheckpointError, load_config, load_target,  # noqa: E402
                              state_dict_from_params)
from jspec.checkpoint.common import flatten  # noqa: E402
from jspec.checkpoint.gguf import (dequantize, gguf_table, open_gguf, permute_qk,  # noqa: E402
                                   unpermute_qk)
from jspec.config import LlamaConfig, RopeConfig  # noqa: E402
from jspec.llama import init_params  # noqa: E402

Q = gguf.GGMLQuantizationType
# F32/F16/BF16, the legacy blocks and the K-quants, plus every other type gguf dequantizes.
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
TYPES += sorted({t.name for t in gguf.quants._type_traits} - set(TYPES))

# Rows of 256 (the K-quants' block), GQA 2, untied, so every table row is used.
QCFG = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=False,
                   eos_token_ids=(2,), bos_token_id=1)


def _byte_vocab(n: int) -> dict:
    """A minimal gpt2 vocabulary: ``n`` tokens, no merges."""
    toks = ["<s>", "</s>", "!\""] + [chr(0x21 + i) for i in range(n - 3)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": toks, "tokenizer.ggml.token_type": [3, 3] + [1] * (n - 2),
            "tokenizer.ggml.merges": ["! \""], "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 1}


def _random_state_dict(cfg, seed=0):
    import jax
    params = init_params(cfg, jax.random.key(seed))
    return state_dict_from_params(cfg, params)


@pytest.mark.parametrize("name", TYPES)
def test_every_type_round_trips(tmp_path, name):
    """Written with gguf's writer in ``name``, loaded by jspec: each parameter is exactly
    ``gguf.quants.dequantize`` of the stored blocks (Q/K unpermuted, transposed)."""
    qtype = Q[name]
    sd = _random_state_dict(QCFG)
    f = tmp_path / "m.gguf"
    raw = write_llama_gguf(f, QCFG, sd, _byte_vocab(QCFG.vocab_size), qtype=qtype)
    target = load_target(f)
    flat = flatten(target.params)
    for gname, path, transpose, perm in gguf_table(target.config):
        stored = raw[gname]              # norms are F32 vectors, every matrix is in ``qtype``
        want = np.asarray(gguf.quants.dequantize(stored, qtype if stored.ndim == 2 else Q.F32))
        if perm:
            want = unpermute_qk(want, QCFG.num_heads if perm == "q" else QCFG.num_kv_heads)
        got = np.asarray(flat[path])
        np.testing.assert_array_equal(got.T if transpose else got, want, err_msg=gname)


def test_permutation_is_undone_and_stories_matches_run_c(tmp_path, stories_dir):
    """stories260K written as llama.cpp writes it (Q/K rows permuted, SentencePiece vocabulary
    from its tok512.bin): the GGUF loads to the HF parameters exactly, its tokenizer encodes as
    run.c does, and greedy decoding reproduces run.c's reference continuations."""
    from jspec.tokenizer import Llama2cTokenizer
    hf = load_target(stories_dir)
    l2c = Llama2cTokenizer.from_file(stories_dir / "tok512.bin")
    f = tmp_path / "stories.gguf"
    write_llama_gguf(f, hf.config, state_dict_from_params(hf.config, hf.params),
                     llama2c_tokenizer_meta(l2c))
    g = load_target(f)
    assert g.config == hf.config.replace(eos_token_ids=(2,))   # run.c's BOS stop is HF's own
    for path, arr in flatten(hf.params).items():
        np.testing.assert_array_equal(np.asarray(flatten(g.params)[path]), np.asarray(arr))
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    for case in ref["cases"]:
        assert g.tokenizer.encode(case["prompt"]) == case["prompt_token_ids"]
        assert g.tokenizer.encode(case["prompt"]) == l2c.encode(case["prompt"])
    for text in ["Hello, world!", "  two spaces\nand a newline", "caf\u00e9 \u00fcber"]:
        assert g.tokenizer.encode(text) == l2c.encode(text), text
        assert g.tokenizer.decode(g.tokenizer.encode(text)) == text
    cases = ref["cases"][:2]
    out = jspec.generate(g, [c["prompt_token_ids"] for c in cases], max_new_tokens=100,
                         stop_ids=[])
    for c, toks in zip(cases, out.tokens):
        assert list(toks) == c["continuation_token_ids"]


def test_permute_inverse():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert not np.array_equal(permute_qk(w, 8), w)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 8), 8), w)


# A few lines in several scripts, for the llama-bpe tokenizer fixture.
MULTILINGUAL = [
    "Hello world! It's 2024, and we're testing tokenizers.",
    "Le caf\u00e9 est tr\u00e8s bon ; l'\u00e9t\u00e9 arrive.",
    "Der Stra\u00dfenverkehr in M\u00fcnchen ist 123456 km lang.",
    "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u5427\u3002",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043a\u0430\u043a \u0434\u0435\u043b\u0430?",
    "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c \U0001F600\U0001F680 emoji",
    "def f(x):\n\treturn x  +  1\n\n\n",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
]


def _llama3_hf_tokenizer():
    """A byte-level BPE trained on :data:`MULTILINGUAL` with Llama-3's split and
    ``ignore_merges``, plus Llama-3's special tokens: a tokenizer.json of the Llama-3 kind."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from jspec.checkpoint.gguf_tokenizer import PRE_TOKENIZERS
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = PRE_TOKENIZERS["llama-bpe"][0]()
    tok.decoder = decoders.ByteLevel()
    from tokenizers import pre_tokenizers
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>",
                                                  "<|eot_id|>"])
    tok.train_from_iterator(MULTILINGUAL * 3, trainer)
    return tok


def test_llama3_style_gguf(tmp_path):
    """A Llama-3-style file (llama-bpe pre-tokenizer, llama3 RoPE scaling, BOS added): the config
    carries the scaling, and the tokenizer encodes the multilingual sample exactly as the
    tokenizer.json it was made from."""
    hf_tok = _llama3_hf_tokenizer()
    doc = json.loads(hf_tok.to_str())
    V = hf_tok.get_vocab_size()
    special = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
    meta = hf_bpe_tokenizer_meta(doc, "llama-bpe", special)
    meta.update({"tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
                 "tokenizer.ggml.eot_token_id": 2, "tokenizer.ggml.add_bos_token": True})
    cfg = QCFG.replace(vocab_size=V, hidden_size=64, intermediate_size=96, head_dim=16,
                       rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 64),
                       max_position_embeddings=256)
    f = tmp_path / "llama3.gguf"
    write_llama_gguf(f, cfg, _random_state_dict(cfg), meta)
    c = load_config(f)
    assert c.rope == cfg.rope and c.eos_token_ids == (1, 2) and c.vocab_size == V
    t = load_target(f).tokenizer
    assert t.bos_id == 0
    for text in MULTILINGUAL + [" leading", "trailing  ", "<|eot_id|> inside"]:
        want = hf_tok.encode(text, add_special_tokens=False).ids
        assert t.encode(text, bos=False) == want, text
        assert t.encode(text) == [0] + want
        assert t.decode(want) == hf_tok.decode(want, skip_special_tokens=True)


CHATML = ("{% for m in messages %}{{ '<|begin_of_text|>' if loop.first }}{{ m['role'] }}: "
          "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}assistant: "
          "{% endif %}")


@pytest.mark.parametrize("to", ["orbax", "hf"])
def test_convert_gguf(tmp_path, to):
    """``python -m jspec.convert model.gguf DST [--to hf]``: the converted copy has the same
    weights, config, tokenizer and chat template; DST is written whole (no stray files)."""
    from jspec.convert import main
    hf_tok = _llama3_hf_tokenizer()
    meta = hf_bpe_tokenizer_meta(json.loads(hf_tok.to_str()), "llama-bpe",
                                 ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
    meta.update({"tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
                 "tokenizer.chat_template": CHATML})
    V = hf_tok.get_vocab_size()
    cfg = QCFG.replace(vocab_size=V, hidden_size=64, intermediate_size=96, head_dim=16)
    f = tmp_path / "m.gguf"
    write_llama_gguf(f, cfg, _random_state_dict(cfg), meta, qtype=Q.Q8_0)
    dst = tmp_path / "out"
    assert main([str(f), str(dst), "--to", to]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]
    a, b = load_target(f), load_target(dst)
    assert a.config == b.config
    for path, arr in flatten(a.params).items():
        np.testing.assert_array_equal(np.asarray(flatten(b.params)[path]), np.asarray(arr))
    msgs = [{"role": "user", "content": "Le caf\u00e9 <|eot_id|> 123"}]
    assert a.tokenizer.apply_chat_template(msgs, add_generation_prompt=True) == \
        b.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert a.tokenizer.end_of_turn_ids == b.tokenizer.end_of_turn_ids == (2, 1)
    for text in MULTILINGUAL:
        assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert main([str(f), str(dst), "--to", to]) == 2            # exists: refused, untouched


def test_smollm_splits_digits_one_by_one(tmp_path):
    """``smollm`` (like llama.cpp, and SmolLM's own tokenizer.json) splits every digit before
    merging: a merge "1 2" in the vocabulary is never used; ``gpt-2`` does use it."""
    toks = ["<|im_end|>", "1", "2", "12", "a", "b", "ab", "\u0120", "\u0120a"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": toks,
            "tokenizer.ggml.token_type": [3] + [1] * 8,
            "tokenizer.ggml.merges": ["1 2", "a b", "\u0120 a"], "tokenizer.ggml.eos_token_id": 0}
    cfg = QCFG.replace(vocab_size=len(toks), hidden_size=64, intermediate_size=64, head_dim=16)
    for pre, want in (("smollm", [1, 2, 7, 6]), ("gpt-2", [3, 7, 6])):
        f = tmp_path / f"{pre}.gguf"
        write_llama_gguf(f, cfg, _random_state_dict(cfg), {**meta, "tokenizer.ggml.pre": pre})
        assert load_target(f).tokenizer.encode("12 ab", bos=False) == want, pre


# ------------------------------------------------------------------------- bad files
def _small(tmp_path, name="m.gguf", **kw):
    cfg = QCFG.replace(hidden_size=64, intermediate_size=64, head_dim=16)
    f = tmp_path / name
    tok = kw.pop("tokenizer", _byte_vocab(cfg.vocab_size))
    write_llama_gguf(f, cfg, _random_state_dict(cfg), tok, **kw)
    return f


def test_truncated_file(tmp_path):
    f = _small(tmp_path)
    data = f.read_bytes()
    for cut in (len(data) - 100, 40):
        g = tmp_path / f"cut{cut}.gguf"
        g.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=rf"cut{cut}\.gguf.*truncated"):
            load_target(g)


def test_unknown_tensor_type(tmp_path):
    f = _small(tmp_path)
    r = open_gguf(f)
    t = r.tensors[0]
    data = bytearray(f.read_bytes())
    info = r.tensors[0].field
    off = int(info.offset) + sum(int(p.nbytes) for p in info.parts[:-2])
    assert int.from_bytes(data[off:off + 4], "little") == int(t.tensor_type)
    data[off:off + 4] = (250).to_bytes(4, "little")
    g = tmp_path / "badtype.gguf"
    g.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"badtype\.gguf.*unknown GGML type"):
        load_target(g)


def test_foreign_architecture(tmp_path):
    f = _small(tmp_path, "qwen.gguf", arch="qwen2",
               extra_tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)})
    with pytest.raises(CheckpointError, match=r"qwen\.gguf.*general\.architecture='qwen2'"):
        load_target(f)
    g = _small(tmp_path, "bias.gguf", extra_tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)})
    with pytest.raises(CheckpointError, match=r"bias\.gguf.*'blk\.0\.attn_q\.bias'"):
        load_target(g)


def test_missing_tokenizer(tmp_path):
    f = _small(tmp_path, "notok.gguf", tokenizer={})
    with pytest.raises(CheckpointError, match=r"notok\.gguf.*tokenizer\.ggml\.model"):
        load_target(f)


def test_unknown_pre_tokenizer(tmp_path):
    f = _small(tmp_path, "pre.gguf", tokenizer={**_byte_vocab(64), "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(CheckpointError, match=r"pre\.gguf.*tokenizer\.ggml\.pre='qwen2'"):
        load_target(f)


def test_non_finite_weights(tmp_path):
    cfg = QCFG.replace(hidden_size=64, intermediate_size=64, head_dim=16)
    sd = _random_state_dict(cfg)
    sd["model.layers.0.mlp.up_proj.weight"][3, 5] = np.nan
    f = tmp_path / "nan.gguf"
    write_llama_gguf(f, cfg, sd, _byte_vocab(cfg.vocab_size))
    with pytest.raises(CheckpointError, match=r"nan\.gguf.*'blk\.0\.ffn_up\.weight'.*non-finite"):
        load_target(f)


def test_not_gguf(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(CheckpointError, match=r"x\.gguf: not a GGUF file"):
        load_target(f)


def test_dequantize_names_unsupported_type(tmp_path):
    f = _small(tmp_path)
    r = open_gguf(f)
    t = r.tensors[1]

    class Fake:
        name, data, shape = t.name, t.data, t.shape
        tensor_type = Q.Q4_0_4_4 if hasattr(Q, "Q4_0_4_4") else Q.Q8_1
    with pytest.raises(CheckpointError, match="cannot dequantize"):
        dequantize(r, Fake)
