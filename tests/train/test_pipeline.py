"""The grain training pipeline: deterministic for a seed, resumable from a saved position,
split over processes without overlap, chat records labelled on the assistant's turns only,
bad records dropped."""

import json
from pathlib import Path

import numpy as np
import pytest

from jspec.tokenizer import load_tokenizer
from jspec.train.pipeline import (JsonlSource, PipelineSource, _Encode, encode_record,
                                  make_dataset)

TOKENIZER = Path(__file__).resolve().parents[2] / "checkpoints" / "default" / "target"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    recs = [{"text": f"story number {i} is about a cat"} for i in range(30)]
    recs += [{"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": f"hello {i}"}]} for i in range(6)]
    p = tmp_path_factory.mktemp("d") / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n{cut\n\n{\"other\": 1}\n")
    return p


def _rows(src: PipelineSource, n: int):
    return [src.batch(i)["tokens"] for i in range(n)]


def test_deterministic_and_resumable(jsonl, tok):
    a = _rows(PipelineSource(jsonl, tok, 16, 4, 0), 25)          # past two epochs
    assert all(np.array_equal(x, y) for x, y in zip(a, _rows(PipelineSource(jsonl, tok, 16, 4, 0), 25)))
    assert not all(np.array_equal(x, y) for x, y in zip(a, _rows(PipelineSource(jsonl, tok, 16, 4, 1), 25)))
    src = PipelineSource(jsonl, tok, 16, 4, 0)
    _rows(src, 11)
    state = src.it.get_state()
    fresh = PipelineSource(jsonl, tok, 16, 4, 0)
    fresh.it.set_state(state)
    for i in range(11, 25):
        np.testing.assert_array_equal(fresh.batch(i)["tokens"], a[i])


def test_processes_read_disjoint_shares(jsonl, tok):
    n = len(JsonlSource(jsonl))
    assert n == 38                                    # blank line skipped; bad lines kept as records
    seen = []
    for p in range(2):
        it = iter(make_dataset(jsonl, tok, 16, 4, 0, process_index=p, process_count=2,
                               pack=False))
        rows = np.concatenate([next(it)["tokens"] for _ in range(9)])       # one epoch: 18 rows
        seen.append({r.tobytes() for r in rows})
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 36        # the 2 bad records dropped


def test_packed_rows_hold_whole_records_of_the_process_share(jsonl, tok):
    """Packed (the default): each row's segments are whole records, cut to the row, of this
    process's share, at positions 0, 1, ... with their own loss masks."""
    src = JsonlSource(jsonl)
    for p in range(2):
        share = {}
        for i in range(p, len(src), 2):
            enc = _Encode(tok, 32, pad=False)(src[i])
            if enc is not None:
                share[enc["tokens"].tobytes()] = enc["loss_mask"]
        it = iter(make_dataset(jsonl, tok, 32, 4, 0, process_index=p, process_count=2))
        records = rows = 0
        for _ in range(6):
            b = next(it)
            rows += len(b["tokens"])
            for tokens, mask, seg, pos, n in zip(b["tokens"], b["loss_mask"], b["segments"],
                                                 b["positions"], b["lens"]):
                assert (seg[:n] > 0).all() and (seg[n:] == 0).all()
                for s in range(1, seg.max() + 1):
                    at = np.flatnonzero(seg == s)
                    assert (pos[at] == np.arange(len(at))).all()
                    key = tokens[at].tobytes()
                    assert key in share
                    np.testing.assert_array_equal(mask[at], share[key])
                    records += 1
        assert records > 1.5 * rows                     # most rows hold two records: packed


def test_chat_mask_covers_assistant_turns_only(tok):
    ids, mask = encode_record({"messages": [{"role": "user", "content": "Tell me a story."},
                                            {"role": "assistant", "content": "A dog ran."}]}, tok)
    assert tok.decode(ids[mask]).strip() == "A dog ran."
    assert not mask[:len(tok.encode("user: Tell me a story.", bos=True))].any()
    assert encode_record({"messages": []}, tok) is None and encode_record({"x": 1}, tok) is None
