"""Training data for the default target: the CPython standard library's own source.

Corpus
    Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, excluding ``test/``,
    ``idlelib/`` and anything under ``site-packages``. Files are ordered by the SHA-1 of
    their path relative to the stdlib root (deterministic, and it mixes packages so the cap
    below does not keep only the alphabetically first modules), then taken in that order
    until ``max_bytes`` of UTF-8 text (default 8 MB; files that do not fit are skipped, so
    smaller ones later in the order may still be taken). Every ``heldout_every``-th taken
    file (default 20th) is held out for evaluation: the split is by file, never inside one.

Tokenizer
    Byte-level BPE trained with ``tokenizers`` on the training split only: ByteLevel
    pre-tokenizer and decoder, vocabulary ``vocab_size`` (default 2048) including the
    special tokens ``<s>`` (BOS, id 0) and ``</s>`` (EOS, id 1). A ``<s> $A`` post-processor
    lets :class:`jspec.tokenizer.HFTokenizer` detect BOS from the file alone.

Packing
    Each file becomes ``<s> tokens </s>``; files are concatenated in corpus order and cut
    into non-overlapping windows of ``seq_len + 1`` tokens (input = ``w[:-1]``, target =
    ``w[1:]``); the ragged tail is dropped.

Regenerated sequences (:func:`prepare_seqs`, ``python -m jspec.train.lm --seqs``)
    Instead of the corpus: a :mod:`jspec.train.regen` ``.npz`` (a target's own samples, each
    ``<s> prompt continuation``) with that target's ``tokenizer.json``. One sequence per row,
    never packed together: a row is the sequence's first ``seq_len + 1`` tokens right-padded
    with :data:`PAD_ID`, which is never a training target, so each row is exactly what a model
    sees when it reads that sequence alone from position 0.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from jspec import atomic

BOS, EOS = "<s>", "</s>"
BOS_ID, EOS_ID = 0, 1
PAD_ID = -1             # padding of --seqs rows (never a target; read as token 0 when an input)
EXCLUDE_DIRS = ("test", "idlelib", "site-packages")
DEFAULT_MAX_BYTES = 8_000_000


@dataclass
class Corpus:
    root: Path
    train: list[tuple[str, str]]    # (relative path, text)
    heldout: list[tuple[str, str]]

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode()) for _, t in self.train)

    @property
    def heldout_bytes(self) -> int:
        return sum(len(t.encode()) for _, t in self.heldout)


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Eligible ``*.py`` files under the stdlib, in the corpus order (SHA-1 of rel. path)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if rel.parts[0] in EXCLUDE_DIRS or "site-packages" in rel.parts or not p.is_file():
            continue
        out.append(rel)
    out.sort(key=lambda r: (hashlib.sha1(r.as_posix().encode()).hexdigest(), r.as_posix()))
    return [root / r for r in out]


def load_corpus(root: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                heldout_every: int = 20) -> Corpus:
    """Read the capped corpus and split it by file (see module docstring)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    taken, total = [], 0
    for p in stdlib_files(root):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        n = len(text.encode())
        if not text.strip() or total + n > max_bytes:
            continue
        taken.append((p.relative_to(root).as_posix(), text))
        total += n
    train = [f for i, f in enumerate(taken) if i % heldout_every != heldout_every - 1]
    heldout = [f for i, f in enumerate(taken) if i % heldout_every == heldout_every - 1]
    return Corpus(root, train, heldout)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, min_frequency: int = 2):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``<s>``=0 and ``</s>``=1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    return tok


def hf_tokenizer(tok):
    """Wrap a ``tokenizers.Tokenizer`` in jspec's interface (BOS/EOS ids set)."""
    from jspec.tokenizer import HFTokenizer
    return HFTokenizer(tok, bos_id=BOS_ID, eos_ids=(EOS_ID,))


