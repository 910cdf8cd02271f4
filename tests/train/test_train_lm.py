"""Training the default target: tokenizer, loss goes down, exact resume, shipped checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import pytest

from jspec.train import data as D
from jspec.train.lm import STATE_FILE, TrainConfig, train
from jspec.train.optim import load_train_state

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "checkpoints" / "default" / "target"

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\ndef exists(path):\n    return os.path.exists(path)\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
]


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdlib")
    (root / "test").mkdir()
    (root / "test" / "test_skip.py").write_text("SKIPPED = 'never in the corpus'\n")
    (root / "idlelib").mkdir()
    (root / "idlelib" / "x.py").write_text("IDLE = 1\n")
    rng = np.random.default_rng(0)
    for i in range(24):
        pkg = root / f"pkg{i % 3}"
        pkg.mkdir(exist_ok=True)
        body = "".join(SNIPPETS[j] + "\n" for j in rng.integers(0, len(SNIPPETS), 12))
        (pkg / f"mod{i}.py").write_text(f'"""Module {i}."""\n\n' + body)
    return root


def tiny(out, root, **kw) -> TrainConfig:
    base = dict(out=str(out), steps=8, batch=4, seq_len=32, lr=1e-2, warmup=2, layers=1,
                hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=300,
                max_bytes=200_000, heldout_every=6, corpus_root=str(root), eval_every=0,
                ckpt_every=0, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_corpus_excludes_and_splits(corpus_root):
    c = D.load_corpus(corpus_root, max_bytes=10_000, heldout_every=6)
    names = [n for n, _ in c.train + c.heldout]
    assert names and all(not n.startswith(("test/", "idlelib/")) for n in names)
    assert c.train_bytes + c.heldout_bytes <= 10_000
    assert not set(n for n, _ in c.train) & set(n for n, _ in c.heldout)
    assert [n for n, _ in D.load_corpus(corpus_root, 10_000, 6).train] == [n for n, _ in c.train]


def test_tokenizer_round_trip(corpus_root):
    c = D.load_corpus(corpus_root)
    tok = D.train_tokenizer((t for _, t in c.train), vocab_size=300)
    assert tok.token_to_id("<s>") == D.BOS_ID and tok.token_to_id("</s>") == D.EOS_ID
    hf = D.hf_tokenizer(tok)
    text = "def fibonacci(n):\n    return n  # ünïcode ✓\n"
    ids = hf.encode(text)
    assert ids[0] == D.BOS_ID and hf.decode(ids) == text
    assert hf.bos_id == D.BOS_ID and hf.eos_ids == (D.EOS_ID,)
    stream = D.encode_files(tok, ["a = 1\n", "b = 2\n"])
    assert stream[0] == D.BOS_ID and list(stream).count(D.BOS_ID) == 2
    seqs = D.pack(np.arange(100), 16)
    assert seqs.shape == (6, 17) and seqs[1, 0] == 16


def test_loss_decreases_and_resume_is_exact(tmp_path, corpus_root):
    # uninterrupted: 8 steps
    a, _, _, sa = train(tiny(tmp_path / "a", corpus_root), log=lambda *_: None)
    assert sa["heldout_loss"] < math.log(300) - 0.5, sa
    # interrupted at 4 (the process "dies" after checkpointing), then resumed to 8
    _, _, _, s1 = train(tiny(tmp_path / "b", corpus_root, stop_at=4), log=lambda *_: None)
    assert s1["step"] == 4 and (tmp_path / "b" / STATE_FILE).is_file()
    b, _, _, _ = train(tiny(tmp_path / "b", corpus_root), log=lambda *_: None)
    assert int(b.step) == int(a.step) == 8 and int(b.data_pos) == 8
    la = [np.asarray(x) for x in jax.tree_util.tree_leaves(a)]
    lb = [np.asarray(x) for x in jax.tree_util.tree_leaves(b)]
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)
    # the checkpoint on disk holds the same state
    c, meta = load_train_state(tmp_path / "b" / STATE_FILE, b)
    assert meta["config"]["steps"] == 8
    for x, y in zip(la, jax.tree_util.tree_leaves(c)):
        np.testing.assert_array_equal(x, np.asarray(y))
    # resuming with different hyperparameters is refused
    with pytest.raises(ValueError, match="different settings"):
        train(tiny(tmp_path / "b", corpus_root, lr=5e-3), log=lambda *_: None)


@pytest.mark.slow
def test_train_on_regenerated_seqs(tmp_path, corpus_root):
    """``--seqs``: one sequence per row, padded; padding is never a target (the held-out loss
    equals the per-token mean of the sequences run alone, unpadded); resume is exact."""
    from jspec.train.lm import row_losses
    from jspec.train.regen import save_sequences

    tok = D.train_tokenizer([t for _, t in D.load_corpus(corpus_root).train], vocab_size=300)
    tok.save(str(tmp_path / "tokenizer.json"))
    stream = D.encode_files(tok, [t for _, t in D.load_corpus(corpus_root).train])
    rng = np.random.default_rng(0)
    seqs = [np.concatenate([[D.BOS_ID], stream[s:s + n - 1]]).astype(np.int32)
            for s, n in zip(rng.integers(0, len(stream) - 60, 40), rng.integers(5, 48, 40))]
    save_sequences(tmp_path / "seqs.npz", seqs)
    kw = dict(seqs=str(tmp_path / "seqs.npz"), tokenizer=str(tmp_path))   # dir with tokenizer.json
    quiet = lambda *_: None  # noqa: E731

    a, cfg, _, sa = train(tiny(tmp_path / "a", corpus_root, **kw), log=quiet)
    with np.load(tmp_path / "a" / "data.npz") as z:
        rows, held = z["train"], z["heldout"]
    held_seqs = seqs[5::6]                        # heldout_every=6: every 6th sequence
    assert rows.shape == (34, 33) and held.shape == (len(held_seqs), 33)
    for row, seq in ((rows[0], seqs[0]), (rows[5], seqs[6]), (held[0], seqs[5])):
        n = min(len(seq), 33)                     # longer sequences are cut at seq_len + 1
        np.testing.assert_array_equal(row[:n], seq[:n])
        assert (row[n:] == D.PAD_ID).all()
    assert any(len(q) > 33 for q in seqs) and any(len(q) < 33 for q in held_seqs)
    # the final held-out loss is the per-token mean over the unpadded sequences, run alone
    per_seq = [(float(row_losses(cfg, a.params, q[None, :33])[0]), min(len(q), 33) - 1)
               for q in held_seqs]
    want = sum(l * n for l, n in per_seq) / sum(n for _, n in per_seq)
    assert sa["heldout_loss"] == pytest.approx(want, rel=1e-5)
    assert sa["heldout_loss"] < math.log(300) - 0.5, sa

    _, _, _, s1 = train(tiny(tmp_path / "b", corpus_root, stop_at=4, **kw), log=quiet)
    assert s1["step"] == 4
    b, _, _, _ = train(tiny(tmp_path / "b", corpus_root, **kw), log=quiet)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the same run directory without --seqs is refused, not trained on the corpus
    with pytest.raises(ValueError, match="seqs data"):
        train(tiny(tmp_path / "b", corpus_root), log=quiet)


@pytest.mark.skipif(not SHIPPED.exists(), reason="checkpoints/default/target not shipped")
def test_shipped_default_target():
    import jspec

    t = jspec.load_target(SHIPPED)
    assert t.tokenizer is not None and t.tokenizer.bos_id == D.BOS_ID
    assert t.config.eos_token_ids == (D.EOS_ID,) and t.config.tie_word_embeddings
    a = jspec.generate(t, ["def fibonacci(n):"], max_new_tokens=24)
    b = jspec.generate(t, ["def fibonacci(n):"], max_new_tokens=24)
    assert a.tokens == b.tokens and len(a.tokens[0]) > 0
    assert isinstance(a.text[0], str) and a.text[0].strip()
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size < 15e6


@pytest.mark.skipif(not SHIPPED.exists(), reason="checkpoints/default/target not shipped")
def test_demo_finds_shipped_target():
    """``python -m jspec demo`` loads ``default_model()``: it must be the shipped target
    (``checkpoints/default`` is an alias of ``checkpoints/default/target``)."""
    import jspec
    from jspec.shipped import default_model

    path = Path(default_model())
    assert path.resolve() in (SHIPPED.resolve(), SHIPPED.parent.resolve())
    demo, shipped = jspec.load_target(path), jspec.load_target(SHIPPED)
    assert demo.config == shipped.config and demo.tokenizer is not None
    for x, y in zip(jax.tree_util.tree_leaves(demo.params), jax.tree_util.tree_leaves(shipped.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_write_alias(tmp_path, corpus_root):
    import jspec
    from jspec.train.lm import write_alias

    from jspec.checkpoint.orbax_io import save_orbax
    from jspec.llama import init_params
    from jspec.target import Target

    tok = D.train_tokenizer([t for _, t in D.load_corpus(corpus_root).train], vocab_size=300)
    cfg = tiny(tmp_path, corpus_root).model_config(tok.get_vocab_size())
    export = tmp_path / "m" / "target"
    save_orbax(Target(cfg, init_params(cfg, jax.random.PRNGKey(0)), D.hf_tokenizer(tok)), export)
    write_alias(export, tmp_path / "m")
    a, b = jspec.load_target(tmp_path / "m"), jspec.load_target(export)
    assert a.config == b.config and a.tokenizer.encode("x = 1") == b.tokenizer.encode("x = 1")
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
