"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF's ``tokenizer.ggml.*`` metadata.

Two vocabularies occur in Llama files:

* ``gpt2``: byte-level BPE with the file's merges. How text is split before merging is not in
  the file, only named by ``tokenizer.ggml.pre``; :data:`PRE_TOKENIZERS` maps the names jspec
  knows to the split llama.cpp applies for them (which is also the original
  ``tokenizer.json``'s). An unknown name is refused rather than guessed: a wrong split encodes
  silently differently.
* ``llama``: SentencePiece BPE (scores, byte fallback). Files rarely carry merges; they are
  recovered from the scores as transformers' converter does (a merge ranks by its result's score).

Token types (llama.cpp's ``llama_token_type``): 3 = control (``<|im_start|>``, BOS/EOS) becomes
a special added token (never split, dropped by ``decode``), 4 = user-defined a plain added one.
"""

from __future__ import annotations

from jspec.checkpoint.common import CheckpointError
from jspec.checkpoint.gguf_meta import field
from jspec.tokenizer import HFTokenizer

CONTROL, USER_DEFINED = 3, 4

# Llama-3's split (its tokenizer.json, and llama.cpp's LLAMA3 pre-tokenizer).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2():
    from tokenizers import pre_tokenizers
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2():
    # llama.cpp splits these on "\p{N}" first, then GPT-2's regex; SmolLM's tokenizer.json
    # spells the same thing as Digits(individual_digits) + ByteLevel.
    from tokenizers import pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _llama3():
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> (pre-tokenizer builder, BPE ignore_merges). Llama-3 looks a word up
# whole before merging (its tokenizer.json's ignore_merges; llama.cpp does the same for it).
PRE_TOKENIZERS = {
    "default": (_gpt2, False), "gpt-2": (_gpt2, False),
    "smollm": (_digits_then_gpt2, False), "starcoder": (_digits_then_gpt2, False),
    "refact": (_digits_then_gpt2, False), "codeshell": (_digits_then_gpt2, False),
    "llama-bpe": (_llama3, True), "llama3": (_llama3, True), "llama-v3": (_llama3, True),
    "smaug-bpe": (_llama3, True), "falcon3": (_llama3, True),
}


def gguf_tokenizer(reader) -> HFTokenizer:
    """The file's tokenizer, with its BOS/EOS, special tokens and chat template."""
    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise CheckpointError(f"{reader.path}: no tokenizer in the GGUF metadata "
                              "(tokenizer.ggml.model / tokenizer.ggml.tokens); pass one with "
                              "tokenizer=... or convert with --tokenizer")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{reader.path}: tokenizer.ggml.token_type has {len(types)} "
                              f"entries for {len(tokens)} tokens")
    if kind == "gpt2":
        tok = _byte_level_bpe(reader, tokens, types)
    elif kind == "llama":
        tok = _sentencepiece_bpe(reader, tokens, types)
    else:
        raise CheckpointError(f"{reader.path}: tokenizer.ggml.model={kind!r} is not supported "
                              "(jspec builds 'gpt2' byte-level BPE and 'llama' SentencePiece)")
    _add_special(tok, tokens, types)

    def token(key):
        i = field(reader, f"tokenizer.ggml.{key}")
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]
    add_bos = field(reader, "tokenizer.ggml.add_bos_token", default=kind == "llama")
    bos_id = field(reader, "tokenizer.ggml.bos_token_id")
    eos = [field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.eot_token_id")]
    special = {name: token(key) for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    return HFTokenizer(tok, bos_id=int(bos_id) if add_bos and bos_id is not None else None,
                       eos_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
                       chat_template=field(reader, "tokenizer.chat_template"),
                       special_tokens={k: v for k, v in special.items() if v is not None})


def _byte_level_bpe(reader, tokens, types):
    from tokenizers import Tokenizer, decoders, models

    pre = field(reader, "tokenizer.ggml.pre", default="default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{reader.path}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer "
                              f"jspec knows ({', '.join(sorted(PRE_TOKENIZERS))}); its split "
                              "rules are not in the file, so it cannot be rebuilt exactly")
    build_pre, ignore_merges = PRE_TOKENIZERS[pre]
    merges = field(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise CheckpointError(f"{reader.path}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{reader.path}: tokenizer.ggml.merges entry {m!r} is not "
                                  "two tokens separated by one space")
        pairs.append((parts[0], parts[1]))
    tok = Tokenizer(_bpe(reader, models.BPE, _vocab(tokens), pairs, ignore_merges=ignore_merges,
                         fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = build_pre()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(reader, tokens, types):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = field(reader, "tokenizer.ggml.scores")
    merges = field(reader, "tokenizer.ggml.merges")
    vocab = _vocab(tokens)
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    elif scores is not None and len(scores) == len(tokens):
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores)))
    else:
        raise CheckpointError(f"{reader.path}: a llama tokenizer needs tokenizer.ggml.scores "
                              "(one per token) or tokenizer.ggml.merges")
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(_bpe(reader, models.BPE, vocab, pairs, fuse_unk=True, byte_fallback=True,
                         unk_token=None if unk is None else tokens[int(unk)]))
    norm = [normalizers.Replace(" ", "\u2581")]
    if field(reader, "tokenizer.ggml.add_space_prefix", default=True):
        norm.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    strip = [decoders.Strip(" ", 1, 0)] if len(norm) == 2 else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), *strip])
    return tok


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the vocabulary: every split of a token into two
    tokens is a merge, ranked by the merged token's score (highest first), then by the parts'
    lengths and ids, as transformers' ``SentencePieceExtractor`` orders them."""
    out = []
    for piece, score in scores.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                out.append((-score, vocab[left], vocab[right], left, right))
    out.sort()
    return [(left, right) for *_, left, right in out]


def _bpe(reader, BPE, vocab, merges, **kw):
    try:
        return BPE(vocab, merges, **kw)
    except Exception as e:   # tokenizers raises a bare Exception ("Token `x` out of vocabulary")
        raise CheckpointError(f"{reader.path}: tokenizer.ggml.merges does not fit "
                              f"tokenizer.ggml.tokens ({e})") from e


def _vocab(tokens) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)     # a duplicated piece keeps its first id, as llama.cpp does
    return vocab


def _add_special(tok, tokens, types) -> None:
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == CONTROL]
    plain = [AddedToken(t, special=False, normalized=False)
             for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