def encode_files(tok, texts: Sequence[str]) -> np.ndarray:
    """``<s> ids </s>`` per file, concatenated, as ``uint16`` (vocab must be < 65536)."""
    assert tok.get_vocab_size() < 2 ** 16
    encs = tok.encode_batch(list(texts), add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray([BOS_ID, *e.ids, EOS_ID], np.uint16))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows ``[N, seq_len + 1]`` of the token stream (tail dropped)."""
    n = (len(stream) - 1) // seq_len
    if n <= 0:
        raise ValueError(f"corpus of {len(stream)} tokens is shorter than one sequence "
                         f"of {seq_len}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None]
    return stream[idx]


class BatchIterator:
    """Deterministic batches: epoch ``e`` visits the sequences in a permutation seeded by
    ``(seed, e)``. The whole position is ``pos`` (batches consumed), so resuming is just
    ``BatchIterator(seqs, batch, seed, pos=saved_pos)``."""

    def __init__(self, seqs: np.ndarray, batch_size: int, seed: int = 0, pos: int = 0):
        if batch_size > len(seqs):
            raise ValueError(f"batch {batch_size} is larger than the {len(seqs)} sequences")
        self.seqs, self.batch_size, self.seed, self.pos = seqs, batch_size, seed, int(pos)
        self.per_epoch = len(seqs) // batch_size
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.seqs))
            self._perm_epoch = epoch
        return self._perm

    @property
    def epoch(self) -> float:
        return self.pos / self.per_epoch

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        epoch, i = divmod(self.pos, self.per_epoch)
        rows = self._permutation(epoch)[i * self.batch_size:(i + 1) * self.batch_size]
        self.pos += 1
        return self.seqs[rows].astype(np.int32)


def prepare(out_dir: str | os.PathLike, seq_len: int, vocab_size: int = 2048,
            max_bytes: int = DEFAULT_MAX_BYTES, heldout_every: int = 20,
            root: str | os.PathLike | None = None, log=print):
    """Build (or reuse) ``tokenizer.json`` and ``data.npz`` in ``out_dir``.

    Returns ``(tokenizers.Tokenizer, train_seqs [N, T+1], heldout_seqs [M, T+1], info)``.
    A rerun reuses the files, so a resumed run trains on exactly the same tokens.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_path, data_path = out / "tokenizer.json", out / "data.npz"
    if tok_path.is_file() and data_path.is_file():
        tok, train, held, info = _reuse(tok_path, data_path, seq_len, "corpus", log)
    else:
        corpus = load_corpus(root, max_bytes, heldout_every)
        log(f"data: {len(corpus.train)} train files ({corpus.train_bytes / 1e6:.2f} MB), "
            f"{len(corpus.heldout)} held-out files ({corpus.heldout_bytes / 1e6:.2f} MB) "
            f"from {corpus.root}")
        tok = train_tokenizer((t for _, t in corpus.train), vocab_size)
        s_train = encode_files(tok, [t for _, t in corpus.train])
        s_held = encode_files(tok, [t for _, t in corpus.heldout])
        train, held = pack(s_train, seq_len), pack(s_held, seq_len)
        info = {"seq_len": seq_len, "vocab_size": tok.get_vocab_size(),
                "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
                "train_bytes": corpus.train_bytes, "heldout_bytes": corpus.heldout_bytes,
                "train_tokens": len(s_train), "heldout_tokens": len(s_held),
                "max_bytes": max_bytes}
        _write(out, tok, train, held, info)
    log(f"data: {info['train_tokens']} train tokens ({info['train_bytes'] / info['train_tokens']:.2f} "
        f"bytes/token) -> {len(train)} sequences of {seq_len}; {len(held)} held-out sequences")
    return tok, train, held, info


def pad_rows(seqs: Sequence[np.ndarray], seq_len: int) -> np.ndarray:
    """One row per sequence: its first ``seq_len + 1`` tokens, right-padded with
    :data:`PAD_ID` -> ``[N, seq_len + 1]`` int32."""
    rows = np.full((len(seqs), seq_len + 1), PAD_ID, np.int32)
    for i, s in enumerate(seqs):
        s = np.asarray(s)[:seq_len + 1]
        rows[i, :len(s)] = s
    return rows


