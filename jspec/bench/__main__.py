"""``python -m jspec.bench {plain,forward,spec,serve,serve-plan,anatomy,plan,load,long-run,aot-kernels} ...``
(see :mod:`jspec.bench`)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jspec.bench", description=__doc__)
    sub = p.add_subparsers(dest="bench", required=True)

    def common_args(s, default_batch, default_repeats):
        s.add_argument("--random-config", metavar="NAME",
                       help="a named random config from jspec.bench.configs (tiny, 100m)")
        s.add_argument("--batch", type=int, nargs="+", default=default_batch)
        s.add_argument("--repeats", type=int, default=default_repeats,
                       help="timed calls after warm-up (the median is reported)")
        s.add_argument("--dtype", default="float32")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--json", metavar="OUT", help="also write the rows as JSON")

    s = sub.add_parser("plain", help="end-to-end greedy generation, jspec vs transformers")
    s.add_argument("--model", metavar="PATH",
                   help="HF directory, jspec Orbax directory or llama2.c .bin")
    common_args(s, [1, 8], 3)
    s.add_argument("--new-tokens", type=int, default=256)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None,
                   help="run transformers' greedy generate on the same weights "
                        "(default: when torch and transformers are importable)")

    s = sub.add_parser("forward", help="1-token decode step vs a block forward on a long cache")
    common_args(s, [1], 20)
    s.add_argument("--context", type=int, default=1024)
    s.add_argument("--block", type=int, default=8)
    s.add_argument("--page-size", type=int, default=16)

    s = sub.add_parser("spec", help="speculative decoding (chain/tree per drafter) vs plain; "
                                    "--simulate: forced accept lengths vs a cost model")
    s.add_argument("--model", metavar="PATH",
                   help="HF directory, jspec Orbax directory or llama2.c .bin")
    common_args(s, [1], 3)
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--drafter", metavar="PATH", nargs="+", default=[],
                   help="drafter checkpoints (jspec Orbax or HF EAGLE/EAGLE-3/Medusa/MTP layouts), "
                        "or ngram[:MIN_N:MAX_N] (prompt lookup)")
    s.add_argument("--kinds", nargs="*", default=None,
                   help="random-weight drafters to run (default: all four, none with --prompts; "
                        "the oracle runs unless --prompts)")
    s.add_argument("--prompts", metavar="FILE", default=None,
                   help="text prompts, one per line, run one at a time at batch 1 instead of "
                        "random-token prompts (needs a tokenizer)")
    s.add_argument("--num-prompts", type=int, default=8, help="with --prompts: how many lines")
    s.add_argument("--simulate", metavar="E", type=float, nargs="+", default=None,
                   help="part B: forced mean accept lengths (e.g. 2 3 4)")
    s.add_argument("--sim-drafter", default="eagle3", choices=["eagle1", "eagle3", "mtp"],
                   help="part B: the random drafter whose costs are simulated")
    s.add_argument("--sim-draft-vocab", type=int, default=8192,
                   help="part B: its draft vocabulary (0: the target's)")
    s.add_argument("--sim-spec", nargs="+", default=["5,4,8", "4,1,5"], metavar="S,K,N",
                   help="part B: tree knobs to simulate")
    s = sub.add_parser("plan", help="per-device memory and the collectives of one iteration of "
                                    "sharded speculative decoding, compiled on simulated CPU "
                                    "devices from abstract weights (nothing allocated)")
    s.add_argument("--config", default="llama3-8b", help="a named random config (llama3-8b, "
                   "llama3-70b, 100m, ...)")
    s.add_argument("--drafter", default="eagle3", help="eagle1, eagle3, mtp")
    s.add_argument("--mesh", default="2x4", help="DATAxMODEL")
    s.add_argument("--spec", metavar="S,K,N", default=None)
    s.add_argument("--draft-vocab", type=int, default=None)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--context", type=int, default=2048)
    s.add_argument("--max-new", type=int, default=128)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--dtype", default=None)
    s.add_argument("--topology", "--aot", dest="aot", metavar="TOPOLOGY", default=None,
                   help="compile for a TPU topology's abstract chips (e.g. v5e:2x4, v5e:8x8, "
                        "v6e:2x2 with --mesh 1x1 for one chip; needs libtpu, else simulated CPU "
                        "devices) instead of simulated CPU devices")
    s.add_argument("--hlo", metavar="FILE", help="also write the compiled program's HLO")
    s.add_argument("--plain-step", action="store_true",
                   help="also compile plain decoding on the mesh: one plain step's HBM bytes "
                        "per device beside one iteration's")
    s.add_argument("--kernels", default="auto", choices=["auto", "reference", "pallas"],
                   help="auto: the Pallas kernels when compiling for a topology, else the "
                        "reference")
    s.add_argument("--trace-for", default="tpu", choices=["tpu", "gpu", "cpu"],
                   help="the platform whose code paths are traced (compiled for CPU devices)")
    s.add_argument("--json", metavar="OUT")
    s = sub.add_parser("load", help="host memory of loading a checkpoint onto a mesh: whole "
                                    "then placed vs slice-wise into the shardings")
    s.add_argument("--checkpoint", default=None, help="HF or Orbax directory")
    s.add_argument("--random-config", default="100m",
                   help="without --checkpoint: write a random HF checkpoint of this shape")
    s.add_argument("--mesh", default="2x4", help="DATAxMODEL")
    s.add_argument("--json", metavar="OUT")
    s = sub.add_parser("anatomy", help="compiled plain step and speculative phases: kernels, "
                                       "bytes, flops, memory, compile time (nothing timed)")
    s.add_argument("--random-config", metavar="NAME", default="tiny",
                   help="a named random config (tiny, 100m, llama3-8b); no weights are made")
    s.add_argument("--drafter", metavar="KIND", default="eagle3",
                   help="eagle1, eagle3, mtp, medusa, or none (plain step only)")
    s.add_argument("--spec", metavar="S,K,N", default=None,
                   help="tree knobs (default: the drafter's); a chain is S,1,S+1")
    s.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle3: reduced draft vocabulary (with a d2t map)")
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--context", type=int, default=1024, help="prompt tokens in the cache per row")
    s.add_argument("--max-new", type=int, default=128)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0,
                   help="> 0 compiles the sampling walk instead of the greedy one")
    s.add_argument("--dtype", default=None,
                   help="default: the config's natural dtype (bfloat16 for llama3-8b, else float32)")
    s.add_argument("--programs", nargs="+", default=None,
                   help="a subset of: plain_step draft verify finish iteration")
    s.add_argument("--layout", choices=["scan", "per-layer"], default="scan",
                   help="target weights: the stacked, scanned layer stack TPUs/GPUs run "
                        "(default) or the per-layer weights CPUs run")
    s.add_argument("--topology", "--aot", dest="aot", default=None,
                   choices=["v5e", "v6e", "v5p", "h200", "v5e:2x2", "v6e:2x2", "v5p:2x2x1"],
                   help="compile for one chip of this accelerator on this host, without one "
                        "(TPU: libtpu, the tpu-aot extra; h200: the gpu-aot extra, run with "
                        "JAX_PLATFORMS=cpu); the counts are then that chip's program's")
    s.add_argument("--kernels", choices=["reference", "pallas"], default="reference",
                   help="attention and verify walk: the jnp reference or the Pallas kernels "
                        "(TPU/GPU, e.g. with --aot)")
    s.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    from jspec.bench.serve import add_args as serve_args
    serve_args(sub.add_parser("serve", help="a skewed stream of requests: generate in batches vs "
                                            "the engine (plain, fixed spec, pick per occupancy)"))
    from jspec.bench.serve_plan import add_args as serve_plan_args
    serve_plan_args(sub.add_parser("serve-plan", help="the engine's programs compiled for TPU "
                                                      "chips or an H200 without them: memory "
                                                      "per chip"))
    long_run_args(sub.add_parser("long-run", help="a ~16k-token generation and 200 consecutive "
                                                  "calls: RSS, compile counts, wall time"))
    return p


def long_run_args(s) -> None:
    s.add_argument("--parts", nargs="+", choices=["long", "calls"], default=["long", "calls"])
    s.add_argument("--model", default=None, help="default: checkpoints/default/target")
    s.add_argument("--drafter", default=None,
                   help="drafter checkpoint (default: the shipped EAGLE-3), or none")
    s.add_argument("--spec", metavar="S,K,N", default=None, help="default: the drafter's")
    s.add_argument("--prompts", default=None,
                   help="text file (default: the shipped held-out prompts); long: one line a "
                        "row; calls: windows of its tokens")
    s.add_argument("--rows", type=int, default=8, help="long: rows of the long call")
    s.add_argument("--new-tokens", type=int, default=None,
                   help="long: new tokens a row (default: up to max_position_embeddings)")
    s.add_argument("--short-tokens", type=int, default=512,
                   help="long: new tokens a row of the short call it is compared with")
    s.add_argument("--calls", type=int, default=200)
    s.add_argument("--max-new", type=int, default=32, help="calls: max_new_tokens")
    s.add_argument("--buckets", type=int, default=2, help="calls: prompt buckets of 16 used")
    s.add_argument("--temperature", type=float, default=0.8, help="calls: the sampled calls'")
    s.add_argument("--check-every", type=int, default=10,
                   help="calls: rerun every n-th greedy call with plain decoding")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", metavar="OUT", help="also write the figures as JSON")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["kernels"]:          # its own parser: a device script, see kernels.py
        from jspec.bench import kernels
        return kernels.main(argv[1:])
    if argv[:1] == ["phases"]:           # its own parser: sets XLA_FLAGS before JAX starts
        from jspec.bench import phases
        return phases.main(argv[1:])
    if argv[:1] == ["aot-kernels"]:      # its own parser: the kernels compiled deviceless
        from jspec.bench import aot_kernels
        raise SystemExit(aot_kernels.main(argv[1:]))    # 1 when a cell failed to compile
    if argv[:1] == ["device"]:           # its own parser: the prepared H200 script, see device.py
        from jspec.bench import device
        return device.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.bench == "plain":
        if args.model is None and args.random_config is None:
            args.random_config = "tiny"
        if args.model is not None and args.random_config is not None:
            raise SystemExit("pass --model or --random-config, not both")
        from jspec.bench import plain
        return plain.main(args)
    if args.bench == "spec":
        if args.model is not None and args.random_config is not None:
            raise SystemExit("pass --model or --random-config, not both")
        if len(args.batch) != 1:
            raise SystemExit("spec takes one --batch")
        if args.model is None and args.random_config is None:
            args.random_config = "100m" if args.simulate else "tiny"
        from jspec.bench import spec
        return spec.main(args)
    if args.bench == "load":
        from jspec.bench import load
        return load.main(args)
    if args.bench == "plan":
        from jspec.bench import plan
        return plan.main(args)
    if args.bench == "long-run":
        from jspec.bench import long_run
        return long_run.main(args)
    if args.bench == "serve-plan":
        from jspec.bench import serve_plan
        return serve_plan.main(args)
    if args.bench == "serve":
        from jspec.bench import serve
        return serve.main(args)
    if args.bench == "anatomy":
        from jspec.bench import anatomy
        return anatomy.main(args)
    if args.random_config is None:
        args.random_config = "100m"
    from jspec.bench import forward
    return forward.main(args)


if __name__ == "__main__":
    main(sys.argv[1:])
