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

from jspec.train import train_cli


def _prompts(arg: str, split: str = "train"):
    """``stories-train`` / ``stories-heldout``; a ``.json`` file (a list of prompts, or an
    object whose ``split`` key holds one: multi-line prompts; a prompt is text, token ids or a
    conversation, a list of ``{"role", "content"}`` messages rendered through the target's chat
    template); else a text file, one per line."""
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
    "train": ("train a drafter", train_cli.train_args, train_cli.cmd_train),
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
