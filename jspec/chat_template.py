"""Chat templates rendered as transformers renders them, so the ids match token for token.

transformers (``utils/chat_template_utils.py``) compiles a model's Jinja template in an
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the loop-controls
extension, its own ``tojson`` (no ASCII or HTML escaping), ``raise_exception`` and
``strftime_now``, then renders it with ``messages``, ``add_generation_prompt``, ``tools``,
``documents``, the special-token strings and any extra keyword (``date_string``...). The
rendered text already holds every control token the model needs (BOS included), so it is
encoded without adding special tokens. Templates come from model files, i.e. from strangers:
the sandbox, and the plain-data copy of everything the template sees, are what keep a
template from reaching Python objects.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Sequence

import numpy as np


class ChatTemplateError(ValueError):
    """A chat cannot be rendered: no template, a template that does not compile or raises,
    or messages that are not a chat."""


# Tokens that end a turn in the common chat formats (ChatML, Llama 3, Phi-3, Gemma,
# Command-R). A template that writes one of them marks where a reply ends, which is often not
# the tokenizer's EOS (SmolLM2's EOS is <|im_end|>, Llama-3-Instruct's base EOS is
# <|end_of_text|> while its turns end with <|eot_id|>, or <|eom_id|> after a tool call).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                      "<|END_OF_TURN_TOKEN|>", "<|end_of_turn|>")

# The named special tokens transformers hands to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")

# Names a message's reasoning is passed under; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def no_template_error(what: str = "this model") -> ChatTemplateError:
    """The error for a chat on a model without a template: jspec never guesses a format."""
    return ChatTemplateError(
        f"{what} has no chat template; pass one with chat_template=<Jinja string>, or load a "
        "model that ships one (chat_template.jinja, tokenizer_config.json or GGUF metadata)")


def end_of_turn_tokens(template: str | None) -> tuple[str, ...]:
    """The :data:`END_OF_TURN_TOKENS` that ``template`` writes, in that order."""
    return tuple(t for t in END_OF_TURN_TOKENS if template and t in template)


def render(template: str, messages, add_generation_prompt: bool = False, tools=None,
           documents=None, **kwargs) -> str:
    """``template`` rendered for one conversation, as transformers' ``apply_chat_template(...,
    tokenize=False)``. ``kwargs`` become template variables (the special-token strings,
    ``date_string``...)."""
    if kwargs.get("continue_final_message"):
        # a template variable here, not transformers' prefill option: refuse rather than ignore it
        raise ChatTemplateError("continue_final_message is not supported; end the chat with a "
                                "user turn and add_generation_prompt=True")
    compiled = compile_template(template)
    chat = check_messages(messages)
    tools = _plain(_check_tools(tools))
    documents = _plain(_check_documents(documents))
    kwargs = _plain(kwargs)
    try:
        return compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    except ChatTemplateError:
        raise
    except _jinja().TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e


def check_messages(messages) -> list[dict]:
    """The plain-data copy of a chat that a template sees, or a :class:`ChatTemplateError`
    naming the first thing wrong. Keys whose value is None are dropped (an OpenAI client
    sends ``content=None`` beside ``tool_calls``; templates test for a missing key)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, not {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    chat = []
    for i, m in enumerate(_plain(list(messages))):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', "
                                    f"not {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} needs a string 'role' (got {m.get('role')!r})")
        content = m.get("content")
        if content is None and "tool_calls" not in m:
            raise ChatTemplateError(f"message {i} ({m['role']}) has no 'content'")
        if content is not None and not isinstance(content, (str, list, dict)):
            raise ChatTemplateError(f"message {i} ({m['role']}): 'content' must be a string or a "
                                    f"list of content parts, not {type(content).__name__}")
        chat.append(_alias_reasoning(m))
    return chat


def _alias_reasoning(m: dict) -> dict:
    # transformers fills reasoning_content from older names, and thinking for the templates
    # that read that name.
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def _check_tools(tools):
    if tools is None:
        return None
    if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
        raise ChatTemplateError("tools must be a list of JSON-schema dicts")
    for t in tools:
        if not isinstance(t, Mapping):
            raise ChatTemplateError(f"tools must be JSON-schema dicts, not {type(t).__name__} "
                                    "(jspec does not derive schemas from Python functions)")
    return list(tools)


def _check_documents(documents):
    if documents is None:
        return None
    if isinstance(documents, (str, Mapping)) or not isinstance(documents, Sequence) or not all(
            isinstance(d, Mapping) for d in documents):
        raise ChatTemplateError("documents must be a list of dicts with 'title' and 'text' keys")
    return list(documents)


def _plain(value: Any) -> Any:
    """Everything a template sees rebuilt from plain JSON types (transformers'
    ``_plain_template_data``): rich objects have methods the sandbox does not know are
    dangerous, so anything else becomes an inert ``<TypeName>`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):            # subclasses (enums...) back to the base type
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):          # np.bool_(False) must stay falsy, not "<bool_>"
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):   # pydantic models (OpenAI SDK messages)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=32)
def compile_template(template: str):
    """The compiled template, once per template string (a chat compiles on every turn)."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template is a Jinja string, not {type(template).__name__}")
    try:
        return _environment().from_string(template)
    except _jinja().TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"chat template does not compile (line {e.lineno}): {e.message}") from e


def _jinja():
    # jinja2 is imported on first use: importing jspec (and its tokenizers) does not need it.
    try:
        import jinja2
    except ImportError as e:
        raise ImportError("chat templates need jinja2>=3.1.6: pip install 'jinja2>=3.1.6'") from e
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        # as transformers: older versions have known sandbox escapes, and templates are untrusted
        raise ImportError(f"chat templates need jinja2>=3.1.6 (found {jinja2.__version__})")
    return jinja2


def _raise_exception(message):
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters (<, >, &, '); transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=1)
def _environment():
    """The one sandboxed environment every template compiles in, set up as transformers does."""
    jinja2 = _jinja()
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        # transformers' {% generation %} tag marks assistant text for its training masks;
        # here it only has to render its body, so templates that use it compile.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("render_body"), [], [], body
                                          ).set_lineno(lineno)

        def render_body(self, caller):
            return caller()

    class TemplateDict:
        # dict() for templates, without the dict type itself to climb out through
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # namespace() that refuses underscore names, so templates cannot store CPython internals
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore names on a namespace ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env
