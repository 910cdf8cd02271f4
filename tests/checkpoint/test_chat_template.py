"""Chat templates (``jspec/chat_template.py``, ``HFTokenizer.apply_chat_template``): text and ids
equal transformers' for SmolLM2's ChatML and Llama-3.1-Instruct's template, the errors, the
end-of-turn ids, and the template surviving the checkpoint formats.

The goldens (``tests/data/chat_golden.json``) and the two tokenizer directories under
``tests/data/tokenizers/`` are written by ``tests/data/make_chat_golden.py``; only the ``hf``
tests at the end need transformers, to recompute them live."""

import datetime
import json
import shutil
from pathlib import Path

import pytest
from helpers.tiny_targets import tiny_target, tiny_tokenizer

from jspec.chat_template import ChatTemplateError, compile_template, render
from jspec.checkpoint.hf import load_hf, save_hf
from jspec.checkpoint.orbax_io import load_orbax, save_orbax
from jspec.tokenizer import HFTokenizer, TokenizerError, load_tokenizer, read_chat_files

DATA = Path(__file__).resolve().parents[1] / "data"
TOKENIZERS = DATA / "tokenizers"
GOLDEN = json.loads((DATA / "chat_golden.json").read_text())
CASES = GOLDEN["cases"]
CASE_IDS = [f"{c['tokenizer']}-{c['name']}-{'gen' if c['add_generation_prompt'] else 'nogen'}"
            for c in CASES]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def toks():
    """Both fixtures through jspec's HF loading path (a directory holding tokenizer.json)."""
    return {name: load_tokenizer(TOKENIZERS / name) for name in ("smollm2", "llama31")}


