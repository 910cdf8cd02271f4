"""``python -m jspec chat``: a multi-turn chat with an instruct model in the terminal.

Each line read becomes a user message; the whole conversation is rendered through the
model's chat template (:mod:`jspec.messages`) and served by one
:class:`jspec.engine.Engine` of one slot, made once: its reply streams as tokens are
accepted, stops at the end-of-turn token, joins the history, and a line on stderr gives the
turn's mean accept length (1.00 without a drafter), tokens/s and tokens. The engine compiles
its decode program once; a prompt is padded to a bucket (16, 32, 64, ... tokens), so a
conversation compiles an insert program only when it grows into a new bucket, and every
turn re-reads the whole history (no prefix cache across turns).

Commands: ``/reset`` clears the history (the ``--system`` message stays), ``/exit``, an
empty line or end of input ends. Input may be piped (one message per line).
"""

from __future__ import annotations

import argparse
import sys
import time


def add_args(p: argparse.ArgumentParser) -> None:
    from jspec.args import add_kernels_arg, add_prefill_chunk_arg, add_quantize_arg
    p.add_argument("--model", required=True, help="a model path (.gguf, HF directory, jspec "
                   "Orbax) or a fetchable name (smollm2; python -m jspec models list)")
    p.add_argument("--tokenizer", help="tokenizer file overriding the model's (its chat "
                   "template comes with it)")
    p.add_argument("--drafter", help="as for generate: a checkpoint, random:KIND, ngram[:MIN:MAX]")
    p.add_argument("--spec", help="S,K,N tree knobs (default: the drafter's)")
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per reply")
    p.add_argument("--context", type=int, default=None, help="the longest conversation in "
                   "tokens, which sizes the KV cache (default: the model's limit, at most 2048)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="turn t samples with seed + t")
    p.add_argument("--chunk", type=int, default=4,
                   help="iterations per compiled call: smaller streams in smaller pieces")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    add_kernels_arg(p)
    add_quantize_arg(p)
    add_prefill_chunk_arg(p)


class Session:
    """A conversation served by one engine: :meth:`turn` sends a user message and streams
    the reply to ``out``."""

    def __init__(self, engine, system: str | None = None, seed: int = 0, out=None, err=None):
        from jspec import messages
        self.engine, self.target = engine, engine.target
        self.stops = messages.stop_ids(self.target)
        self.system, self.seed = system, seed
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.turns = 0
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def turn(self, text: str, max_new_tokens: int) -> dict | None:
        """Reply to ``text``; returns the turn's stats (None when the request was refused:
        the conversation is too long, say; the message is then dropped from the history)."""
        from jspec import messages
        from jspec.engine import Request
        req = Request(messages=[*self.history, {"role": "user", "content": text}],
                      max_new_tokens=max_new_tokens, seed=self.seed + self.turns)
        t0, done = time.perf_counter(), None
        try:
            for d in self.engine.stream([req]):
                if d.text:
                    self.out.write(d.text)
                    self.out.flush()
                done = d.completion or done
        except ValueError as e:
            print(f"error: {e} (/reset starts a new conversation)", file=self.err)
            return None
        wall = time.perf_counter() - t0
        self.out.write("\n")
        self.out.flush()
        reply = messages.reply_text(self.target, done.tokens, self.stops)
        self.history += [req.messages[-1], {"role": "assistant", "content": reply}]
        self.turns += 1
        n = len(done.tokens)
        st = {"accept_len": done.stats.get("mean_accept_len", 1.0), "tokens": n,
              "tokens_per_s": n / wall if wall > 0 else 0.0,
              "stop_reason": done.stats["stop_reason"]}
        cut = ", cut at --max-new-tokens" if st["stop_reason"] == "max_new_tokens" else ""
        print(f"[accept len {st['accept_len']:.2f}, {st['tokens_per_s']:.1f} tok/s, {n} tokens"
              f"{cut}]", file=self.err, flush=True)
        return st


def lines(stream=None):
    """Input lines: with a prompt (and line editing) on a terminal, plain when piped."""
    stream = stream or sys.stdin
    interactive = stream.isatty()
    while True:
        try:
            line = input("> ") if interactive else stream.readline()
        except EOFError:
            return
        if not line:                                # end of piped input
            return
        yield line.rstrip("\n")


def make_engine(args, target):
    """One slot, sized for ``--context`` tokens of conversation plus a reply."""
    from jspec.args import load_drafter_arg
    from jspec.engine import Engine
    from jspec.sampling import SamplingConfig
    from jspec.spec_config import parse_spec

    drafter = load_drafter_arg(args.drafter, target) if args.drafter else None
    if args.spec and drafter is None:
        raise ValueError("--spec shapes a drafter's tree; give --drafter")
    context = args.context or min(target.config.max_position_embeddings, 2048)
    return Engine(target, drafter, slots=1, spec=parse_spec(args.spec) if args.spec else None,
                  sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
                  max_new_tokens=max(1, args.max_new_tokens), longest_prompt=context,
                  chunk=args.chunk, kernels=args.kernels, prefill_chunk=args.prefill_chunk)


def run(args) -> int:
    import jspec
    from jspec import messages

    target = jspec.load_target(args.model, dtype=args.dtype, tokenizer=args.tokenizer,
                               quantize=args.quantize)
    messages.chat_tokenizer(target, "--model")       # no template: refuse before compiling
    session = Session(make_engine(args, target), args.system, args.seed)
    try:
        for line in lines():
            cmd = line.strip()
            if cmd in ("", "/exit", "/quit"):
                break
            if cmd == "/reset":
                session.reset()
                print("(history cleared)", file=sys.stderr)
                continue
            session.turn(line, args.max_new_tokens)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0
