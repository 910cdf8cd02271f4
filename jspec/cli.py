"""``python -m jspec ...``: command line for generation.

Sub-commands are registered in one table so later features (drafters, tree
knobs) extend ``generate`` without changing the command users already type.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from jspec.args import add_kernels_arg, add_prefill_chunk_arg, load_drafter_arg, parse_ids  # noqa: F401 (re-exported)
from jspec.args import (add_process_args, add_quantize_arg, add_response_format_args,
                        parse_mesh, response_format_of)
from jspec.fetch import resolve_model


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF directory, jspec Orbax directory, "
                   "llama2.c .bin, .gguf, or a fetchable name (python -m jspec models list)")
    p.add_argument("--tokenizer", help="tokenizer file (tok*.bin or tokenizer.json) overriding the model's")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompt-ids", action="append", type=parse_ids, help="comma-separated ids (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-ids", type=parse_ids, default=None, help="ids that end a row (default: EOS)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    add_quantize_arg(p)
    add_response_format_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print tokens as they are accepted (default: on a terminal, for one "
                        "process without a mesh); several prompts print each as it finishes")
    add_kernels_arg(p)
    add_prefill_chunk_arg(p)
    sp = p.add_argument_group("speculative decoding")
    sp.add_argument("--drafter", help="drafter checkpoint (HF EAGLE/EAGLE-3/Medusa/MTP layout or "
                    "jspec Orbax), random:KIND[:DRAFT_VOCAB] (eagle1|eagle3|mtp|medusa) for "
                    "random weights, or ngram[:MIN_N:MAX_N] for prompt lookup (no weights)")
    sp.add_argument("--spec-steps", type=int, help="S: tree depth / draft steps")
    sp.add_argument("--spec-topk", type=int, help="K: branching per step (1 = chain)")
    sp.add_argument("--spec-draft-tokens", type=int, help="N: tree nodes including the root")
    sp.add_argument("--selection", choices=["eagle2", "calibrated"],
                    help="how a dynamic tree ranks its candidates: the drafter's path probability "
                         "(eagle2) or the calibrated probability of acceptance (needs the "
                         "drafter's jspec_calibration.json; default: the drafter's)")
    sp.add_argument("--spec-auto", action="store_true",
                    help="the tree `python -m jspec tune` stored beside the drafter for this "
                         "device and batch")
    sp.add_argument("--profile", action="store_true", help="report draft/verify/other time shares")
    mh = p.add_argument_group("sharding and multi-host (every process runs the same command)")
    mh.add_argument("--mesh", metavar="DATAxMODEL", help="a device mesh over all processes' "
                    "devices: rows over DATA, tensor parallelism over MODEL")
    add_process_args(mh, "join a multi-host run, coordinator auto-detected (TPU pods, Slurm)")
    mh.add_argument("--output", metavar="FILE", help="write every row's tokens as JSON (in a "
                    "multi-host run, process 0 writes all processes' rows)")


def spec_from_args(args, drafter):
    from jspec.spec_config import SpecConfig

    knobs = (args.spec_steps, args.spec_topk, args.spec_draft_tokens)
    selection = getattr(args, "selection", None)
    if getattr(args, "spec_auto", False):
        if any(k is not None for k in knobs) or selection:
            raise ValueError("--spec-auto and --spec-steps/--spec-topk/--spec-draft-tokens/"
                             "--selection exclude each other")
        return "auto"
    if all(k is None for k in knobs) and not selection:
        return None
    base = drafter.default_spec or SpecConfig()
    pick = lambda v, d: d if v is None else v
    S = pick(args.spec_steps, base.num_steps)
    K = pick(args.spec_topk, base.topk)
    N = pick(args.spec_draft_tokens, S + 1 if K == 1 else base.num_draft_tokens)
    return SpecConfig(S, K, N, selection or base.selection)


def process_share(prompts, mesh):
    """This process's rows of a multi-host run: an equal, contiguous share."""
    import jax
    if mesh is None:
        raise ValueError("a multi-host run needs --mesh DATAxMODEL over all processes' devices")
    n, p = len(prompts), jax.process_count()
    if n % p:
        raise ValueError(f"{n} prompts do not split over {p} processes")
    i = jax.process_index()
    return prompts[i * n // p:(i + 1) * n // p]


def run_generate(args) -> int:
    from jspec import distributed

    multi = distributed.join(args)
    import jax

    import jspec
    mesh = None
    if args.mesh:      # each process reads only the weights its devices hold
        from jspec import sharding
        mesh = sharding.make_mesh(*parse_mesh(args.mesh))
    fmt = response_format_of(args)        # a bad file or JSON fails before the model loads
    target = jspec.load_target(args.model, dtype=args.dtype, tokenizer=args.tokenizer, mesh=mesh,
                               quantize=args.quantize)
    prompts = args.prompt if args.prompt is not None else args.prompt_ids
    if multi and jax.process_count() > 1:
        prompts = process_share(prompts, mesh)
    drafter = spec = None
    if args.drafter:
        drafter = load_drafter_arg(args.drafter, target)     # generate places it on the mesh
        spec = spec_from_args(args, drafter)
    stream = args.stream
    if stream is None:
        stream = sys.stdout.isatty() and not (args.json or multi or mesh or args.profile
                                              or args.output)
    if stream:
        if args.json or multi or mesh or args.profile or args.output:
            raise ValueError("--stream serves one process without a mesh, and prints text: "
                             "drop --json/--output/--profile/--mesh/--distributed")
        return stream_generate(args, target, prompts, drafter, spec, fmt)
    res = jspec.generate(target, prompts, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed, stop_ids=args.stop_ids, drafter=drafter, spec=spec,
                         profile=args.profile, kernels=args.kernels, mesh=mesh,
                         prefill_chunk=args.prefill_chunk, response_format=fmt)
    if args.output:
        if multi:
            distributed.write_combined(args.output, res)
        else:
            Path(args.output).write_text(json.dumps({"processes": 1, "tokens": res.tokens}))
    if args.json:
        print(json.dumps({"tokens": res.tokens, "text": res.text,
                          "stats": {"rows": res.stats, **res.summary(),
                                    "profile": res.profile}}))
        return 0
    print_result(res, prompts if args.prompt is not None else None, drafter)
    return 0


def print_result(res, prompts, drafter) -> None:
    """Each row's text (after its prompt, when ``prompts`` are text) or ids, then the speed,
    accept length and time shares on stderr."""
    for r, toks in enumerate(res.tokens):
        head = f"[{r}] " if len(res.tokens) > 1 else ""
        if res.text is not None:
            print(head + (prompts[r] if prompts is not None else "") + res.text[r])
        else:
            print(head + " ".join(map(str, toks)))
    s = res.summary()
    print(f"-- {s['new_tokens']} tokens in {s['wall_s']:.2f}s ({s['tokens_per_s']:.1f} tok/s, "
          "compilation included)", file=sys.stderr)
    if drafter is not None:
        acc = [st["mean_accept_len"] for st in res.stats]
        print(f"-- {drafter.kind}: mean accept length {sum(acc) / len(acc):.2f} tokens/verify",
              file=sys.stderr)
    if res.profile:
        p = res.profile
        print(f"-- time shares: draft {p['draft_share']:.0%}, verify {p['verify_share']:.0%}, "
              f"other {p['other_share']:.0%}", file=sys.stderr)


def stream_generate(args, target, prompts, drafter, spec, fmt=None) -> int:
    """``generate --stream``: the prompts through a :class:`jspec.engine.Engine`, printed as
    their tokens are accepted (one prompt), or each as it finishes (several). Row ``r``
    samples with the key it has in ``generate``'s batch, so the output is the same."""
    import time

    import jax

    from jspec.engine import Engine, Request, default_slots
    from jspec.sampling import SamplingConfig

    texts = args.prompt is not None
    ids = [target.tokenizer.encode(p) for p in prompts] if texts else prompts
    keys = jax.random.split(jax.random.key(args.seed), len(ids))
    eng = Engine(target, drafter, slots=min(len(ids), default_slots()), spec=spec,
                 sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
                 max_new_tokens=max(1, args.max_new_tokens), longest_prompt=max(map(len, ids)),
                 kernels=args.kernels, prefill_chunk=args.prefill_chunk)
    reqs = [Request(p, args.max_new_tokens, key=keys[r], stop_ids=args.stop_ids,
                    response_format=fmt) for r, p in enumerate(ids)]
    one = len(ids) == 1
    show = (lambda toks: target.tokenizer.decode(toks)) if target.tokenizer is not None else \
        (lambda toks: " ".join(map(str, toks)))
    if one and texts:
        print(prompts[0], end="", flush=True)
    t0, n, acc = time.perf_counter(), 0, []
    for d in eng.stream(reqs):
        if one:
            shown = d.text if d.text is not None else " ".join(map(str, d.tokens)) + " "
            print(shown, end="", flush=True)
        if d.done:
            c = d.completion
            n += len(c.tokens)
            acc.append(c.stats.get("mean_accept_len", 1.0))
            if not one:
                head = prompts[c.index] if texts else ""
                print(f"[{c.index}] {head}{show(c.tokens)}", flush=True)
    if one:
        print()
    wall = time.perf_counter() - t0
    print(f"-- {n} tokens in {wall:.2f}s ({n / wall:.1f} tok/s, compilation included)",
          file=sys.stderr)
    if drafter is not None:
        print(f"-- {drafter.kind}: mean accept length {sum(acc) / len(acc):.2f} tokens/verify",
              file=sys.stderr)
    return 0


def add_tune_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF directory, jspec Orbax directory or llama2.c .bin")
    src.add_argument("--random-config", help="a random-weight config (jspec.bench.configs), "
                     "e.g. 100m, with --forced-accept")
    p.add_argument("--drafter", required=True, help="drafter checkpoint directory (the pick is "
                   "stored in it), or random:KIND[:DRAFT_VOCAB] (nothing stored)")
    p.add_argument("--prompts", help="text prompts, one per line, or (--occupancy) a .json list "
                   "or {\"train\": [...]} (default: random token prompts)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts used for calibration")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per timed run")
    p.add_argument("--confirm", type=int, default=3, help="best predicted shapes timed")
    p.add_argument("--exhaustive", action="store_true",
                   help="time every grid shape (measures the model's error and the pick's gap)")
    p.add_argument("--grid", nargs="+", metavar="S,K,N", help="shapes to consider "
                   "(default: jspec.tune.default_grid())")
    p.add_argument("--forced-accept", type=float, default=0.0,
                   help="benchmark mode: force this mean accept length (output not the target's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="write the rows, costs and pick as JSON")
    p.add_argument("--plot", help="save predicted vs measured tokens/s (PNG, needs matplotlib)")
    p.add_argument("--no-store", dest="store", action="store_false",
                   help="do not store the pick beside the drafter")
    occ = p.add_argument_group("the serving engine's pick per occupancy (--occupancy)")
    occ.add_argument("--occupancy", action="store_true",
                     help="time each candidate in the engine at every bucket of live slots "
                          "(1, 2, 4, ..., --slots) and store the fastest per bucket, for "
                          "Engine(policy='auto') and `jspec run --policy auto`")
    occ.add_argument("--slots", type=int, default=8)
    occ.add_argument("--max-new-cap", type=int, default=None,
                     help="the engine's max_new_tokens, which sizes every row's KV (the "
                          "reference attention reads all of it): as in serving (default: "
                          "--new-tokens)")
    occ.add_argument("--candidates", nargs="+",
                     default=["plain", "default", "3,1,4", "4,1,5", "4,2,6"],
                     metavar="MODE", help="plain, default (the drafter's spec) or S,K,N[/cal]")


def run_tune(args) -> int:
    """Measure costs and acceptance, predict, confirm; see :mod:`jspec.tune`."""
    from jspec import tune, tune_store
    from jspec.bench.plain import load, make_prompts

    target, _ = load(args.model, args.random_config)
    drafter = load_drafter_arg(args.drafter, target)
    if args.occupancy:
        return run_tune_occupancy(args, target, drafter)
    n = max(args.num_prompts, args.batch)
    if args.prompts:
        prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()][:n]
    else:
        prompts = [list(map(int, p)) for p in make_prompts(target.config, n, 32)]
    grid = [tune.parse_shape(g) for g in args.grid] if args.grid else None
    res = tune.tune(target, drafter, prompts, batch=args.batch, new_tokens=args.new_tokens,
                    grid=grid, confirm=args.confirm, exhaustive=args.exhaustive,
                    repeats=args.repeats, forced_accept=args.forced_accept,
                    progress=lambda m: print(m, file=sys.stderr))
    print(json.dumps(res.costs.as_dict()))
    if res.profile:
        print("acceptance profile (a drafted node is the target's greedy token, given its parent "
              "is):")
        print(tune.format_profile(res.profile))
    print(res.table())
    print(f"plain {res.plain_tokens_per_s:.1f} tok/s; pick ({tune.shape(res.pick)}); "
          f"errors {json.dumps(res.errors())}")
    if res.confirm_pick:
        print(f"without --exhaustive (best {args.confirm} predicted + the default, timed): "
              f"{json.dumps(res.confirm_pick)}")
    if args.json:
        Path(args.json).write_text(json.dumps(res.as_dict(), indent=1))
    if args.plot:
        tune.plot(res, args.plot)
    if args.store and drafter.source is not None and not args.forced_accept:
        print(f"stored in {tune_store.store(res, drafter.source)}", file=sys.stderr)
    return 0


def run_tune_occupancy(args, target, drafter) -> int:
    """``tune --occupancy``: tokens/s of each candidate mode at each bucket, the pick."""
    from jspec import tune_store
    from jspec.bench.plain import make_prompts
    from jspec.engine import policy, tuning

    if args.prompts and args.prompts.endswith(".json"):
        data = json.loads(Path(args.prompts).read_text())      # a list, or {"train": [...]}
        prompts = data["train"] if isinstance(data, dict) else data
    elif args.prompts:
        prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    else:
        prompts = [list(map(int, p)) for p in make_prompts(target.config, args.slots, 32)]
    cands = [policy.parse_mode(c) for c in args.candidates]
    lengths = [len(target.tokenizer.encode(p)) if isinstance(p, str) else len(p)
               for p in prompts]
    rates = tuning.measure(target, drafter, prompts, cands, slots=args.slots,
                           new_tokens=args.new_tokens, repeats=args.repeats,
                           max_new_cap=args.max_new_cap, longest_prompt=max(lengths))
    picked = policy.pick(rates, cands)
    labels = [policy.mode_label(c) for c in cands]
    print("live slots  " + "  ".join(f"{x:>10}" for x in labels) + "   pick")
    for b, r in rates.items():
        print(f"{b:>10}  " + "  ".join(f"{r[x]:>10.1f}" for x in labels) +
              f"   {policy.mode_label(picked[b])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "pick": {
            b: policy.mode_label(m) for b, m in picked.picks.items()}}, indent=1))
    if args.store and drafter.source is not None:
        path = tune_store.store_occupancy(
            rates, {b: policy.mode_label(m) for b, m in picked.picks.items()}, drafter.source,
            measured_at={"slots": args.slots,
                         "max_new_cap": max(args.new_tokens, args.max_new_cap or 0)})
        print(f"stored in {path}", file=sys.stderr)
    return 0


