"""Train the default target: a small Llama-3-architecture LM on the CPython stdlib source.

``python -m jspec.train.lm --out DIR --steps N [...]`` builds the corpus and tokenizer
(:mod:`jspec.train.data`) in ``DIR`` (or, with ``--seqs FILE --tokenizer TOK``, trains on a
target's regenerated sequences, one per row: a draft model that imitates that target),
trains with AdamW + warmup/cosine (:mod:`jspec.train.optim`),
reports held-out loss/perplexity, checkpoints to ``DIR/state.npz`` (a rerun of the same
command resumes exactly: same parameters as an uninterrupted run), and with ``--export PATH``
writes the final model as a jspec Orbax checkpoint (``jspec.load_target(PATH)``).

Training uses the inference forward itself (:class:`jspec.llama.Llama`): each batch gets a
fresh paged KV cache with one page of ``seq_len`` slots per row and the default causal block
mask, so the trained function is exactly the one that generation runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec import atomic
from jspec.config import LlamaConfig
from jspec.llama import init_params
from jspec.train import data as D
# forward_logits and row_losses are part of this module's API (the draft-model recipe).
from jspec.train.lm_steps import (compiled_steps, evaluate, forward_logits,  # noqa: F401
                                  param_count, row_losses)
from jspec.train.optim import TrainState, load_train_state, save_train_state

STATE_FILE = "state.npz"


@dataclasses.dataclass
class TrainConfig:
    out: str
    steps: int = 3000
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    # model
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    intermediate: int = 688
    # data
    vocab: int = 2048
    max_bytes: int = D.DEFAULT_MAX_BYTES
    heldout_every: int = 20
    corpus_root: str | None = None      # default: this interpreter's stdlib
    seqs: str | None = None             # train on these regenerated sequences (regen .npz) instead
    heldout_seqs: str | None = None     # with seqs: held-out ones (default: every heldout_every-th)
    tokenizer: str | None = None        # with seqs: their tokenizer.json (or a dir holding one)
    # bookkeeping
    eval_every: int = 250
    eval_batches: int = 8               # held-out batches per periodic eval (final eval: all)
    ckpt_every: int = 250
    stop_at: int | None = None          # stop (checkpoint, evaluate, export) after this step
    export: str | None = None
    alias: str | None = None            # also make this directory load the export (see write_alias)
    export_dtype: str = "bfloat16"
    progress: bool = True

    def model_config(self, vocab_size: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_layers=self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads,
            head_dim=self.head_dim, tie_word_embeddings=True, max_position_embeddings=2048,
            bos_token_id=D.BOS_ID, eos_token_ids=(D.EOS_ID,), dtype="float32")

    # fields that must not change when resuming (others, e.g. eval cadence, may)
    def fingerprint(self) -> dict:
        keep = ("steps", "batch", "seq_len", "lr", "warmup", "weight_decay", "clip", "seed",
                "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                "max_bytes", "heldout_every")
        fp = {k: getattr(self, k) for k in keep}
        if self.seqs:   # only then, so runs from before --seqs existed still resume
            fp["data"] = "seqs"
        return fp

    def prepare_data(self, log=print):
        """``(tokenizer, train rows, held-out rows, info)``: see :mod:`jspec.train.data`."""
        if self.seqs:
            if not self.tokenizer:
                raise ValueError("--seqs needs --tokenizer (the target's tokenizer.json)")
            return D.prepare_seqs(self.out, self.seq_len, self.seqs, self.tokenizer,
                                  self.heldout_seqs, self.heldout_every, log=log)
        return D.prepare(self.out, self.seq_len, self.vocab, self.max_bytes, self.heldout_every,
                         self.corpus_root, log=log)


# ----------------------------------------------------------------------------- model

def resume(tc: TrainConfig, ckpt: Path, state: TrainState, log) -> TrainState:
    """The state saved at ``ckpt`` by a run with the same settings (an error for other
    settings), or ``state`` as it is, with the run's settings written beside it."""
    if not ckpt.is_file():
        (ckpt.parent / "run_config.json").write_text(json.dumps(dataclasses.asdict(tc), indent=1))
        return state
    state, meta = load_train_state(ckpt, state)
    if meta.get("config") != tc.fingerprint():
        raise ValueError(f"{ckpt} was written by a run with different settings:\n"
                         f"  saved   {meta.get('config')}\n  current {tc.fingerprint()}\n"
                         "use another --out or delete the checkpoint")
    log(f"resumed from {ckpt} at step {int(state.step)}")
    return state


