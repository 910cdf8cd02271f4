"""``jspec.chat``: assistant replies to conversations, speculatively or not.

A conversation is a list of ``{"role", "content"}`` messages. Each is rendered through the
target's chat template (:mod:`jspec.messages`) with the assistant's header appended, the ids
go through :func:`jspec.generate` as one batch, and each row stops at the template's
end-of-turn token. The replies come back as text (without the stop token) beside the
:class:`~jspec.generate.GenerationResult` and its stats::

    from jspec.fetch import fetch
    target = jspec.load_target(fetch("smollm2"))      # or any model path with a template
    out = jspec.chat(target, [{"role": "user", "content": "Name three colours."}])
    print(out.text, out.result.stats[0])
"""

from __future__ import annotations

import dataclasses

from jspec import messages as msgs
from jspec.generate import GenerationResult, generate


@dataclasses.dataclass
class ChatResult:
    texts: list[str]                 # each conversation's reply, without its stop token
    result: GenerationResult         # tokens (stop id included when hit), stats, wall time
    prompt_ids: list[list[int]]      # each conversation as rendered

    @property
    def text(self) -> str:
        """The first (for one conversation: the only) reply."""
        return self.texts[0]

    def replies(self) -> list[dict]:
        """The replies as assistant messages, to append to their conversations."""
        return [{"role": "assistant", "content": t} for t in self.texts]


def conversations_of(conversations) -> list[list[dict]]:
    """One conversation (a list of message dicts) or several, as a list of conversations."""
    if isinstance(conversations, (list, tuple)) and conversations and \
            isinstance(conversations[0], dict):
        return [list(conversations)]
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise ValueError("chat() wants a conversation (a list of {'role', 'content'} dicts) "
                         "or a non-empty list of them")
    return [list(c) for c in conversations]


def chat(target, conversations, *, max_new_tokens=256, drafter=None, spec=None,
         temperature: float = 0.0, stop_ids=None, add_generation_prompt: bool = True,
         **generate_kwargs) -> ChatResult:
    """Reply to ``conversations`` (one conversation or a list of them).

    Every other argument is :func:`jspec.generate`'s: ``drafter`` and ``spec`` speculate
    (greedy replies are the target's own tokens either way), ``temperature``, ``top_k``,
    ``top_p``, ``seed`` sample. ``stop_ids``: default the template's end-of-turn ids and the
    model's EOS. ``add_generation_prompt``: append the assistant's header (False continues
    the last message as the template renders it). ``response_format``: structured output,
    one for every conversation or one each (OpenAI's ``json_object`` / ``json_schema``, and
    ``regex`` / ``choice``; see :func:`jspec.generate`). A target without a tokenizer or a chat
    template, and malformed messages, raise ``ValueError`` before anything compiles.
    """
    convs = conversations_of(conversations)
    ids = [msgs.render(target, c, add_generation_prompt=add_generation_prompt,
                       who=f"conversation {i}") for i, c in enumerate(convs)]
    stops = msgs.stop_ids(target) if stop_ids is None else stop_ids
    res = generate(target, ids, max_new_tokens=max_new_tokens, drafter=drafter, spec=spec,
                   temperature=temperature, stop_ids=stops, **generate_kwargs)
    per_row = bool(stops) and isinstance(stops[0], (list, tuple))
    texts = [msgs.reply_text(target, t, stops[r] if per_row else stops)
             for r, t in enumerate(res.tokens)]
    return ChatResult(texts, res, ids)