def _lazy(module: str, name: str):
    """``module.name``, imported when the command runs (so ``--help`` stays fast)."""
    return lambda *a: getattr(importlib.import_module(module), name)(*a)


COMMANDS = {
    "demo": (_lazy("jspec.demo_cli", "add_args"), _lazy("jspec.demo_cli", "run"),
             "SmolLM2 answers a chat message, plain vs speculative"),
    "generate": (add_generate_args, run_generate, "generate text or token ids"),
    "chat": (_lazy("jspec.chat_cli", "add_args"), _lazy("jspec.chat_cli", "run"),
             "talk with an instruct model in the terminal, streamed, multi-turn"),
    "models": (_lazy("jspec.fetch", "add_args"), _lazy("jspec.fetch", "run"),
               "fetch a model by name (smollm2), or list the fetchable ones"),
    "tune": (add_tune_args, run_tune, "pick the tree shape from measured costs and acceptance"),
    "run": (_lazy("jspec.engine.runner", "add_args"), _lazy("jspec.engine.runner", "run"),
            "a JSONL dataset of requests through the serving engine, resumable"),
    "serve": (_lazy("jspec.serve.cli", "add_args"), _lazy("jspec.serve.cli", "run"),
              "an OpenAI-compatible HTTP server (completions, chat) over the engine"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jspec")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, _, help_) in COMMANDS.items():
        add(sub.add_parser(name, help=help_))
    args = parser.parse_args(argv)
    try:
        if getattr(args, "model", None):        # a fetchable name (smollm2) becomes its path
            args.model_as_given = args.model     # (the server still answers to the name)
            args.model = resolve_model(args.model)
        return COMMANDS[args.command][1](args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # Bad input is the user's to fix: one clear line, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