# ------------------------------------------------------------------ goldens
def test_golden_covers_the_issue():
    names = {(c["tokenizer"], c["name"], c["add_generation_prompt"]) for c in CASES}
    for tok in ("smollm2", "llama31"):
        for chat in ("no_system", "system", "multi_turn", "unicode", "whitespace", "special_text"):
            assert {(tok, chat, True), (tok, chat, False)} <= names
    assert all(c["kwargs"]["date_string"] == "26 Jul 2024" for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_text_and_ids_equal_transformers(toks, case):
    tok = toks[case["tokenizer"]]
    kw = dict(add_generation_prompt=case["add_generation_prompt"], **case["kwargs"])
    assert tok.apply_chat_template(case["messages"], tokenize=False, **kw) == case["text"]
    assert tok.apply_chat_template(case["messages"], **kw) == case["ids"]


def test_template_supplies_bos_once(toks):
    # Llama 3's post-processor prepends <|begin_of_text|>; the template writes it already.
    tok = toks["llama31"]
    bos = tok.tok.token_to_id("<|begin_of_text|>")
    assert tok.bos_id == bos
    ids = tok.apply_chat_template(HI, add_generation_prompt=True, date_string="26 Jul 2024")
    assert ids[0] == bos and ids.count(bos) == 1


def test_special_token_text_in_content_is_the_token(toks):
    # transformers' default (no sanitize_control_tokens): a user typing "<|im_end|>" gets the token.
    case = next(c for c in CASES if c["tokenizer"] == "smollm2" and c["name"] == "special_text")
    assert case["ids"].count(2) > case["text"].count("<|im_end|>\n")


def test_batch_of_conversations(toks):
    tok = toks["smollm2"]
    chats = [HI, [{"role": "user", "content": "Bye"}]]
    assert tok.apply_chat_template(chats, add_generation_prompt=True) == [
        tok.apply_chat_template(c, add_generation_prompt=True) for c in chats]


# ------------------------------------------------------------------ end of turn
def test_end_of_turn_ids(toks):
    assert toks["smollm2"].end_of_turn_ids == (2,)                  # <|im_end|>, also EOS
    llama = toks["llama31"]
    eot, eom = (llama.tok.token_to_id(t) for t in ("<|eot_id|>", "<|eom_id|>"))
    assert llama.end_of_turn_ids[:2] == (eot, eom)
    end = llama.tok.token_to_id("<|end_of_text|>")
    with_eos = HFTokenizer(llama.tok, eos_ids=(end, eot), chat_template=llama.chat_template,
                           special_tokens=llama.special_tokens)
    assert with_eos.end_of_turn_ids == (eot, eom, end)


def test_end_of_turn_ids_without_template(toks):
    # only the tokens the template writes count: <|im_end|> in the vocabulary is not enough
    bare = HFTokenizer(toks["smollm2"].tok, eos_ids=(0,))
    assert bare.end_of_turn_ids == (0,)
    assert tiny_tokenizer().end_of_turn_ids == (2,)


# ------------------------------------------------------------------ errors
def test_no_template_is_an_error_never_a_guess(toks):
    bare = HFTokenizer(toks["smollm2"].tok)
    for tok in (bare, tiny_tokenizer()):
        assert tok.chat_template is None
        with pytest.raises(ChatTemplateError, match="no chat template; pass one"):
            tok.apply_chat_template(HI)
    # an explicit template works on either, as transformers' chat_template= argument
    ct = toks["smollm2"].chat_template
    assert bare.apply_chat_template(HI, chat_template=ct) == toks["smollm2"].apply_chat_template(HI)
    assert tiny_tokenizer().apply_chat_template(
        HI, tokenize=False, chat_template="{{ messages[0].content }}") == "Hi"


def test_raise_exception_is_a_chat_template_error(toks):
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render("{% if messages[0].role == 'system' %}{{ raise_exception('System role not "
               "supported') }}{% endif %}", [{"role": "system", "content": "x"}])
    calls = [{"function": {"name": "f", "arguments": {}}}] * 2
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        toks["llama31"].apply_chat_template([{"role": "assistant", "tool_calls": calls}])


@pytest.mark.parametrize("messages,match", [
    ("Hi", "list of dicts"), ({"role": "user", "content": "Hi"}, "list of dicts"),
    ([], "empty"), (["Hi"], "message 0 must be a dict"), ([{"content": "x"}], "string 'role'"),
    ([{"role": 1, "content": "x"}], "string 'role'"), ([{"role": "user"}], "no 'content'"),
    (HI + [{"role": "user", "content": None}], r"message 1 \(user\) has no 'content'"),
    ([{"role": "user", "content": 5}], "'content' must be a string"),
])
def test_bad_messages_rejected(toks, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        toks["smollm2"].apply_chat_template(messages)


def test_bad_tools_and_documents_rejected():
    with pytest.raises(ChatTemplateError, match="JSON-schema dicts"):
        render("x", HI, tools=[print])
    with pytest.raises(ChatTemplateError, match="documents"):
        render("x", HI, documents=["text"])


def test_template_that_does_not_compile():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        compile_template("{% for m in messages %}")


@pytest.mark.parametrize("template", [
    "{{ messages.append(1) }}", "{% set ns = namespace(_x=1) %}", "{{ ''.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_sandbox(template):
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render(template, HI)
    assert render("{{ messages.__class__ }}", HI) == ""     # undefined, as jinja's sandbox gives


# ------------------------------------------------------------------ the environment
def test_environment_matches_transformers():
    assert compile_template("{{ 1 }}") is compile_template("{{ 1 }}")   # compiled once
    x = {"b": "<é & ü>", "a": [1, 2]}
    assert render("{{ x | tojson }}", HI, x=x) == json.dumps(x, ensure_ascii=False)
    assert render("{{ x | tojson(indent=2, sort_keys=True) }}", HI, x=x) == json.dumps(
        x, ensure_ascii=False, indent=2, sort_keys=True)
    assert render("{{ strftime_now('%Y') }}", HI) == str(datetime.datetime.now().year)
    # trim_blocks + lstrip_blocks, loop controls, {% generation %}, namespace
    t = ("  {% for m in messages %}\n{% if loop.first %}{% continue %}{% endif %}{{ m.content }}"
         "{% endfor %}\n{% generation %}G{% endgeneration %}{% set ns = namespace(n=1) %}"
         "{% set ns.n = 2 %}{{ ns.n }}")
    assert render(t, HI + [{"role": "user", "content": "B"}]) == "BG2"


def test_none_keys_dropped_and_kwargs_override_special_tokens(toks):
    msg = [{"role": "user", "content": "Hi", "name": None}]
    assert render("{{ 'name' in messages[0] }}", msg) == "False"
    assert toks["smollm2"].apply_chat_template(
        HI, tokenize=False, chat_template="{{ bos_token }}|{{ eos_token }}",
        bos_token="B") == "B|<|im_end|>"


# ------------------------------------------------------------------ files
def copy_tokenizer(src: Path, dst: Path, config: dict | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    if config is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_template_files(tmp_path):
    # tokenizer_config.json: a list of named templates -> "default"; {"content": ...} tokens
    d = copy_tokenizer(TOKENIZERS / "llama31", tmp_path / "a", {
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "D"}],
        "bos_token": {"content": "<|begin_of_text|>", "special": True}, "pad_token": None})
    assert read_chat_files(d) == ("D", {"bos_token": "<|begin_of_text|>"})
    (d / "chat_template.jinja").write_text("J")      # the .jinja file wins, as in transformers
    assert load_tokenizer(d).chat_template == "J"
    # a legacy special_tokens_map.json overrides a config without added_tokens_decoder
    legacy = {"bos_token": "<s>", "eos_token": "</s>"}
    (d / "special_tokens_map.json").write_text(json.dumps(legacy))
    assert read_chat_files(d)[1] == legacy
    assert read_chat_files(copy_tokenizer(TOKENIZERS / "llama31", tmp_path / "b")) == (None, {})


def test_bad_tokenizer_config(tmp_path):
    d = copy_tokenizer(TOKENIZERS / "llama31", tmp_path)
    (d / "tokenizer_config.json").write_text("{chat_template: 1")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(d)


def test_save_keeps_template_and_special_tokens(toks, tmp_path):
    for name, tok in toks.items():
        tok.save(tmp_path / name / "tokenizer.json")
        back = load_tokenizer(tmp_path / name)
        assert back.chat_template == tok.chat_template
        assert back.special_tokens == tok.special_tokens and back.bos_id == tok.bos_id
        assert back.apply_chat_template(HI) == tok.apply_chat_template(HI)
    assert sorted(p.name for p in (tmp_path / "smollm2").iterdir()) == [
        "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]


def test_orbax_and_hf_keep_the_template(toks, tmp_path):
    tok = toks["llama31"]
    target = tiny_target(tokenizer=tok, vocab_size=tok.vocab_size)
    save_orbax(target, tmp_path / "orbax")
    save_hf(target, tmp_path / "hf")
    for back in (load_orbax(tmp_path / "orbax").tokenizer, load_hf(tmp_path / "hf").tokenizer):
        assert back.chat_template == tok.chat_template
        assert back.special_tokens == tok.special_tokens
        assert back.apply_chat_template(HI, add_generation_prompt=True) == \
            tok.apply_chat_template(HI, add_generation_prompt=True)


# ------------------------------------------------------------------ transformers, live
@pytest.mark.parametrize("name", ["smollm2", "llama31"])
def test_hf_recomputes_goldens(toks, name, tmp_path):
    transformers = pytest.importorskip("transformers")
    # the fixture as shipped, and as jspec saves it: transformers reads both the same way
    toks[name].save(tmp_path / "tokenizer.json")
    for d in (TOKENIZERS / name, tmp_path):
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(d)
        for case in (c for c in CASES if c["tokenizer"] == name):
            kw = dict(add_generation_prompt=case["add_generation_prompt"], **case["kwargs"])
            assert hf.apply_chat_template(case["messages"], tokenize=False, **kw) == case["text"]
            assert list(hf.apply_chat_template(case["messages"], return_dict=False, **kw)) == \
                case["ids"], (d, case["name"])
