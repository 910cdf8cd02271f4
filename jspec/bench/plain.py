"""``python -m jspec.bench plain``: end-to-end greedy generation speed, jspec vs transformers.

For each batch size, the same random prompts (BOS first, ``prompt_len`` tokens per row, no
padding) go through :func:`jspec.generate` (``stop_ids=[]``, so every row produces exactly
``new_tokens``) and, when torch + transformers are importable, through transformers' greedy
``generate`` on the same fp32 weights (EOS disabled, ``min_new_tokens = max_new_tokens``).

Columns:
  compile s   first jspec call minus the steady-state median (tracing + XLA compilation)
  tokens/s    generated tokens of all rows / median wall time of one call (prefill included)
  ms/token    median wall time / new_tokens: the time of one decode step for the whole batch
  HF tokens/s transformers' greedy generate, same definition
  jspec/HF    tokens/s ratio
  same tokens whether every row's jspec and HF greedy tokens are identical
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import jax
import numpy as np

from jspec.bench import common
from jspec.bench.configs import random_config
from jspec.bench.registry import Command
from jspec.target import Target
from jspec.timing import round_robin, wall_s

COLUMNS = ["batch", "prompt len", "new tokens", "compile s", "tokens/s", "ms/token",
           "HF tokens/s", "jspec/HF", "same tokens"]


def is_hf_dir(path: str | None) -> bool:
    return bool(path) and os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")) \
        and any(f.endswith(".safetensors") or f.endswith(".bin") for f in os.listdir(path))


def load(model: str | None = None, random_config_name: str | None = None,
         dtype: str = "float32", seed: int = 0) -> tuple[Target, str]:
    """The benchmark target and a description of where it came from."""
    if (model is None) == (random_config_name is None):
        raise ValueError("pass exactly one of --model PATH or --random-config NAME")
    if model is not None:
        import jspec
        return jspec.load_target(model, dtype=dtype), model
    cfg = random_config(random_config_name, dtype)
    return Target(cfg, common.random_params(cfg, seed)), f"random:{random_config_name}"


def make_prompts(cfg, batch: int, prompt_len: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    low = 3 if cfg.vocab_size > 3 else 0
    p = rng.integers(low, cfg.vocab_size, size=(batch, prompt_len), dtype=np.int64)
    if cfg.bos_token_id is not None and 0 <= cfg.bos_token_id < cfg.vocab_size:
        p[:, 0] = cfg.bos_token_id
    return p.astype(np.int32)


def run_plain(target: Target, batches: Sequence[int] = (1, 8), new_tokens: int = 256,
              prompt_len: int = 32, repeats: int = 3, hf: bool | None = None,
              hf_path: str | None = None, seed: int = 0, log=print) -> list[dict]:
    """One table row per batch size (see the module docstring for the columns).

    ``hf``: None runs the transformers comparison when it is importable, True requires it,
    False skips it. ``hf_path``: an HF checkpoint directory to load the twin from (otherwise
    it is built from ``target.params``)."""
    import jspec

    if hf is None:
        hf = common.hf_available()
    hf_model = None
    if hf:
        hf_model = (common.hf_model_from_dir(hf_path) if hf_path
                    else common.hf_model_from_params(target.config, target.params))
    rows = []
    for B in batches:
        prompts = make_prompts(target.config, B, prompt_len, seed + B)
        plist = prompts.tolist()
        run, = round_robin(
            [lambda: jspec.generate(target, plist, max_new_tokens=new_tokens, stop_ids=[])],
            repeats, seconds=wall_s)
        first, med, toks = run.first, run.median, run.result.tokens
        if any(len(t) != new_tokens for t in toks):
            raise RuntimeError(f"jspec produced {[len(t) for t in toks]} tokens, expected {new_tokens}")
        row = {"batch": B, "prompt len": prompt_len, "new tokens": new_tokens,
               "compile s": max(0.0, first - med), "tokens/s": B * new_tokens / med,
               "ms/token": 1000.0 * med / new_tokens, "jspec s": med, "jspec first s": first}
        if hf_model is not None:
            hcall = common.hf_greedy(hf_model, prompts, new_tokens)
            t, = round_robin([hcall], repeats)
            hf_toks = t.result
            row["HF tokens/s"] = B * new_tokens / t.median
            row["HF s"] = t.median
            row["jspec/HF"] = row["tokens/s"] / row["HF tokens/s"]
            same = [list(map(int, hf_toks[r])) == list(toks[r]) for r in range(B)]
            row["same tokens"] = all(same)
            if not all(same):
                r = same.index(False)
                k = next((i for i, (a, b) in enumerate(zip(hf_toks[r], toks[r])) if a != b),
                         min(len(hf_toks[r]), len(toks[r])))
                row["first mismatch"] = {"row": r, "position": k}
        rows.append(row)
        if log:
            log(f"  batch {B}: done ({row['tokens/s']:.1f} tok/s)")
    return rows


def describe(target: Target, source: str) -> str:
    c = target.config
    return (f"model {source}: {common.param_count(target.params) / 1e6:.2f}M params, "
            f"L={c.num_layers} H={c.hidden_size} heads={c.num_heads}/{c.num_kv_heads} "
            f"V={c.vocab_size} dtype={c.dtype}; jax {jax.__version__} on "
            f"{jax.devices()[0].platform} ({os.cpu_count()} CPUs, load avg {common.load_avg()})")


def add_args(s) -> None:
    s.add_argument("--model", metavar="PATH",
                   help="HF directory, jspec Orbax directory or llama2.c .bin")
    common.add_common_args(s, [1, 8], 3)
    s.add_argument("--new-tokens", type=int, default=256)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None,
                   help="run transformers' greedy generate on the same weights "
                        "(default: when torch and transformers are importable)")


def main(args) -> list[dict]:
    if args.model is None and args.random_config is None:
        args.random_config = "tiny"
    if args.model is not None and args.random_config is not None:
        raise SystemExit("pass --model or --random-config, not both")
    target, source = load(args.model, args.random_config, args.dtype, args.seed)
    want_hf = args.hf
    if want_hf is None:
        want_hf = common.hf_available()
    elif want_hf and not common.hf_available():
        raise SystemExit("--hf: torch and transformers are not importable")
    hf_path = args.model if (want_hf and is_hf_dir(args.model)) else None
    print(describe(target, source))
    if want_hf:
        print("HF twin: " + (f"transformers from_pretrained({hf_path})" if hf_path
                             else "transformers LlamaForCausalLM built from the same params") + ", fp32")
    rows = run_plain(target, args.batch, args.new_tokens, args.prompt_len, args.repeats,
                     hf=want_hf, hf_path=hf_path, seed=args.seed)
    print()
    print(common.format_table(rows, COLUMNS))
    print(f"\n(median of {args.repeats} calls after warm-up; prefill included; "
          "ms/token = one decode step for the whole batch)")
    if args.json:
        common.write_json(args.json, {"benchmark": "plain", "model": source,
                                      "description": describe(target, source),
                                      "columns": COLUMNS, "rows": rows})
    return rows


COMMAND = Command("plain", "end-to-end greedy generation, jspec vs transformers", add_args, main)
