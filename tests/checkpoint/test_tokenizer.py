import json

import pytest

from jspec.tokenizer import (HFTokenizer, Llama2cTokenizer, TokenizerError, find_tokenizer,
                             load_tokenizer)


@pytest.fixture(scope="module")
def tok512(stories_dir):
    return Llama2cTokenizer.from_file(stories_dir / "tok512.bin")


def test_stories_reference_prompts(tok512, stories_dir):
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    assert ref["cases"]
    for case in ref["cases"]:
        assert tok512.encode(case["prompt"]) == case["prompt_token_ids"], case["prompt"]


def test_stories_known_ids(tok512):
    assert tok512.vocab_size == 512
    assert tok512.bos_id == 1 and tok512.eos_ids == (2,)
    assert tok512.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok512.encode("") == [1]
    assert tok512.encode("", bos=False) == []


def test_stories_decode_matches_runc_text(tok512, stories_dir):
    case = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"][0]
    assert tok512.decode(case["prompt_token_ids"] + case["continuation_token_ids"]) == case["text"]


@pytest.mark.parametrize("text", ["Once upon a time", "Hello, World!  two  spaces\nnewline",
                                  "The cat sat on the mat. 123"])
def test_ascii_round_trip(tok512, text):
    assert tok512.decode(tok512.encode(text)) == text


def test_byte_fallback_round_trip(tok512):
    text = "naïve café 🙂"
    ids = tok512.encode(text)
    assert any(3 <= i < 259 for i in ids)  # emoji is not in a 512 vocab
    assert tok512.decode(ids) == text


def _tiny():
    # unk, BOS, EOS, 256 bytes, then pieces; scores decide merge order.
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(256)]
    extra = {b" ": 0.0, b"a": 0.0, b"b": 0.0, b"ab": 1.0, b"ba": 1.0, b" a": -1.0}
    scores = [0.0] * len(pieces) + list(extra.values())
    return Llama2cTokenizer(pieces + list(extra), scores)


def test_merge_prefers_highest_score_then_first():
    t = _tiny()
    ids = {p: i for i, p in enumerate(t.pieces)}
    # " aba": pairs (" ","a")=-1, ("a","b")=1, ("b","a")=1 -> the first 1.0 pair wins.
    assert t.encode("aba") == [1, ids[b" "], ids[b"ab"], ids[b"a"]]
    # unknown codepoint -> its UTF-8 bytes + 3
    assert t.encode("é", bos=False) == [ids[b" "], 0xC3 + 3, 0xA9 + 3]
    assert t.decode(t.encode("é")) == "é"


def test_llama2c_save_load(tmp_path):
    t = _tiny()
    t.save(tmp_path / "tok.bin")
    u = Llama2cTokenizer.from_file(tmp_path / "tok.bin")
    assert u.pieces == t.pieces and u.scores == t.scores and u.filename == "tok.bin"


def test_llama2c_truncated(tmp_path):
    data = (b"\x07\x00\x00\x00" + b"\x00\x00\x00\x00" + b"\x05\x00\x00\x00" + b"ab")
    (tmp_path / "tok.bin").write_bytes(data)
    with pytest.raises(TokenizerError, match="token 0"):
        Llama2cTokenizer.from_file(tmp_path / "tok.bin")


def _hf_json(tmp_path, add_bos=True):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_detects_bos(tmp_path):
    t = load_tokenizer(_hf_json(tmp_path), eos_ids=[2])
    assert isinstance(t, HFTokenizer)
    assert t.bos_id == 1 and t.eos_ids == (2,) and t.vocab_size == 5
    assert t.encode("hello world") == [1, 3, 4]
    assert t.encode("hello world", bos=False) == [3, 4]
    assert t.decode([1, 3, 4, 2]) == "hello world"


def test_hf_tokenizer_without_bos(tmp_path):
    path = _hf_json(tmp_path, add_bos=False)
    assert HFTokenizer.from_file(path).encode("hello") == [3]
    assert HFTokenizer.from_file(path, bos_id=1).encode("hello") == [1, 3]


def test_load_tokenizer_dispatch(tmp_path):
    _tiny().save(tmp_path / "tok9.bin")
    assert isinstance(load_tokenizer(tmp_path), Llama2cTokenizer)
    assert find_tokenizer(tmp_path).name == "tok9.bin"
    _hf_json(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)  # tokenizer.json wins
    (tmp_path / "vocab.txt").write_text("x")
    with pytest.raises(TokenizerError, match="unrecognised"):
        load_tokenizer(tmp_path / "vocab.txt")
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "nope.bin")
