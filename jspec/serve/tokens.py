"""Token ids as text for clients: one token's text (logprobs), the special tokens by name
(``/tokenizer_info``), and the endpoints' encode/decode (``/tokenize``, ``/detokenize``)."""

from __future__ import annotations

import functools

from jspec.serve.errors import APIError


class Tokens:
    """The target's tokenizer seen from the server (None: a target without one, which can
    only serve token-id prompts)."""

    def __init__(self, target):
        self.tok = target.tokenizer
        self.config = target.config

    def need(self, what: str):
        if self.tok is None:
            raise APIError(f"{what} needs a tokenizer; this model has none (send token ids)")
        return self.tok

    def encode(self, text: str, special: bool = True) -> list[int]:
        return [int(t) for t in self.need("text").encode(text, bos=special)]

    def decode(self, ids) -> str:
        if self.tok is None:
            return ""
        return self.tok.decode([int(t) for t in ids])

    def check_ids(self, ids, param: str = "tokens") -> list[int]:
        V = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise APIError(f"{param}: token id {bad[0]} outside the vocabulary [0, {V})",
                           param=param)
        return list(ids)

    def raw(self, i: int) -> str | None:
        """The vocabulary's own string for id ``i`` (``<s>``, ``Ġthe``), or None."""
        t = self.tok
        inner = getattr(t, "tok", None)
        if inner is not None and hasattr(inner, "id_to_token"):
            return inner.id_to_token(int(i))
        pieces = getattr(t, "pieces", None)
        if pieces is not None and 0 <= i < len(pieces):
            p = pieces[i]
            return p.decode("utf-8", "replace") if isinstance(p, bytes) else str(p)
        return None

    @functools.lru_cache(maxsize=65536)
    def text(self, i: int) -> str:
        """One token's text, as a logprobs entry names it: its decoded text, or for a token
        that decodes to nothing (a special token such as ``</s>``) its vocabulary string, so
        distinct tokens stay distinguishable."""
        if self.tok is None:
            return f"token_id:{i}"
        s = self.tok.decode([int(i)])
        if s:
            return s
        return self.raw(i) or f"token_id:{i}"

    def width(self, i: int) -> int:
        """How much of the decoded text token ``i`` makes (0 for a special token)."""
        return len(self.tok.decode([int(i)])) if self.tok is not None else 0

    def info(self) -> dict:
        """vLLM's ``/tokenizer_info`` fields that lm-eval's remote tokenizer reads: the
        special tokens as strings (it encodes them back to find their ids) and the chat
        template."""
        cfg = self.config
        bos = getattr(self.tok, "bos_id", None)
        if bos is None:
            bos = getattr(cfg, "bos_token_id", None)
        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
        name = lambda i: None if i is None or self.tok is None else self.raw(int(i))
        return {"tokenizer_class": type(self.tok).__name__ if self.tok is not None else None,
                "bos_token": name(bos), "eos_token": name(eos), "pad_token": None,
                "unk_token": None, "chat_template": getattr(self.tok, "chat_template", None),
                "vocab_size": cfg.vocab_size}
