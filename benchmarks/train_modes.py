"""``python -m jspec.bench train-modes``: offline against online drafter training, in one run.

Offline training reads the target's features from a cache (``python -m jspec.train
features``); online training runs the target's forward inside each step and writes nothing.
This prints, for the given target and data:

- the feature cache's size on disk (``--features``), per position and per real token, against
  online's zero; and what such a cache holds per token for Llama-3-8B (three 4096-wide aux
  states and the final hidden state in bf16, plus the top-k logits and ids), scaled to
  ``--tokens`` (200M);
- training tokens/s of the same drafter on the same batches in both modes, timed in
  alternating rounds after a compile (the ratio is the figure to trust on a shared machine).
"""

from __future__ import annotations

import subprocess
import time

import jax
import numpy as np

from jspec.bench import common, configs
from jspec.bench.registry import Command, run_module

DEFAULT_TARGET = "checkpoints/default/target"


def cache_bytes_per_token(cfg, aux_layers: int, topk: int, dtype_bytes: int = 2) -> int:
    """Bytes a feature cache stores per position: aux states + hidden (``dtype_bytes`` each)
    + top-k logits (fp32) and ids (int32)."""
    return (aux_layers + 1) * cfg.hidden_size * dtype_bytes + topk * 8


def _du(path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def _time_mode(step, state, frozen, t2d, params, source, steps: int, first: int):
    tokens, t0 = 0, time.perf_counter()
    for s in range(first, first + steps):
        b = source.batch(s)
        tokens += int(np.sum(b["lens"]))
        state, m = step(state, frozen, t2d, params, source.place(b, None))
    jax.block_until_ready(m["loss"])
    return state, tokens, time.perf_counter() - t0


def main(args) -> dict:
    import jspec
    from jspec.train import drafter as D
    from jspec.train import features as F
    from jspec.train import trainer as T
    from jspec.train.sources import ArraySource, token_data

    target = jspec.load_target(args.target)
    cached = F.load_features(args.features)
    meta = cached["meta"]
    online_data = token_data([t[:n] for t, n in zip(cached["tokens"], cached["lens"])],
                             length=cached["tokens"].shape[1])
    disk = _du(args.features)
    positions = int(np.prod(cached["tokens"].shape))
    real = int(cached["lens"].sum())
    freqs = F.token_frequencies(cached["tokens"], cached["lens"], target.config.vocab_size)
    d = D.build_drafter(args.kind, target.config, target.params, jax.random.key(0),
                        aux_layers=tuple(meta["aux_layers"]), draft_vocab=args.draft_vocab,
                        freqs=freqs)
    trainable, frozen = D.split_params(d.params)
    t2d = D.draft_t2d(d.module, frozen, target.config.vocab_size)
    lc = D.default_loss(args.kind)
    modes = {}
    for name, online in (("offline", False), ("online", True)):
        tc = T.TrainConfig(steps=10**6, batch_size=args.batch_size, online=online,
                           topk=meta["topk"])
        _, step = T.make_train_step(d.module, target.config, lc, tc)
        src = ArraySource(online_data if online else cached, d.module, args.batch_size, 0)
        state = T.fresh_state(trainable, tc)
        state, _, _ = _time_mode(step, state, frozen, t2d, target.params, src, 2, 0)   # compile
        modes[name] = dict(step=step, state=state, src=src, tokens=0, seconds=0.0)
    for r in range(args.rounds):
        for name, m in modes.items():
            m["state"], n, s = _time_mode(m["step"], m["state"], frozen, t2d, target.params,
                                          m["src"], args.steps, 2 + r * args.steps)
            m["tokens"] += n
            m["seconds"] += s
    rate = {k: m["tokens"] / m["seconds"] for k, m in modes.items()}
    cfg8 = configs.RANDOM_CONFIGS["llama3-8b"]
    per8 = cache_bytes_per_token(cfg8, 3, meta["topk"])
    per_here = cache_bytes_per_token(target.config, len(meta["aux_layers"]), meta["topk"],
                                     np.dtype(cached["hidden"].dtype).itemsize)
    rows = [
        {"figure": "feature cache on disk (offline)", "value": f"{disk / 1e9:.2f} GB"},
        {"figure": "  sequences x positions (real tokens)",
         "value": f"{len(cached['tokens'])} x {cached['tokens'].shape[1]} ({real:,})"},
        {"figure": "  bytes per position (disk / formula)",
         "value": f"{disk / positions:.0f} / {per_here}"},
        {"figure": "  bytes per real token", "value": f"{disk / real:.0f}"},
        {"figure": "online: bytes on disk", "value": "0"},
        {"figure": f"offline tokens/s ({args.kind}, batch {args.batch_size})",
         "value": f"{rate['offline']:.0f}"},
        {"figure": "online tokens/s (target forward in the step)",
         "value": f"{rate['online']:.0f}"},
        {"figure": "online / offline", "value": f"{rate['online'] / rate['offline']:.2f}"},
        {"figure": "Llama-3-8B cache per token (bf16, 3 aux + hidden, top-k)",
         "value": f"{per8:,} B"},
        {"figure": f"Llama-3-8B cache for {args.tokens / 1e6:.0f}M tokens",
         "value": f"{per8 * args.tokens / 1e12:.2f} TB"},
    ]
    print(common.format_table(rows, ["figure", "value"]))
    out = {"disk_bytes": disk, "positions": positions, "real_tokens": real,
           "tokens_per_s": rate, "llama3_8b_bytes_per_token": per8,
           "llama3_8b_cache_bytes": per8 * args.tokens, "rounds": args.rounds,
           "steps_per_round": args.steps, "kind": args.kind, "batch_size": args.batch_size}
    if args.json:
        common.write_json(args.json, out)
    return out


def add_args(s) -> None:
    s.add_argument("--target", default=DEFAULT_TARGET)
    s.add_argument("--features", required=True, help="a feature cache (`jspec.train features`)")
    s.add_argument("--kind", default="eagle3")
    s.add_argument("--draft-vocab", type=int, default=1024)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--steps", type=int, default=10, help="steps per mode per round")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--tokens", type=float, default=200e6, help="the 8B extrapolation's tokens")
    s.add_argument("--json", metavar="OUT")


COMMAND = Command("train-modes", "offline (feature cache) against online drafter training: "
                                 "disk and tokens/s, in one run", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
