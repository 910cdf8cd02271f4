"""A streaming, resumable training-data pipeline on grain.

JSONL records, one per line:

- ``{"text": "..."}``: every token is a label;
- ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}``:
  only the assistant turns' tokens are labels (``loss_mask``). Turns are rendered with the
  Llama-3 chat template when the tokenizer has its header tokens, else as
  ``"role: content\\n\\n"``, and tokenised turn by turn so the mask is exact.

A record is cut to ``seq_len`` tokens. By default records are *packed*: grain's first-fit
packer fills each row of ``seq_len`` with whole records, and the row carries each token's
record (``segments``) and position in it, so the target's forward and the drafter's losses
keep records apart (:mod:`jspec.train.packing`). With ``pack=False`` each record is a row of
its own (padded, with ``lens`` and a zero mask).

The file is read by random access (a line-offset index built once, then ``seek``), so
nothing but the index is held in memory. Records are split over processes (process ``p``
of ``n`` reads records ``p, p + n, ...``), shuffled with the seed, re-shuffled each epoch,
and batched per process (the global batch / process count). The iterator's position is a
small JSON state saved in the training checkpoint beside the parameters
(:class:`PipelineSource`), so a resumed run sees exactly the batches it would have seen.
Records without text or messages are dropped and counted (``skipped``).
"""

from __future__ import annotations

import json
import os

import grain
import jax
import numpy as np

LLAMA3_HEADER = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


class JsonlSource:
    """Random access to a JSONL file's lines (grain's ``RandomAccessDataSource``). Reads are
    positional (``os.pread``): grain reads from several threads at once."""

    def __init__(self, path):
        self.path = str(path)
        starts, ends, pos = [], [], 0
        with open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    starts.append(pos)
                    ends.append(pos + len(line))
                pos += len(line)
        self.starts, self.ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        self._fd = None

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return os.pread(self._fd, int(self.ends[i] - self.starts[i]), int(self.starts[i]))

    def __getstate__(self):                      # picklable for grain's worker processes
        return {**self.__dict__, "_fd": None}


def _has_llama3_headers(tokenizer) -> bool:
    tok = getattr(tokenizer, "tok", None)
    return tok is not None and all(tok.token_to_id(t) is not None for t in LLAMA3_HEADER)


def encode_record(record: dict, tokenizer, llama3: bool | None = None):
    """``(ids, loss_mask)`` of one record, or None when it holds neither text nor messages."""
    if isinstance(record.get("text"), str) and record["text"]:
        ids = tokenizer.encode(record["text"], bos=True)
        return np.asarray(ids, np.int32), np.ones(len(ids), bool)
    msgs = record.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return None
    llama3 = _has_llama3_headers(tokenizer) if llama3 is None else llama3
    ids, mask = [], []
    bos = getattr(tokenizer, "bos_id", None)
    if bos is not None:
        ids.append(bos)
        mask.append(False)
    for m in msgs:
        role, content = str(m.get("role", "")), str(m.get("content", ""))
        if llama3:
            head = f"<|start_header_id|>{role}<|end_header_id|>\n\n"
            head_ids = tokenizer.encode(head, bos=False)
            body = tokenizer.encode(content + "<|eot_id|>", bos=False)
        else:
            head_ids = tokenizer.encode(f"{role}: ", bos=False)
            body = tokenizer.encode(content + "\n\n", bos=False)
        ids += head_ids + body
        mask += [False] * len(head_ids) + [role == "assistant"] * len(body)
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