def final_eval(summary: dict, eval_step, state, held_seqs, batch: int, info: dict,
               epochs: float, log) -> None:
    """The held-out loss of the finished run (and bits per byte where the corpus recorded
    its bytes), added to ``summary`` and logged."""
    hl = evaluate(eval_step, state.params, held_seqs, batch)
    summary.update(heldout_loss=hl, heldout_ppl=math.exp(hl))
    bpb = ""
    if "heldout_bytes" in info:   # the corpus (regenerated sequences do not record bytes)
        summary["heldout_bits_per_byte"] = (hl * info["heldout_tokens"] / info["heldout_bytes"]
                                            / math.log(2))
        bpb = f", {summary['heldout_bits_per_byte']:.3f} bits/byte"
    tl = summary["train_loss_last20"]
    log(f"final: step {int(state.step)}, train loss (last 20 steps of this run) "
        f"{'n/a' if tl is None else f'{tl:.4f}'}, "
        f"held-out loss {hl:.4f} (ppl {math.exp(hl):.2f}{bpb}), "
        f"{summary['tokens_seen']:,} tokens seen ({epochs:.2f} epochs)")


def append_line(path: Path, **record) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def describe(cfg: LlamaConfig) -> str:
    return (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, heads "
            f"{cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}, mlp {cfg.intermediate_size}, "
            f"vocab {cfg.vocab_size}, tied embeddings")


def progress_bar(start: int, end: int):
    from tqdm import tqdm
    return tqdm(total=end, initial=start, desc="train", unit="step", mininterval=5,
                dynamic_ncols=True, file=sys.stderr)


def train(tc: TrainConfig, log=print):
    """Run (or resume) training. Returns ``(state, model_cfg, tokenizer, summary dict)``."""
    out = Path(tc.out)
    out.mkdir(parents=True, exist_ok=True)
    tok, train_seqs, held_seqs, info = tc.prepare_data(log=log)
    cfg = tc.model_config(tok.get_vocab_size())
    tx, train_step, eval_step = compiled_steps(cfg, tc.lr, tc.warmup, tc.steps,
                                               tc.weight_decay, tc.clip, bool(tc.seqs))
    key = jax.random.PRNGKey(tc.seed)
    init_key, run_key = jax.random.split(key)
    state = TrainState.create(init_params(cfg, init_key), tx, run_key)
    n_params = param_count(state.params)
    ckpt = out / STATE_FILE
    state = resume(tc, ckpt, state, log)
    log(f"model: {n_params:,} parameters ({describe(cfg)})")
    it = D.BatchIterator(train_seqs, tc.batch, tc.seed, pos=int(state.data_pos))
    # target tokens per step (fewer than batch x seq_len with --seqs' padding)
    tokens_per_step = tc.batch * float(np.mean(np.sum(train_seqs[:, 1:] != D.PAD_ID, axis=1)))
    meta = {"config": tc.fingerprint()}
    record = functools.partial(append_line, out / "history.jsonl")
    start = int(state.step)
    end = tc.steps if tc.stop_at is None else min(tc.steps, tc.stop_at)
    recent: list[float] = []
    t0 = time.time()
    bar = progress_bar(start, end) if tc.progress and end > start else None
    echo = bar.write if bar is not None else log
    for step in range(start, end):
        batch = jnp.asarray(next(it))
        state, loss, gnorm = train_step(state, batch)
        s = step + 1
        recent = (recent + [float(loss)])[-20:]
        if bar is not None:
            if s % 10 == 0 or s == end:
                rate = (s - start) * tokens_per_step / max(time.time() - t0, 1e-9)
                bar.set_postfix(loss=f"{np.mean(recent):.3f}", gnorm=f"{float(gnorm):.2f}",
                                tok_s=f"{rate:.0f}", refresh=False)
            bar.update(1)
        if tc.eval_every and s % tc.eval_every == 0 and s != tc.steps:
            hl = evaluate(eval_step, state.params, held_seqs, tc.batch, tc.eval_batches)
            echo(f"step {s}: train loss {np.mean(recent):.4f}, held-out loss {hl:.4f} "
                 f"(ppl {math.exp(hl):.2f}), {round(s * tokens_per_step):,} tokens, "
                 f"{time.time() - t0:.0f}s")
            record(step=s, train_loss=float(np.mean(recent)), heldout_loss=hl,
                   wall_s=time.time() - t0)
        if (tc.ckpt_every and s % tc.ckpt_every == 0) or s == end:
            save_train_state(state, ckpt, meta)
    if bar is not None:
        bar.close()
    wall = time.time() - t0
    summary = {"params": n_params, "step": int(state.step),
               "tokens_seen": round(int(state.step) * tokens_per_step),
               "wall_s_this_run": wall, "train_loss_last20": float(np.mean(recent)) if recent else None,
               "epochs": it.epoch, "train_tokens": int(info["train_tokens"])}
    if int(state.step) >= end:
        final_eval(summary, eval_step, state, held_seqs, tc.batch, info, it.epoch, log)
        record(step=int(state.step), train_loss=summary["train_loss_last20"],
               heldout_loss=summary["heldout_loss"], wall_s=wall, final=True)
    return state, cfg, tok, summary


