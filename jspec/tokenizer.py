"""Tokenizers: llama2.c's ``tok*.bin`` (encoded exactly as run.c does) and HF ``tokenizer.json``.

Both expose ``encode(text, bos=True) -> list[int]``, ``decode(ids) -> str``, ``bos_id``,
``eos_ids``, ``vocab_size``, plus ``filename``/``save(path)`` so a checkpoint writer can
store the tokenizer next to the weights without knowing which kind it is, and the chat side:
``chat_template``, ``apply_chat_template`` and ``end_of_turn_ids`` (:mod:`jspec.chat_template`).
An HF tokenizer's template and special-token strings live beside its ``tokenizer.json`` in
``chat_template.jinja`` and ``tokenizer_config.json``, as transformers keeps them.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Mapping, Sequence

from jspec import chat_template as ct
from jspec.atomic import atomic_path, write_text

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")
# transformers' file names for what an HF tokenizer keeps beside tokenizer.json
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed."""


class Llama2cTokenizer:
    """llama2.c ``tokenizer.bin`` format: int32 max_token_length, then per token
    float32 score, int32 length, raw bytes. Ids 0/1/2 are unk/BOS/EOS and
    3..258 are the byte-fallback pieces ``<0x00>``..``<0xFF>``."""

    bos_id = 1
    eos_ids = (2,)
    end_of_turn_ids = eos_ids
    chat_template = None   # llama2.c models are not chat models

    def __init__(self, pieces: Sequence[bytes], scores: Sequence[float],
                 max_token_length: int | None = None, filename: str = "tokenizer.bin"):
        if len(pieces) != len(scores):
            raise TokenizerError("pieces and scores differ in length")
        self.pieces = list(pieces)
        self.scores = [float(s) for s in scores]
        self.max_token_length = max_token_length or max((len(p) for p in pieces), default=0)
        self.filename = filename
        # run.c binary-searches a sorted copy; with duplicate pieces the first id wins here.
        self._ids: dict[bytes, int] = {}
        for i, p in enumerate(self.pieces):
            self._ids.setdefault(p, i)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Llama2cTokenizer":
        data = Path(path).read_bytes()
        if len(data) < 4:
            raise TokenizerError(f"{path}: too short for a llama2.c tokenizer")
        (max_len,) = struct.unpack_from("<i", data, 0)
        pieces, scores, off = [], [], 4
        while off < len(data):
            if off + 8 > len(data):
                raise TokenizerError(f"{path}: truncated at token {len(pieces)}")
            score, n = struct.unpack_from("<fi", data, off)
            off += 8
            if n < 0 or off + n > len(data):
                raise TokenizerError(f"{path}: token {len(pieces)} has bad length {n}")
            pieces.append(data[off:off + n])
            scores.append(score)
            off += n
        return cls(pieces, scores, max_len, filename=Path(path).name)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "wb") as f:
            f.write(struct.pack("<i", self.max_token_length))
            for p, s in zip(self.pieces, self.scores):
                f.write(struct.pack("<fi", s, len(p)))
                f.write(p)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """run.c ``encode``: dummy prefix, per-codepoint lookup with byte fallback, then
        greedy merges of the highest-scoring adjacent pair (first one on ties)."""
        ids = [self.bos_id] if bos else []
        raw = text.encode("utf-8")
        if raw:
            ids.append(self._ids[b" "])
        # run.c groups a lead byte with at most 3 following continuation bytes.
        i = 0
        while i < len(raw):
            j = i + 1
            while j < len(raw) and (raw[j] & 0xC0) == 0x80 and j - i < 4:
                j += 1
            chunk = raw[i:j]
            tid = self._ids.get(chunk)
            if tid is not None:
                ids.append(tid)
            else:
                ids.extend(b + 3 for b in chunk)
            i = j
        while True:  # run.c includes BOS in the pair scan; so do we, to stay exact.
            best_score, best_idx, best_id = -1e10, -1, -1
            for k in range(len(ids) - 1):
                tid = self._ids.get(self.pieces[ids[k]] + self.pieces[ids[k + 1]])
                if tid is not None and self.scores[tid] > best_score:
                    best_score, best_idx, best_id = self.scores[tid], k, tid
            if best_idx < 0:
                break
            ids[best_idx:best_idx + 2] = [best_id]
        if eos:
            ids.append(self.eos_ids[0])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        prev = None
        for t in ids:
            t = int(t)
            if t == self.bos_id or t in self.eos_ids:
                prev = t
                continue
            piece = self.pieces[t]
            if prev == self.bos_id and piece.startswith(b" "):
                piece = piece[1:]
            m = _BYTE_PIECE.fullmatch(piece)
            out += bytes([int(m.group(1), 16)]) if m else piece
            prev = t
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = False,
                            tokenize: bool = True, *, chat_template: str | None = None, **kwargs):
        """Only with an explicit ``chat_template``: a llama2.c tokenizer ships none."""
        if chat_template is None:
            raise ct.no_template_error("a llama2.c tokenizer")
        text = ct.render(chat_template, messages, add_generation_prompt, **kwargs)
        return self.encode(text, bos=False) if tokenize else text


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the same interface.

    BOS is added by us, not by the tokenizer's post-processor, so ``bos=False`` works for
    every tokenizer; ``bos_id`` is given, or detected from what the post-processor prepends.
    ``chat_template`` (a Jinja string) and ``special_tokens`` (``{"bos_token": "<|im_start|>",
    ...}``, the strings templates read) are what transformers keeps beside ``tokenizer.json``.
    """

    filename = "tokenizer.json"

    def __init__(self, tok, bos_id: int | None = None, eos_ids: Sequence[int] = (),
                 chat_template: str | None = None, special_tokens: Mapping[str, str] | None = None):
        self.tok = tok
        if bos_id is None:
            bos_id = self._detect_bos(tok)
        self.bos_id = bos_id
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.chat_template = chat_template
        self.special_tokens = {k: str(v) for k, v in (special_tokens or {}).items()
                               if v is not None}

    @staticmethod
    def _detect_bos(tok) -> int | None:
        with_special = tok.encode("a", add_special_tokens=True).ids
        plain = tok.encode("a", add_special_tokens=False).ids
        if len(with_special) > len(plain) and with_special[-len(plain):] == plain:
            return with_special[0]
        return None

    @classmethod
    def from_file(cls, path: str | os.PathLike, bos_id: int | None = None,
                  eos_ids: Sequence[int] = ()) -> "HFTokenizer":
        """``tokenizer.json``, with the chat template and special tokens found beside it."""
        import tokenizers
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"{path}: cannot load tokenizer ({e})") from e
        template, special = read_chat_files(Path(path).parent)
        return cls(tok, bos_id, eos_ids, chat_template=template, special_tokens=special)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def save(self, path: str | os.PathLike) -> None:
        """``tokenizer.json`` at ``path``; the template and special tokens beside it, as
        transformers' ``save_pretrained`` writes them, so a checkpoint keeps its chat format."""
        with atomic_path(path) as tmp:
            self.tok.save(str(tmp))
        cfg = dict(self.special_tokens)
        if self.bos_id is not None and self.bos_id != self._detect_bos(self.tok):
            cfg["add_bos_token"] = True     # BOS the post-processor does not add (load_hf reads it)
        if cfg or self.chat_template is not None:
            # transformers then loads tokenizer.json as it is, not rebuilt for the model type
            cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
            write_text(Path(path).parent / TOKENIZER_CONFIG_FILE,
                       json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        if self.chat_template is not None:
            write_text(Path(path).parent / CHAT_TEMPLATE_FILE, self.chat_template)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=False).ids)
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos and self.eos_ids:
            ids.append(self.eos_ids[0])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Where a chat reply stops: the end-of-turn tokens the template writes that the
        vocabulary has, then ``eos_ids`` and the ``eos_token`` string's id, without repeats."""
        turn = [self.tok.token_to_id(t) for t in ct.end_of_turn_tokens(self.chat_template)]
        eos = self.special_tokens.get("eos_token")
        ids = turn + list(self.eos_ids) + ([self.tok.token_to_id(eos)] if eos else [])
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def apply_chat_template(self, messages, add_generation_prompt: bool = False,
                            tokenize: bool = True, *, chat_template: str | None = None,
                            tools=None, documents=None, **kwargs):
        """transformers' ``apply_chat_template``: the rendered text (``tokenize=False``) or
        its ids, encoded without adding special tokens since the template writes them (BOS
        too). ``messages`` may be a batch of conversations. ``kwargs`` are template variables
        (``date_string=...``) and override the special-token strings."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ct.no_template_error()
        if messages and all(isinstance(m, (list, tuple)) for m in messages):
            return [self.apply_chat_template(m, add_generation_prompt, tokenize,
                                             chat_template=template, tools=tools,
                                             documents=documents, **kwargs) for m in messages]
        text = ct.render(template, messages, add_generation_prompt, tools, documents,
                         **{**self.special_tokens, **kwargs})
        return self.encode(text, bos=False) if tokenize else text


def read_chat_files(directory: str | os.PathLike) -> tuple[str | None, dict[str, str]]:
    """The chat template and special-token strings transformers loads from ``directory``.

    The template is ``chat_template.jinja`` when present (it wins, as in recent transformers),
    else ``tokenizer_config.json``'s ``chat_template``: a string, or a list of named
    templates of which the one named ``default`` is used. Special tokens are strings or
    ``{"content": ...}`` dicts; a legacy ``special_tokens_map.json`` overrides them when the
    config predates ``added_tokens_decoder``, as transformers reads it."""
    d = Path(directory)
    cfg = _read_json(d / TOKENIZER_CONFIG_FILE) if (d / TOKENIZER_CONFIG_FILE).is_file() else {}
    special = _special_tokens(cfg)
    if "added_tokens_decoder" not in cfg and (d / SPECIAL_TOKENS_MAP_FILE).is_file():
        special.update(_special_tokens(_read_json(d / SPECIAL_TOKENS_MAP_FILE)))
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if (d / CHAT_TEMPLATE_FILE).is_file():
        template = (d / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return (template if isinstance(template, str) else None), special


def _special_tokens(cfg: dict) -> dict[str, str]:
    out = {}
    for key in ct.SPECIAL_TOKEN_KEYS:
        value = cfg.get(key)
        if isinstance(value, dict):       # an AddedToken as transformers serializes it
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def find_tokenizer(directory: str | os.PathLike, exclude: Sequence[str | os.PathLike] = ()
                   ) -> Path | None:
    """The tokenizer file in ``directory``: ``tokenizer.json``, else a lone ``tok*.bin``."""
    d = Path(directory)
    if (d / "tokenizer.json").is_file():
        return d / "tokenizer.json"
    skip = {Path(p).resolve() for p in exclude}
    cands = sorted(p for p in d.glob("tok*.bin") if p.is_file() and p.resolve() not in skip)
    if len(cands) > 1:
        raise TokenizerError(
            f"{d}: several tokenizer files {[p.name for p in cands]}; pass one explicitly")
    return cands[0] if cands else None


def load_tokenizer(path: str | os.PathLike, bos_id: int | None = None,
                   eos_ids: Sequence[int] = ()):
    """Load ``tokenizer.json`` (HF) or a llama2.c ``.bin``; a directory is searched."""
    p = Path(path)
    if p.is_dir():
        found = find_tokenizer(p)
        if found is None:
            raise TokenizerError(f"{p}: no tokenizer.json or tok*.bin in this directory")
        p = found
    if not p.is_file():
        raise TokenizerError(f"{p}: tokenizer file not found")
    if p.suffix == ".json":
        return HFTokenizer.from_file(p, bos_id, eos_ids)
    if p.suffix == ".bin":
        return Llama2cTokenizer.from_file(p)
    raise TokenizerError(f"{p}: unrecognised tokenizer (want tokenizer.json or a llama2.c .bin)")