class _Encode:
    """bytes -> a fixed-length row, or with ``pad=False`` the record's ``tokens /
    loss_mask`` cut to ``seq_len`` (or None); a class so grain can pickle it."""

    def __init__(self, tokenizer, seq_len: int, pad: bool = True):
        self.tokenizer, self.seq_len, self.pad = tokenizer, seq_len, pad

    def __call__(self, line: bytes):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            return None
        out = encode_record(rec, self.tokenizer) if isinstance(rec, dict) else None
        if out is None or not out[1].any():
            return None
        ids, mask = out[0][:self.seq_len], out[1][:self.seq_len]
        if not self.pad:
            return {"tokens": ids, "loss_mask": mask}
        n = len(ids)
        row = {"tokens": np.zeros(self.seq_len, np.int32), "lens": np.int32(n),
               "loss_mask": np.zeros(self.seq_len, bool)}
        row["tokens"][:n], row["loss_mask"][:n] = ids, mask
        return row


def make_dataset(path, tokenizer, seq_len: int, batch_size: int, seed: int,
                 process_index: int | None = None, process_count: int | None = None,
                 pack: bool = True):
    """The grain ``IterDataset`` of this process's batches (``batch_size``: global); with
    ``pack``, rows packed with whole records (first fit over one batch of rows at a time)."""
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    if batch_size % pc:
        raise ValueError(f"a global batch of {batch_size} does not split over {pc} processes")
    src = JsonlSource(path)
    if len(src) < pc:
        raise ValueError(f"{path}: {len(src)} records for {pc} processes")
    ds = (grain.MapDataset.source(src)[pi::pc]
          .shuffle(seed=seed)
          .repeat(None)
          .map(_Encode(tokenizer, seq_len, pad=not pack))
          .filter(lambda r: r is not None))
    it = ds.to_iter_dataset()
    if pack:
        from jspec.train.packing import pack as pack_rows
        it = pack_rows(it, seq_len, batch_size // pc, seed, ("tokens", "loss_mask"))
    return it.batch(batch_size // pc, drop_remainder=True)


class _Position:
    """An iterator's state captured at one step, in the form grain's checkpoint handler
    writes (it reads ``get_state()`` when it writes, not when the save starts)."""

    def __init__(self, text: str):
        self.text = text

    def get_state(self) -> bytes:
        return self.text.encode()


class PipelineSource:
    """Batches from :func:`make_dataset`, consumed in step order; its position checkpoints."""

    def __init__(self, path, tokenizer, seq_len: int, batch_size: int, seed: int,
                 pack: bool = True):
        self.seed = seed
        self.it = iter(make_dataset(path, tokenizer, seq_len, batch_size, seed, pack=pack))

    def batch(self, step: int) -> dict:
        local = {k: np.asarray(v) for k, v in next(self.it).items()}
        local["rng"] = np.array([self.seed, step], np.uint32)
        return local

    def place(self, batch: dict, mesh):
        import jax.numpy as jnp
        if mesh is None:
            if jax.process_count() > 1:
                raise ValueError("a multi-process run needs a mesh")
            return {k: jnp.asarray(v) for k, v in batch.items()}
        from jspec.train.placement import batch_shardings, place
        sh = batch_shardings(batch, mesh)
        out = {k: jax.make_array_from_process_local_data(sh[k], v)
               for k, v in batch.items() if k != "rng"}
        out["rng"] = place(batch["rng"], sh["rng"])
        return out

    def save_args(self):
        # The position now: Orbax writes in the background, by when the iterator has moved on.
        import grain.checkpoint as gc
        return gc.CheckpointSave(_Position(json.dumps(self.it.get_state(), indent=4)))

    def restore_args(self):
        import grain.checkpoint as gc
        return gc.CheckpointRestore(self.it)


def sample_tokens(path, tokenizer, seq_len: int, records: int = 20000) -> dict:
    """The first ``records`` records as rows (``tokens, lens``): the token counts a draft
    vocabulary is chosen from."""
    src, enc = JsonlSource(path), _Encode(tokenizer, seq_len)
    rows = [r for r in (enc(src[i]) for i in range(min(records, len(src)))) if r is not None]
    if not rows:
        raise ValueError(f"{path}: no record with text or messages among the first {records}")
    return {k: np.stack([r[k] for r in rows]) for k in ("tokens", "lens")}
