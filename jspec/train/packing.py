"""Several records packed into one fixed-length training row, each kept to itself.

Packing (grain's first-fit packer, :class:`grain.experimental.FirstFitPackIterDataset`) fills
a row of ``seq_len`` tokens with whole records instead of padding one record per row. A
packed row carries ``segments [T]`` (1, 2, ... per record; 0 on the padding at its end) and
``positions [T]`` (each token's position inside its own record). Everything that reads the
row keeps records apart, so a packed row trains exactly as its records would on rows of
their own:

- the target's forward (online training) attends within a record only
  (:func:`segment_mask`) and rotates by the record's positions, so its features and labels
  are those of the record alone;
- a drafter's attention and its TTT unroll see keys of the query's own record only
  (:mod:`jspec.train.drafter`), and a label counts only where the position it is read at
  and the position it is trained at are in one record (:func:`jspec.train.targets.label_mask`).

``tests/train/test_packing.py`` checks that a packed batch gives the unpacked batch's loss
and gradients. DFlash's objective (anchors over a context cache) does not read segments
yet, so it refuses packed rows.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

PACKED_KEYS = ("segments", "positions")


def pack(ds, seq_len: int, bins: int, seed: int, keys: Sequence[str]):
    """An ``IterDataset`` of variable-length records (``keys``: 1-D arrays of one length,
    at most ``seq_len``) -> packed rows (:func:`_row`). ``bins`` rows are filled at once
    (first fit) and emitted in a shuffled order."""
    import grain.experimental as ge
    length = {k: seq_len for k in keys}
    packed = ge.FirstFitPackIterDataset(ds, length_struct=length, num_packing_bins=bins,
                                        seed=seed, shuffle_bins=True)
    return packed.map(_Row(keys[0], keys))


class _Row:
    """grain's packed element -> ``tokens, lens, segments, positions`` (and the other keys);
    a class so grain can pickle it."""

    def __init__(self, lead: str, keys: Sequence[str]):
        self.lead, self.keys = lead, tuple(keys)

    def __call__(self, x: dict) -> dict:
        seg = np.asarray(x[f"{self.lead}_segment_ids"], np.int32)
        row = {k: np.asarray(x[k]) for k in self.keys}
        row["lens"] = np.int32((seg > 0).sum())       # records fill a row from its start
        row["segments"], row["positions"] = seg, np.asarray(x[f"{self.lead}_positions"],
                                                            np.int32)
        return row


def pack_sequences(seqs: Sequence[np.ndarray], seq_len: int, bins: int = 64) -> dict:
    """Sequences held in memory (``--seqs``) packed once into rows of ``seq_len`` (each cut
    to ``seq_len`` first), in order: ``tokens, lens, segments, positions [N, T]``."""
    import grain        # here, not above: the losses import this module, and need no grain
    recs = [{"tokens": np.asarray(s[:seq_len], np.int32)} for s in seqs if len(s)]
    ds = grain.MapDataset.source(recs).to_iter_dataset()
    rows = list(pack(ds, seq_len, bins, 0, ("tokens",)))
    return {k: np.stack([r[k] for r in rows]) for k in ("tokens", "lens", *PACKED_KEYS)}


def is_packed(batch: dict) -> bool:
    return "segments" in batch


def segment_mask(segments):
    """``segments [B, T]`` -> ``[B, T, T]``: causal and within one record (a padding
    position, segment 0, sees the padding before it: never empty, so never NaN)."""
    T = segments.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    return causal[None] & (segments[:, :, None] == segments[:, None, :])


def same_segment(segments, at):
    """Whether position ``at [B, T]`` (clipped into the row) is in the record of each
    position ``[B, T]`` itself."""
    T = segments.shape[1]
    other = jnp.take_along_axis(segments, jnp.clip(at, 0, T - 1), 1)
    return (other == segments) & (at >= 0) & (at < T)
