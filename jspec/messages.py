"""Chat messages to prompt ids, the one way every entry point does it (:func:`jspec.chat`, the
engine's ``Request(messages=...)``, ``messages`` records of ``python -m jspec run``, ``python
-m jspec chat``).

The target's tokenizer renders them with its chat template (``apply_chat_template``, as
transformers does: the template supplies BOS and the text is encoded without adding special
tokens), and a reply stops at the template's end-of-turn token. A tokenizer without a
template is refused: a guessed format would make an instruct model answer badly with no
error. Nothing here imports the engine or ``generate``, so both can use it.
"""

from __future__ import annotations

from typing import Sequence


def check_messages(messages, who: str = "messages") -> list[dict]:
    """``messages`` as a list of dicts, each with a string ``role``; a clear ``ValueError``
    (naming ``who``) otherwise. The template's renderer checks the rest (content, tool
    calls)."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise ValueError(f"{who}: want a list of {{'role', 'content'}} dicts, got "
                         f"{type(messages).__name__}")
    if not messages:
        raise ValueError(f"{who}: no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{who}: message {i} is not a dict with a string 'role': {m!r}")
    return list(messages)


def chat_tokenizer(target, who: str = "messages"):
    """The target's tokenizer, checked to have a chat template (before anything compiles)."""
    tok = target.tokenizer
    if tok is None:
        raise ValueError(f"{who}: chat messages need a target with a tokenizer (and its chat "
                         f"template); this one has none")
    if not callable(getattr(tok, "apply_chat_template", None)) or \
            not getattr(tok, "chat_template", None):
        raise ValueError(f"{who}: the model's tokenizer has no chat template (none in its "
                         f"GGUF metadata, tokenizer_config.json or chat_template.jinja); give "
                         f"a prompt, or a tokenizer that has one")
    return tok


def render(target, messages, *, add_generation_prompt: bool = True,
           who: str = "messages") -> list[int]:
    """Prompt ids of ``messages`` through the target's chat template."""
    messages = check_messages(messages, who)
    tok = chat_tokenizer(target, who)
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:
        # A template's raise_exception (say, "roles must alternate") or a field it reads that
        # the messages lack: the caller's input to fix, named, not a crash.
        if type(e).__module__.split(".")[0] != "jinja2" and \
                not isinstance(e, (ValueError, TypeError, LookupError)):
            raise
        raise ValueError(f"{who}: {e}") from e
    return [int(t) for t in ids]


def stop_ids(target) -> list[int] | None:
    """Where a chat reply ends: the template's end-of-turn ids and the model's EOS ids (a
    model may end with either), or None (the config's EOS) when the tokenizer names none."""
    eot = tuple(getattr(target.tokenizer, "end_of_turn_ids", None) or ())
    if not eot:
        return None
    return list(dict.fromkeys([*map(int, eot), *target.config.eos_token_ids]))


def reply_text(target, tokens: Sequence[int], stops: Sequence[int] | None) -> str:
    """The decoded reply, without the stop id that ended it."""
    stops = set(target.config.eos_token_ids if stops is None else stops)
    toks = list(tokens)
    if toks and toks[-1] in stops:
        toks = toks[:-1]
    return target.tokenizer.decode(toks)
