"""A tiny random target whose tokenizer speaks ChatML, for the chat entry points (``jspec.chat``,
``Request(messages=...)``, ``messages`` records, ``python -m jspec chat``).

The tokenizer is a character-level ``tokenizers.Tokenizer`` of 48 ids (the tiny target's
vocabulary, so every id the model can emit decodes) with ``<|im_start|>`` and ``<|im_end|>``
as special tokens, behind :class:`jspec.tokenizer.HFTokenizer` with a ChatML template."""

import tokenizers
from tokenizers import decoders, models

from helpers.tiny_targets import tiny_target
from jspec.tokenizer import HFTokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHARS = list("abcdefghijklmnopqrstuvwxyz \n.,!?'0123456789-:")
IM_START, IM_END = len(CHARS) + 1, len(CHARS) + 2


def char_tokenizer() -> tokenizers.Tokenizer:
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.decoder = decoders.Fuse()
    assert tok.get_vocab_size() == 48 and tok.token_to_id("<|im_end|>") == IM_END
    return tok


def chat_target(template: str | None = CHATML, **kw):
    """The tiny random target with the char tokenizer and ``template`` (None: no chat
    template), its EOS ``<|im_end|>`` (as SmolLM2's), with room for a few turns."""
    tok = HFTokenizer(char_tokenizer(), chat_template=template)
    return tiny_target(tokenizer=tok, **{"max_position_embeddings": 512,
                                         "eos_token_ids": (IM_END,), **kw})