def prepare_seqs(out_dir: str | os.PathLike, seq_len: int, seqs_path: str | os.PathLike,
                 tokenizer_path: str | os.PathLike, heldout_path: str | os.PathLike | None = None,
                 heldout_every: int = 20, log=print):
    """Like :func:`prepare`, from regenerated sequences (see the module docstring).

    ``tokenizer_path``: a ``tokenizer.json`` or a directory holding one (e.g. the target's
    checkpoint). Held out: the sequences of ``heldout_path``, or else every
    ``heldout_every``-th sequence of ``seqs_path``. The rows and the tokenizer are copied into
    ``out_dir`` on the first call and reused afterwards, so a resumed run trains on exactly the
    same tokens.
    """
    from tokenizers import Tokenizer

    from jspec.train.regen import load_sequences

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_path, data_path = out / "tokenizer.json", out / "data.npz"
    if tok_path.is_file() and data_path.is_file():
        return _reuse(tok_path, data_path, seq_len, "seqs", log)
    src = Path(tokenizer_path)
    tok = Tokenizer.from_file(str(src / "tokenizer.json" if src.is_dir() else src))
    seqs = load_sequences(seqs_path)
    if heldout_path is not None:
        train_s, held_s = seqs, load_sequences(heldout_path)
    else:
        train_s = [s for i, s in enumerate(seqs) if i % heldout_every != heldout_every - 1]
        held_s = [s for i, s in enumerate(seqs) if i % heldout_every == heldout_every - 1]
    vocab = tok.get_vocab_size()
    for name, ss in (("train", train_s), ("held-out", held_s)):
        top = max((int(np.max(s)) for s in ss if len(s)), default=-1)
        if not ss or top >= vocab:
            raise ValueError(f"{name} sequences: {len(ss)} sequences, largest id {top} "
                             f"(the tokenizer has {vocab})")
    train, held = pad_rows(train_s, seq_len), pad_rows(held_s, seq_len)
    cut = sum(len(s) > seq_len + 1 for s in train_s + held_s)
    info = {"source": "seqs", "seq_len": seq_len, "vocab_size": vocab,
            "train_sequences": len(train_s), "heldout_sequences": len(held_s),
            "train_tokens": int(np.sum(train != PAD_ID)),
            "heldout_tokens": int(np.sum(held != PAD_ID)), "truncated": cut}
    _write(out, tok, train, held, info)
    log(f"data: {info['train_tokens']} train tokens in {len(train)} sequences, "
        f"{info['heldout_tokens']} held-out tokens in {len(held)}, padded to {seq_len + 1}"
        + (f" ({cut} longer sequences truncated)" if cut else ""))
    return tok, train, held, info


def _reuse(tok_path: Path, data_path: Path, seq_len: int, source: str, log):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    with np.load(data_path) as z:
        train, held = z["train"], z["heldout"]
        info = {k[5:]: z[k].item() for k in z.files if k.startswith("info_")}
    if info.get("source", "corpus") != source:
        raise ValueError(f"{data_path} holds {info.get('source', 'corpus')} data, not {source} "
                         "(use another --out)")
    if int(info["seq_len"]) != seq_len:
        raise ValueError(f"{data_path} was packed for seq_len={info['seq_len']}, not {seq_len}")
    log(f"data: reusing {tok_path} and {data_path}")
    return tok, train, held, info


def _write(out: Path, tok, train: np.ndarray, held: np.ndarray, info: dict) -> None:
    with atomic.atomic_path(out / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    with atomic.atomic_open(out / "data.npz", "wb") as f:
        np.savez(f, train=train, heldout=held, **{f"info_{k}": v for k, v in info.items()})
