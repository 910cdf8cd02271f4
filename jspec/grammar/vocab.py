"""The bytes each token id stands for, which is what a grammar matches.

A grammar constrains the generated *text*, so every token is seen as the bytes it appends
to it: GPT-2 byte-level BPE (SmolLM2, Llama-3) spells bytes as printable characters
(``Ġ`` for a space), SentencePiece BPE uses ``▁`` and ``<0xNN>`` byte-fallback pieces,
llama2.c stores raw bytes. Special and control tokens (``<|im_end|>``, BOS) stand for no
text: they get ``None`` and a grammar never allows them (the end of the output is the
stop ids', allowed in accepting states only).
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte map (the inverse of its ``bytes_to_unicode``)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _hf_token_bytes(tok) -> list[bytes | None]:
    """``tok``: a ``tokenizers.Tokenizer``."""
    import json
    model = json.loads(tok.to_str())
    decoder = json.dumps(model.get("decoder"))
    byte_level = '"ByteLevel"' in decoder
    special = {a["id"] for a in model.get("added_tokens", []) if a.get("special")}
    table = byte_level_decoder()
    out: list[bytes | None] = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        s = tok.id_to_token(i)
        if s is None or i in special:
            out.append(None)
        elif byte_level:
            try:
                out.append(bytes(table[c] for c in s))
            except KeyError:           # an added, non-special token spelled as plain text
                out.append(s.encode())
        else:
            m = _BYTE_PIECE.fullmatch(s.encode())
            out.append(bytes([int(m.group(1), 16)]) if m else s.replace("▁", " ").encode())
    return out


def _llama2c_token_bytes(tok) -> list[bytes | None]:
    out: list[bytes | None] = []
    for i, p in enumerate(tok.pieces):
        if i == 0 or i == tok.bos_id or i in tok.eos_ids:      # unk, BOS, EOS
            out.append(None)
            continue
        m = _BYTE_PIECE.fullmatch(p)
        out.append(bytes([int(m.group(1), 16)]) if m else p)
    return out


def token_bytes(tokenizer) -> Sequence[bytes | None]:
    """Per token id, the bytes it appends to the text, or None for a token that is not text."""
    if hasattr(tokenizer, "pieces"):
        return _llama2c_token_bytes(tokenizer)
    if hasattr(tokenizer, "tok"):
        return _hf_token_bytes(tokenizer.tok)
    raise TypeError(f"no token bytes for a {type(tokenizer).__name__}: structured output needs "
                    "jspec's HF or llama2.c tokenizer")
