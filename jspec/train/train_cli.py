"""``python -m jspec.train train``: its flags and what runs it (:mod:`jspec.train.trainer`).

Data: ``--features`` (offline), ``--seqs`` or ``--data`` (online); ``--mesh`` / ``--fsdp`` /
``--distributed`` for meshes and pods; Orbax checkpoints in ``OUT/checkpoints`` (``--resume``);
``OUT/drafter``, ``OUT/train.log``, ``OUT/metrics.jsonl``, ``OUT/training.png``, ``OUT/info.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from jspec.args import add_process_args


def _trainable_kinds() -> tuple[str, ...]:
    from jspec.drafters import registry
    return registry.names(lambda k: k.trainable)


def _mesh(a):
    """``--mesh DxM`` over every process's devices (after ``jax.distributed`` joined)."""
    if not a.mesh:
        return None
    from jspec import sharding
    from jspec.args import parse_mesh
    return sharding.make_mesh(*parse_mesh(a.mesh))


def _train_data(a, target):
    """``(data, source, aux layers, online)``: a feature cache (offline), sequences in memory
    or a streamed JSONL file (online)."""
    from jspec.train import features as F
    from jspec.train import regen
    from jspec.train.sources import token_data
    if sum(map(bool, (a.features, a.seqs, a.data))) != 1:
        raise SystemExit("give one of --features FEATDIR (offline), --seqs SEQS.npz or "
                         "--data FILE.jsonl (online)")
    from jspec.train.drafter import packs
    if a.pack and not packs(a.kind):
        raise SystemExit(f"a {a.kind} drafter trains on unpacked rows: drop --pack")
    if a.pack and a.features:
        raise SystemExit("--pack applies to online data (--seqs, --data), not --features")
    pack = packs(a.kind) if a.pack is None else a.pack
    if a.features:
        data = F.load_features(a.features)
        return data, None, tuple(data["meta"]["aux_layers"]), False
    aux = (tuple(int(x) for x in a.aux_layers.split(",")) if a.aux_layers
           else F.aux_layers_for(target.config.num_layers))
    if a.seqs:
        return (token_data(regen.load_sequences(a.seqs), length=a.seq_len or None,
                           pack=pack), None, aux, True)
    from jspec.train.pipeline import PipelineSource, sample_tokens
    if target.tokenizer is None:
        raise SystemExit(f"{a.target} has no tokenizer: --data needs one to read text")
    seq_len = a.seq_len or 512
    source = PipelineSource(a.data, target.tokenizer, seq_len, a.batch_size, a.seed,
                            pack=pack)
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


def _fresh_drafter(a, target, data, aux_layers):
    """The drafter to train, with the options that are fields of its kind's architecture:
    EAGLE-3 and DFlash read the aux layers (the cached ones offline); Medusa takes its head
    and block counts; DFlash its depth, block size and mask token."""
    import dataclasses
    import inspect

    import jax

    from jspec.drafters import registry
    from jspec.train import drafter as D
    from jspec.train import features as F
    kw = {}
    if a.draft_vocab:
        kw = dict(draft_vocab=a.draft_vocab,
                  freqs=F.token_frequencies(data["tokens"], data["lens"], target.config.vocab_size))
    options = dict(aux_layers=aux_layers, num_heads=a.medusa_heads,
                   num_layers=a.layers or a.medusa_layers, block_size=a.block_size,
                   mask_token_id=a.mask_token)
    entry = registry.kind(a.kind)
    build = inspect.signature(entry.build).parameters
    fields = {f.name for f in dataclasses.fields(entry.module)} | {
        n for n, p in build.items() if p.kind is p.POSITIONAL_OR_KEYWORD}
    kw.update({k: v for k, v in options.items() if k in fields})
    return D.build_drafter(a.kind, target.config, target.params, jax.random.key(a.seed), **kw)


def _initial_drafter(a, target):
    """``--init DIR``: fine-tune a saved drafter (its architecture, draft vocabulary and aux
    layers are the checkpoint's, so the flags that would build a fresh one must not say
    otherwise)."""
    from jspec.drafters import load_drafter
    # Not its acceptance calibration: it was fitted to the weights training will change.
    d = load_drafter(a.init, target.config, calibration=False)
    if d.module.kind != a.kind:
        raise SystemExit(f"--init {a.init} is a {d.module.kind} drafter, not --kind {a.kind}")
    aux = tuple(d.module.target_layers)
    if a.aux_layers and aux != tuple(int(x) for x in a.aux_layers.split(",")):
        raise SystemExit(f"--aux-layers {a.aux_layers} differs from --init's {aux}")
    if a.draft_vocab:
        raise SystemExit("--draft-vocab builds a fresh head; --init keeps the checkpoint's")
    return d


def _configs(a, online: bool):
    from jspec.train import drafter as D
    from jspec.train import trainer as T
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
    return tc, lc


def cmd_train(a):
    from jspec import distributed
    distributed.join(a)                  # before anything starts a backend
    import jax

    import jspec
    from jspec.drafters import save_drafter
    from jspec.train import trainer as T
    from jspec.train.plots import plot_training
    mesh = _mesh(a)           # each process reads only the target weights its devices hold
    target = jspec.load_target(a.target, mesh=mesh)
    data, source, aux_layers, online = _train_data(a, target)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    d = _initial_drafter(a, target) if a.init else _fresh_drafter(a, target, data, aux_layers)
    tc, lc = _configs(a, online)
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
    s.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="online: whole sequences packed into rows of --seq-len, kept apart by "
                   "their segments (default: on, except for DFlash, whose loss does not read "
                   "segments); --no-pack: one sequence per row")
    s.add_argument("--kind", required=True, choices=_trainable_kinds())
    s.add_argument("--init", default="", metavar="DRAFTER_DIR",
                   help="start from this saved drafter (fine-tune) instead of a fresh one")
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
    add_process_args(mh, "join a multi-host run, coordinator auto-detected (TPU pods, Slurm)")
