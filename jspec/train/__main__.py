"""``python -m jspec.train {regen,features,train,eval,calibrate} ...``: train draft heads for a target.

regen      sample continuations of a prompt set from the target itself, through the serving
           engine's dataset runner (resumable: rerun the same command; pods: pass the
           runner's --distributed flags after --)
           ``python -m jspec.train regen --target DIR --out seqs.npz [--prompts stories-train|
           stories-heldout|FILE.json|FILE] [--num-samples 3000] [--max-new-tokens 192]
           [--temperature 0.8] [--seed 0] [-- --slots 8 --drafter D ...]``
features   run the target once per sequence, cache hidden / aux / top-k logits as npz shards
           ``python -m jspec.train features --target DIR --seqs seqs.npz --out FEATDIR
           [--topk 16] [--aux-layers 1,2,4]``
train      train one drafter on cached features (AdamW, warmup + cosine, clipping; resumes
           exactly from OUT/checkpoints with --resume), then save it in jspec's drafter format to OUT/drafter
           ``python -m jspec.train train --target DIR --features FEATDIR --kind
           {eagle3,eagle1,mtp,medusa,dflash} --out OUT [--steps 1500] [--batch-size 16] [--lr 3e-3]
           [--warmup 50] [--unroll N] [--draft-vocab 256] [--medusa-heads 4] [--max-seconds S]
           [--layers N] [--block-size 16] [--mask-token ID] [--anchors 16]`` (the last four: DFlash)
           ``--draft-vocab Vd`` (any kind): draft over the Vd most frequent tokens of the
           features' sequences, with a Vd-column head of the drafter's own and a d2t map
           (Medusa: a truncated vocabulary with a token_map); 0 = the full vocabulary
eval       acceptance table: end-to-end greedy ``jspec.generate`` on held-out prompts and
           teacher-forced on held-out sampled sequences (random-weight baselines with --baseline)
           ``python -m jspec.train eval --target DIR --drafter OUT/drafter [--drafter ...]
           --heldout-seqs heldout.npz [--prompts stories-heldout] [--baseline] [--max-seqs 40]``
calibrate  fit the drafter's acceptance calibration (for ``SpecConfig(selection="calibrated")``)
           on held-out sequences FIT_RANGE and write DRAFTER/jspec_calibration.json; compare
           EAGLE-2 and calibrated selection teacher forced on EVAL_RANGE (--ceiling: also
           the target as its own drafter)
           ``python -m jspec.train calibrate --target DIR --drafter D --heldout-seqs S
           [--fit-range 100:160] [--eval-range 0:20] [--stride 2] [--ranks 8] [--ceiling]
           [--no-pairs] [--prompts FILE] [--json F]``

Outputs (sequences, features, checkpoints) belong outside the repository.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _prompts(arg: str, split: str = "train"):
    """``stories-train`` / ``stories-heldout``; a ``.json`` file (a list of prompts, or an
    object whose ``split`` key holds one: multi-line prompts); else a text file, one per line."""
    from jspec.train import regen
    if arg == "stories-train":
        return regen.story_prompts("train")
    if arg == "stories-heldout":
        return regen.story_prompts("heldout")
    if arg.endswith(".json"):
        doc = json.loads(Path(arg).read_text())
        return doc[split] if isinstance(doc, dict) else doc
    return [line.rstrip("\n") for line in Path(arg).read_text().splitlines() if line.strip()]


def cmd_regen(a):
    """The target's own continuations, served by the dataset runner (``python -m jspec run``):
    continuous batching, resumable (rerun the same command), split over processes."""
    from jspec.train import regen
    t0 = time.time()
    seqs, pl = regen.regenerate_with_runner(
        a.target, _prompts(a.prompts, a.split), a.num_samples, a.out,
        max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed,
        runner_args=a.runner_args)
    if seqs is None:                      # stopped by a signal, or not process 0
        return
    print(f"wrote {len(seqs)} sequences ({sum(map(len, seqs))} tokens) to {a.out} "
          f"in {time.time() - t0:.1f}s")


def cmd_features(a):
    import jspec
    from jspec.train import features, regen
    target = jspec.load_target(a.target)
    seqs, pl = regen.load_sequences(a.seqs, with_prompt_lens=True)
    aux = tuple(int(x) for x in a.aux_layers.split(",")) if a.aux_layers else None
    out = features.compute_features(target, seqs, a.out, aux_layers=aux, topk=a.topk,
                                    prompt_lens=pl, batch_size=a.batch_size)
    print(f"wrote features of {len(seqs)} sequences to {out}")


def _mesh(a):
    """``--mesh DxM`` over every process's devices (after ``jax.distributed`` joined)."""
    if not a.mesh:
        return None
    from jspec import sharding
    data, model = (int(x) for x in a.mesh.lower().split("x"))
    return sharding.make_mesh(data, model)