def export(tc: TrainConfig, state: TrainState, cfg: LlamaConfig, tok, log=print) -> dict:
    """Save the model as a jspec Orbax checkpoint at ``tc.export`` (params in ``export_dtype``,
    computed in fp32 after loading) and check it: held-out loss and greedy agreement vs fp32."""
    import jspec
    from jspec.checkpoint.orbax_io import save_orbax
    from jspec.target import Target

    dt = jnp.dtype(tc.export_dtype)
    params = jax.tree_util.tree_map(lambda p: np.asarray(p).astype(dt), state.params)
    target = Target(cfg, params, D.hf_tokenizer(tok))
    save_orbax(target, tc.export, overwrite=True)
    size = sum(f.stat().st_size for f in Path(tc.export).rglob("*") if f.is_file())
    loaded = jspec.load_target(tc.export)
    ref = Target(cfg, state.params, D.hf_tokenizer(tok))
    held = tc.prepare_data(log=lambda *_: None)[2]
    eval_step = compiled_steps(cfg, tc.lr, tc.warmup, tc.steps, tc.weight_decay, tc.clip,
                               bool(tc.seqs))[2]
    hl32 = evaluate(eval_step, state.params, held, tc.batch)
    hlx = evaluate(eval_step, loaded.params, held, tc.batch)
    prompt = "def fibonacci(n):"
    a = jspec.generate(ref, [prompt], max_new_tokens=64)
    b = jspec.generate(loaded, [prompt], max_new_tokens=64)
    agree = next((i for i, (x, y) in enumerate(zip(a.tokens[0], b.tokens[0])) if x != y),
                 min(len(a.tokens[0]), len(b.tokens[0])))
    res = {"path": str(tc.export), "bytes": size, "dtype": tc.export_dtype,
           "heldout_loss_fp32": hl32, "heldout_loss_exported": hlx,
           "greedy_agree_tokens": agree, "greedy_len": len(a.tokens[0]),
           "sample_fp32": prompt + a.text[0], "sample_exported": prompt + b.text[0]}
    log(f"exported {tc.export} ({size / 1e6:.2f} MB, params {tc.export_dtype}): held-out loss "
        f"{hlx:.4f} vs fp32 {hl32:.4f}; greedy agrees for {agree}/{len(a.tokens[0])} tokens")
    log("sample (exported, greedy):\n" + res["sample_exported"])
    (Path(tc.out) / "export.json").write_text(json.dumps(res, indent=1))
    return res


def write_alias(export_path: str | Path, alias_dir: str | Path) -> Path:
    """Make ``alias_dir`` itself loadable as the checkpoint at ``export_path``.

    Writes ``alias_dir/jspec_config.json``: the export's metadata with its ``params`` and
    ``tokenizer`` entries made relative to ``alias_dir`` (the Orbax reader joins them to
    the directory it was given), so no weights are duplicated. The shipped
    ``checkpoints/default`` uses this to point at ``checkpoints/default/target``.
    """
    import os

    from jspec.checkpoint.orbax_io import CONFIG_FILE, read_meta

    src, dst = Path(export_path).absolute(), Path(alias_dir).absolute()
    meta = read_meta(src)
    rel = Path(os.path.relpath(src, dst))
    info = meta["jspec"]
    info["params"] = (rel / info.get("params", "params")).as_posix()
    if info.get("tokenizer"):
        info["tokenizer"] = (rel / info["tokenizer"]).as_posix()
    info["alias_of"] = rel.as_posix()
    return atomic.write_text(dst / CONFIG_FILE, json.dumps(meta, indent=1))


def parse_args(argv=None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="python -m jspec.train.lm", description=__doc__.split("\n")[0])
    defaults = TrainConfig(out="")
    for f in dataclasses.fields(TrainConfig):
        name = "--" + f.name.replace("_", "-")
        if f.name == "out":
            p.add_argument(name, required=True, help="run directory (data, tokenizer, state.npz)")
        elif f.name == "progress":
            p.add_argument("--no-progress", dest="progress", action="store_false")
        else:
            d = getattr(defaults, f.name)
            typ = {"int": int, "float": float, "str": str}.get(type(d).__name__, str)
            if f.name in ("stop_at", "alias", "export", "corpus_root", "seqs", "heldout_seqs",
                          "tokenizer"):
                typ = str
            if f.name == "stop_at":
                typ = int
            p.add_argument(name, type=typ, default=d, help=f"default: {d}")
    return TrainConfig(**vars(p.parse_args(argv)))


def main(argv=None) -> int:
    tc = parse_args(argv)
    state, cfg, tok, summary = train(tc)
    print(json.dumps(summary))
    end = tc.steps if tc.stop_at is None else min(tc.steps, tc.stop_at)
    if tc.export and int(state.step) >= end:
        export(tc, state, cfg, tok)
        if tc.alias:
            print(f"alias: {write_alias(tc.export, tc.alias)} -> {tc.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
