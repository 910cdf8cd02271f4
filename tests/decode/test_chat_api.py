"""``jspec.chat``: conversations rendered through the chat template, generated, stopped at the
end-of-turn token, the replies returned as text; refused before compiling without a template."""

import sys

import pytest

import jspec
from helpers.chat_targets import IM_END, chat_target
from jspec import messages
from jspec.tokenizer import HFTokenizer

CHAT = sys.modules["jspec.chat"]      # the module (jspec.chat is the function)

CONV = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi there"}]
OTHER = [{"role": "user", "content": "count: 1, 2, 3"}]


@pytest.fixture(scope="module")
def target():
    return chat_target()


def test_chat_is_generate_on_the_rendered_ids(target):
    out = jspec.chat(target, [CONV, OTHER], max_new_tokens=12)
    ids = [target.tokenizer.apply_chat_template(c, add_generation_prompt=True)
           for c in (CONV, OTHER)]
    assert out.prompt_ids == ids
    assert target.tokenizer.decode(ids[0]).endswith("hi there\nassistant\n")
    plain = jspec.generate(target, ids, max_new_tokens=12, stop_ids=[IM_END])
    assert out.result.tokens == plain.tokens
    for toks, text in zip(out.result.tokens, out.texts):
        assert text == target.tokenizer.decode(toks[:-1] if toks[-1] == IM_END else toks)
    assert out.replies()[0] == {"role": "assistant", "content": out.text}


def test_one_conversation_and_speculative_replies_are_the_same(target):
    from jspec.args import load_drafter_arg
    one = jspec.chat(target, OTHER, max_new_tokens=12)
    assert len(one.texts) == 1
    spec = jspec.chat(target, OTHER, max_new_tokens=12,
                      drafter=load_drafter_arg("ngram", target))
    assert spec.result.tokens == one.result.tokens and spec.texts == one.texts
    assert "mean_accept_len" in spec.result.stats[0]


def test_stops_at_the_end_of_turn_token(target):
    """Stop ids default to the tokenizer's end-of-turn ids and the EOS; ``stop_ids``
    overrides them. The random model rarely says <|im_end|>, so a tokenizer whose end of
    turn is a token it does say stands in."""
    assert messages.stop_ids(target) == [IM_END]
    assert messages.stop_ids(chat_target(eos_token_ids=(2,))) == [IM_END, 2]
    toks = jspec.chat(target, OTHER, max_new_tokens=16, stop_ids=[]).result.tokens[0]
    stop = toks[5]
    first = next(i for i, t in enumerate(toks) if t in (stop, IM_END))     # or the EOS
    eot = chat_target()
    eot.tokenizer.__class__ = type("EOT", (HFTokenizer,), {"end_of_turn_ids": (stop,)})
    out = jspec.chat(eot, OTHER, max_new_tokens=16)
    assert out.result.tokens[0] == toks[:first + 1]
    assert out.result.stats[0]["stop_reason"] == "stop_token"
    assert out.text == eot.tokenizer.decode(toks[:first])
    assert jspec.chat(eot, OTHER, max_new_tokens=16, stop_ids=[]).result.tokens[0] == toks


@pytest.mark.parametrize("make, match", [
    (lambda: chat_target(None), "no chat template"),
    (lambda: jspec.Target(chat_target().config, chat_target().params, None), "tokenizer"),
])
def test_refused_before_compiling(monkeypatch, make, match):
    monkeypatch.setattr(CHAT, "generate", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=match):
        jspec.chat(make(), CONV)


@pytest.mark.parametrize("bad, match", [
    ([], "non-empty"), ("hi", "non-empty"), ([[{"content": "x"}]], "string 'role'"),
    ([[{"role": "user"}]], "content"),
])
def test_bad_conversations(monkeypatch, target, bad, match):
    monkeypatch.setattr(CHAT, "generate", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=match):
        jspec.chat(target, bad)