def _train_data(a, target):
    """``(data, source, aux layers, online)``: a feature cache (offline), sequences in memory
    or a streamed JSONL file (online)."""
    from jspec.train import features as F
    from jspec.train import regen
    from jspec.train.sources import token_data
    if sum(map(bool, (a.features, a.seqs, a.data))) != 1:
        raise SystemExit("give one of --features FEATDIR (offline), --seqs SEQS.npz or "
                         "--data FILE.jsonl (online)")
    if a.features:
        data = F.load_features(a.features)
        return data, None, tuple(data["meta"]["aux_layers"]), False
    aux = (tuple(int(x) for x in a.aux_layers.split(",")) if a.aux_layers
           else F.aux_layers_for(target.config.num_layers))
    if a.seqs:
        return token_data(regen.load_sequences(a.seqs), length=a.seq_len or None), None, aux, True
    from jspec.train.pipeline import PipelineSource, sample_tokens
    if target.tokenizer is None:
        raise SystemExit(f"{a.target} has no tokenizer: --data needs one to read text")
    seq_len = a.seq_len or 512
    source = PipelineSource(a.data, target.tokenizer, seq_len, a.batch_size, a.seed)
    # The draft vocabulary's token counts: the file's first records.
    return sample_tokens(a.data, target.tokenizer, seq_len), source, aux, True


def _evaluator(a, target, drafter):
    """Teacher-forced acceptance on held-out sequences at ``--eval-spec`` (EAGLE-2 selection)."""
    from jspec.spec_config import parse_spec
    from jspec.train import acceptance as A
    from jspec.train import regen
    if not a.heldout_seqs:
        raise SystemExit("--eval-every needs --heldout-seqs")
    spec = parse_spec(a.eval_spec) if a.eval_spec else drafter.default_spec
    seqs = regen.load_sequences(a.heldout_seqs)[:a.eval_seqs]
    tf = A.TeacherForced(target, seqs, aux_layers=A.aux_layers_of(drafter.module),
                         max_depth=max(6, spec.num_steps), stride=a.eval_stride)
    return lambda d: tf.accept(d, spec)


