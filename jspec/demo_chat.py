"""``python -m jspec demo``: a real instruct model answers a chat message, plain and speculative
side by side.

The model is SmolLM2-135M-Instruct from its GGUF (``python -m jspec models fetch smollm2``,
fetched on first use and cached). The message goes through the model's own chat template; the
answer streams as the speculative engine accepts it, and stops at the template's end of turn.
Then warm plain and speculative ``generate`` calls are timed side by side (interleaved, best of
``--repeats``), and the report says the mean accept length, both rates, the speedup and whether
the tokens are plain decoding's (greedy speculative decoding must give exactly the target's
tokens: a difference is an error, and so is a streamed answer that differs).

The drafter: no trained head for SmolLM2 ships yet, so the demo drafts with n-gram prompt
lookup (no weights). It pays where the answer copies the prompt, as in editing, which is why
the default message asks for a corrected paragraph; on open-ended questions it accepts ~1.3
tokens a pass and does not pay (``--message`` shows it). Without network on a first run the
command falls back to the shipped 6.7M model (:mod:`jspec.demo`); ``--model default`` asks for
that one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from jspec import compile_cache as compile_cache_mod
from jspec.timing import round_robin, wall_s

MESSAGE = ("Fix the spelling mistakes in this paragraph and return the corrected paragraph:\n\n"
           "The quick brown fox jumpd over the lazy dog. It was a beutiful day in the forrest, "
           "and all the animals were playing togther near the river. The sun was shinning and "
           "the birds were singing.")
CHAIN = 6       # n-gram chain length: the fastest of 2, 4, 6 on this message (docs/chat.md)


def _compile(label: str, fn):
    print(f"  {label}: compiling ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    out = fn()
    print(f" {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return out


def stream_answer(target, drafter, spec, ids, stop, n, kernels) -> list[int]:
    """The answer as the engine accepts it, printed as it comes; returns its tokens."""
    from jspec.engine import Engine, Request

    eng = Engine(target, drafter, slots=1, spec=spec, max_new_tokens=n,
                 longest_prompt=len(ids), kernels=kernels)
    toks: list[int] = []
    print("assistant: ", end="", flush=True)
    t0 = time.perf_counter()
    for d in eng.stream([Request(ids, n, stop_ids=stop)]):
        print(d.text if d.text is not None else "", end="", flush=True)
        toks += d.tokens
    print(f"\n  (streamed in {time.perf_counter() - t0:.1f}s, compilation included)",
          file=sys.stderr)
    return toks


def run(model: str | Path, message: str | None, n: int, *, steps: int = CHAIN,
        repeats: int = 3, kernels: str = "auto", compile_cache: bool = True,
        quantize: str | None = None) -> int:
    import jspec
    from jspec import messages
    from jspec.drafters import ngram_drafter
    from jspec.spec_config import SpecConfig

    if compile_cache:      # on already, unless JSPEC_COMPILE_CACHE=0 (the demo insists)
        compile_cache_mod.enable(force=True)
    target = jspec.load_target(model, quantize=quantize)
    cfg = target.config
    weights = cfg.dtype if quantize is None else f"{quantize} layers, {cfg.dtype} otherwise"
    print(f"model: {Path(model).name} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}, {weights})")
    message = MESSAGE if message is None else message
    conv = [{"role": "user", "content": message}]
    ids = messages.render(target, conv)
    stop = messages.stop_ids(target)
    drafter, spec = ngram_drafter(cfg), SpecConfig.chain(steps)
    print(f"drafter: n-gram prompt lookup, chain({steps}) (no trained SmolLM2 head ships yet)")
    print(f"\nuser: {message}\n")
    streamed = stream_answer(target, drafter, spec, ids, stop, n, kernels)

    def call(**kw):
        return jspec.generate(target, [ids], max_new_tokens=n, stop_ids=stop, kernels=kernels,
                              **kw)
    _compile("plain generate", call)
    _compile(f"n-gram chain({steps}) generate", lambda: call(drafter=drafter, spec=spec))
    plain, fast = round_robin([call, lambda: call(drafter=drafter, spec=spec)], repeats,
                              seconds=wall_s)
    st = fast.result.stats[0]
    print(f"\nmean accept length:   {st['mean_accept_len']:.2f} tokens per verify pass "
          f"({st['iterations']} passes for {st['new_tokens']} tokens)")
    for name, t in (("plain decoding:      ", plain), ("speculative decoding:", fast)):
        k = len(t.result.tokens[0])
        print(f"{name} {k / t.best:7.1f} tok/s ({k} tokens in {t.best:.3f}s, warm, best of "
              f"{repeats})")
    print(f"speedup:              {plain.best / fast.best:.2f}x")
    same = fast.result.tokens == plain.result.tokens and streamed == plain.result.tokens[0]
    print(f"tokens identical to plain decoding: {'yes' if same else 'NO'}")
    if not same:
        raise RuntimeError("speculative greedy tokens differ from plain decoding")
    return 0