def cmd_train(a):
    import dataclasses
    import inspect

    from jspec import distributed
    if a.distributed or a.coordinator is not None:     # before anything starts a backend
        distributed.initialize(a.coordinator, a.num_processes, a.process_id)
    import jax

    import jspec
    from jspec.drafters import registry, save_drafter
    from jspec.train import drafter as D
    from jspec.train import features as F
    from jspec.train import trainer as T
    from jspec.train.plots import plot_training
    mesh = _mesh(a)           # each process reads only the target weights its devices hold
    target = jspec.load_target(a.target, mesh=mesh)
    data, source, aux_layers, online = _train_data(a, target)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kw = {}
    if a.draft_vocab:
        kw = dict(draft_vocab=a.draft_vocab,
                  freqs=F.token_frequencies(data["tokens"], data["lens"], target.config.vocab_size))
    # The options that are fields of this kind's architecture: EAGLE-3 and DFlash read the
    # aux layers (the cached ones offline); Medusa takes its head and block counts; DFlash
    # its depth, block size and mask token.
    options = dict(aux_layers=aux_layers, num_heads=a.medusa_heads,
                   num_layers=a.layers or a.medusa_layers, block_size=a.block_size,
                   mask_token_id=a.mask_token)
    entry = registry.kind(a.kind)
    build = inspect.signature(entry.build).parameters
    fields = {f.name for f in dataclasses.fields(entry.module)} | {
        n for n, p in build.items() if p.kind is p.POSITIONAL_OR_KEYWORD}
    kw.update({k: v for k, v in options.items() if k in fields})
    d = D.build_drafter(a.kind, target.config, target.params, jax.random.key(a.seed), **kw)
    lc = D.default_loss(a.kind)
    if a.unroll:
        lc = D.LossConfig(**{**lc.__dict__, "unroll": a.unroll})
    if a.anchors:
        lc = D.LossConfig(**{**lc.__dict__, "anchors": a.anchors})
    tc = T.TrainConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup=a.warmup,
                       weight_decay=a.weight_decay, clip=a.clip, seed=a.seed,
                       ckpt_every=a.ckpt_every, keep=a.keep, log_every=a.log_every,
                       max_seconds=a.max_seconds, stop_after=a.stop_after, online=online,
                       topk=a.topk, fsdp=a.fsdp)
    main = jax.process_index() == 0
    log_f = open(out / "train.log", "a") if main else None

    def log(msg):
        if log_f is not None:
            print(msg, file=log_f, flush=True)

    evaluate = _evaluator(a, target, d) if a.eval_every else None
    t0 = time.time()
    trained, metrics = T.train(d, target, data, tc, lc, ckpt_dir=out / "checkpoints",
                               resume=a.resume, mesh=mesh, source=source,
                               metrics_path=out / "metrics.jsonl", evaluate=evaluate,
                               eval_every=a.eval_every, progress=main and not a.no_progress,
                               log=log)
    if not main:
        return
    save_drafter(trained, out / "drafter", overwrite=True)
    T.write_info(out / "info.json", {"kind": a.kind, "draft_vocab": a.draft_vocab,
                                     "online": online, "train": tc.__dict__, "loss": lc.__dict__,
                                     "seconds": time.time() - t0,
                                     "data": str(a.features or a.seqs or a.data),
                                     "final": {k: float(v) for k, v in metrics.items()}})
    plot_training(out / "metrics.jsonl", out / "training.png")
    print(f"saved {a.kind} drafter to {out / 'drafter'} ({time.time() - t0:.0f}s)")


def _trainable_kinds() -> tuple[str, ...]:
    from jspec.drafters import registry
    return registry.names(lambda k: k.trainable)


def cmd_eval(a):
    import jax

    import jspec
    from jspec.drafters import load_drafter
    from jspec.train import acceptance as A
    from jspec.train import regen
    target = jspec.load_target(a.target)
    drafters = {}
    for p in a.drafter:
        d = load_drafter(p, target.config)
        drafters[f"{d.kind}"] = d
    if a.baseline:
        for name, d in list(drafters.items()):
            drafters[f"{name} (random)"] = A.random_like(d, target, jax.random.key(1))
    seqs = regen.load_sequences(a.heldout_seqs)[:a.max_seqs] if a.heldout_seqs else []
    rows = A.acceptance_table(target, drafters, _prompts(a.prompts), seqs,
                              max_new_tokens=a.max_new_tokens, stride=a.stride,
                              modes=a.modes.split(","))
    print(A.format_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


def _range(text: str) -> slice:
    lo, hi = (int(x) if x else None for x in text.split(":"))
    return slice(lo, hi)


def cmd_calibrate(a):
    import jspec
    from jspec.drafters import load_drafter
    from jspec.train import calibrate as K
    from jspec.train import regen
    from jspec.drafters import calibration
    target = jspec.load_target(a.target)
    drafter = load_drafter(a.drafter, target.config, calibration=False)
    seqs = regen.load_sequences(a.heldout_seqs)
    fit_seqs, eval_seqs = seqs[_range(a.fit_range)], seqs[_range(a.eval_range)]
    if not len(fit_seqs) or not len(eval_seqs):
        raise SystemExit(f"{a.heldout_seqs} holds {len(seqs)} sequences: --fit-range "
                         f"{a.fit_range} or --eval-range {a.eval_range} selects none")
    model, summary = K.calibrate(target, drafter, fit_seqs, stride=a.stride, ranks=a.ranks,
                                 pairs=not a.no_pairs)
    summary["fit_range"], summary["heldout_seqs"] = a.fit_range, str(a.heldout_seqs)
    if not a.no_write:
        print(f"wrote {calibration.save(a.drafter, model, summary)}")
    self_model = None
    if a.ceiling:
        self_model, self_summary = K.calibrate(target, drafter, fit_seqs, stride=a.stride,
                                               self_draft=True)
    rows = K.compare(target, drafter, model, eval_seqs, stride=a.stride, self_model=self_model,
                     prompts=_prompts(a.prompts) if a.prompts else ())
    print(K.format_rows(rows))
    if a.json:
        doc = {"calibration": summary, "rows": rows}
        if a.ceiling:
            doc["self_calibration"] = self_summary
        Path(a.json).write_text(json.dumps(doc, indent=1))


def regen_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--target", required=True)
    s.add_argument("--out", required=True, help="sequences (.npz); OUT.requests.jsonl and "
                   "OUT.results.jsonl beside it are the runner's input and (resumable) output")
    s.add_argument("--prompts", default="stories-train")
    s.add_argument("--split", default="train", help="the key of a .json prompts file")
    s.add_argument("--num-samples", type=int, default=3000)
    s.add_argument("--max-new-tokens", type=int, default=192)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--seed", type=int, default=0, help="sample i uses seed + i")
    s.add_argument("runner_args", nargs=argparse.REMAINDER,
                   help="after --: flags for `python -m jspec run` (--slots, --drafter, "
                        "--distributed, --coordinator, ...)")


def features_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--target", required=True)
    s.add_argument("--seqs", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--topk", type=int, default=16)
    s.add_argument("--aux-layers", default="")
    s.add_argument("--batch-size", type=int, default=32)


def train_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--target", required=True)
    src = s.add_argument_group("data (one of)")
    src.add_argument("--features", default="", help="a feature cache: train offline")
    src.add_argument("--seqs", default="", help="sequences (regen's .npz): train online, the "
                     "target's forward inside each step")
    src.add_argument("--data", default="", help="JSONL text or chat records, streamed "
                     "(jspec.train.pipeline): train online")
    s.add_argument("--aux-layers", default="", help="online: the target layers EAGLE-3 / "
                   "DFlash read (default: as `features`)")
    s.add_argument("--topk", type=int, default=16, help="online: the target's top-k labels")
    s.add_argument("--seq-len", type=int, default=0, help="online: pad / cut sequences to this (--data: default 512)")
    s.add_argument("--kind", required=True, choices=_trainable_kinds())
    s.add_argument("--out", required=True)
    s.add_argument("--steps", type=int, default=1500)
    s.add_argument("--batch-size", type=int, default=16, help="global: over all data shards")
    s.add_argument("--lr", type=float, default=3e-3)
    s.add_argument("--warmup", type=int, default=50)
    s.add_argument("--weight-decay", type=float, default=0.01)
    s.add_argument("--clip", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--unroll", type=int, default=0)
    s.add_argument("--draft-vocab", type=int, default=0,
                   help="draft over the N most frequent tokens (0: the target's vocabulary)")
    s.add_argument("--medusa-heads", type=int, default=4)
    s.add_argument("--medusa-layers", type=int, default=1)
    s.add_argument("--layers", type=int, default=0,
                   help="DFlash: decoder layers (default 1); Medusa: as --medusa-layers")
    s.add_argument("--block-size", type=int, default=16, help="DFlash: the trained block")
    s.add_argument("--mask-token", type=int, default=0,
                   help="DFlash: the mask token id (a row of the target's embedding)")
    s.add_argument("--anchors", type=int, default=0, help="DFlash: blocks per sequence (16)")
    ck = s.add_argument_group("checkpoints (Orbax, OUT/checkpoints)")
    ck.add_argument("--ckpt-every", type=int, default=200)
    ck.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    ck.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ck.add_argument("--max-seconds", type=float, default=0.0)
    ck.add_argument("--stop-after", type=int, default=0, help="stop (and save) after this step")
    s.add_argument("--log-every", type=int, default=50)
    s.add_argument("--no-progress", action="store_true")
    ev = s.add_argument_group("held-out acceptance during training (metrics and the PNG)")
    ev.add_argument("--eval-every", type=int, default=0, help="steps between evaluations")
    ev.add_argument("--heldout-seqs", default="")
    ev.add_argument("--eval-spec", default="", help="S,K,N (default: the drafter's)")
    ev.add_argument("--eval-seqs", type=int, default=10)
    ev.add_argument("--eval-stride", type=int, default=4)
    mh = s.add_argument_group("mesh and multi-host (every process runs the same command)")
    mh.add_argument("--mesh", metavar="DATAxMODEL", help="rows over DATA, the target over MODEL")
    mh.add_argument("--fsdp", action="store_true",
                    help="shard the drafter's parameters and optimizer state over DATA")
    mh.add_argument("--distributed", action="store_true",
                    help="join a multi-host run, coordinator auto-detected (TPU pods, Slurm)")
    mh.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    mh.add_argument("--num-processes", type=int)
    mh.add_argument("--process-id", type=int)


def eval_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--target", required=True)
    s.add_argument("--drafter", action="append", default=[])
    s.add_argument("--prompts", default="stories-heldout")
    s.add_argument("--heldout-seqs", default="")
    s.add_argument("--max-seqs", type=int, default=40)
    s.add_argument("--stride", type=int, default=1)
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--modes", default="chain,default,wide")
    s.add_argument("--baseline", action="store_true")
    s.add_argument("--json", default="")


def calibrate_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--target", required=True)
    s.add_argument("--drafter", required=True)
    s.add_argument("--heldout-seqs", required=True)
    s.add_argument("--fit-range", default="100:160", help="held-out sequences to fit on (a:b)")
    s.add_argument("--eval-range", default="0:20", help="held-out sequences to compare on (a:b)")
    s.add_argument("--stride", type=int, default=2)
    s.add_argument("--prompts", default="",
                   help="also compare end to end on these prompts (stories-heldout or a file)")
    s.add_argument("--ceiling", action="store_true",
                   help="also the target as its own drafter (K target passes per tree step)")
    s.add_argument("--ranks", type=int, default=8,
                   help="sibling ranks calibrated separately (1: per depth only)")
    s.add_argument("--no-pairs", action="store_true",
                   help="no (token, rival) pair biases (see jspec.train.calibrate.fit)")
    s.add_argument("--no-write", action="store_true", help="do not write the model")
    s.add_argument("--json", default="")


COMMANDS = {  # name: (help, its arguments, what runs it)
    "regen": ("sample training sequences from the target", regen_args, cmd_regen),
    "features": ("cache target features", features_args, cmd_features),
    "train": ("train a drafter", train_args, cmd_train),
    "eval": ("acceptance table", eval_args, cmd_eval),
    "calibrate": ("fit acceptance calibration, compare selection policies", calibrate_args,
                  cmd_calibrate),
}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jspec.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (help_, add_args, run) in COMMANDS.items():
        s = sub.add_parser(name, help=help_)
        add_args(s)
        s.set_defaults(fn=run)
    a = p.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
