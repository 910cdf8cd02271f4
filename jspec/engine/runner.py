"""``python -m jspec run``: a dataset of requests through the engine, resumable.

Input: JSON lines, one request each: ``id``, ``prompt`` (text) or ``prompt_ids``, or
``messages`` (a chat, ``[{"role": "user", "content": "..."}]``, rendered through the model's
chat template with the assistant's header appended; it stops at the template's end-of-turn
token unless ``stop`` says otherwise), and optional ``max_new_tokens``, ``temperature``,
``top_k``, ``top_p``, ``seed`` and ``stop`` (a list of token ids, or of strings that are one
token each; multi-token stop strings are refused), and structured output: ``response_format``
(``jspec.generate``'s), or ``regex`` / ``choices``. Missing fields take the command's flags.

Output: JSON lines appended as requests finish, each written and flushed whole: ``id``,
``line`` (of the input, 1-based), ``text``, ``token_ids``, ``new_tokens``,
``mean_accept_len``, ``iterations``, ``stop_reason``, ``latency_s``. A bad record (bad JSON,
no prompt, malformed messages or a model without a chat template, a duplicate id, ids
outside the vocabulary, a prompt the model cannot hold) is reported on stderr with its line
and id, and written as ``{"id", "line", "error"}`` (``--on-error write``, the default) or
left out (``skip``); the run goes on.

Resuming: rerunning the same command reads the output first, drops a cut last line (a
``kill -9`` mid-write), and skips every id already there (and every line, for error records
without an id): each id ends up exactly once. A request's output depends only on itself
(greedy; sampled: its ``seed``, default ``--seed`` mixed with a hash of its id), so a resumed
run equals an uninterrupted one. SIGTERM or SIGINT (a preempted VM) finishes the chunk in
flight, flushes what has finished and exits 0; requests still in flight are redone on rerun.

Every record is served by one engine, the longest requests first
(:meth:`jspec.engine.Engine.stream`, ``order="longest"``): a record's (temperature, top_k,
top_p) are runtime values of its slot, so mixed settings share the batch and the compiled
programs. When no record samples, the engine compiles greedy decoding alone.

Pods (``--distributed``): every process runs the same command; process ``i`` of ``n`` serves
the records on lines ``i, i + n, ...`` with its own engine on its own devices and writes its
own part, ``OUTPUT.part-i-of-n`` (resumable alone). When all are done, process 0 merges the
parts into ``OUTPUT``. The results are those of one process over the whole file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import time
import zlib
from pathlib import Path

from jspec import atomic

log = logging.getLogger("jspec")

OUTPUT_KEYS = ("id", "line", "text", "token_ids", "new_tokens", "mean_accept_len",
               "iterations", "stop_reason", "latency_s")


def add_args(p: argparse.ArgumentParser) -> None:
    from jspec.args import (add_kernels_arg, add_prefill_chunk_arg, add_process_args,
                            add_quantize_arg)
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", help="as for generate (a checkpoint, random:KIND, ngram)")
    p.add_argument("--input", required=True, help="requests, JSON lines")
    p.add_argument("--output", required=True, help="results, JSON lines (appended; resumable)")
    p.add_argument("--slots", type=int, help="engine slots (default: 8 on CPU, 64 on TPU/GPU)")
    p.add_argument("--policy", default="fixed", help="'fixed' (the drafter's spec, or "
                   "--spec, at every occupancy) or 'auto' (the per-occupancy picks stored by "
                   "`python -m jspec tune --occupancy`)")
    p.add_argument("--spec", help="S,K,N tree knobs for --policy fixed (default: the drafter's)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="default per record")
    p.add_argument("--max-new-cap", type=int, default=4096,
                   help="records asking for more new tokens are errors")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="mixed with each id's hash when a "
                   "record has no seed")
    p.add_argument("--chunk", type=int, default=8, help="iterations between refills")
    p.add_argument("--on-error", choices=["write", "skip"], default="write")
    p.add_argument("--mesh", metavar="DATAxMODEL", help="not yet served by the engine: run one "
                   "process per host with --distributed")
    add_process_args(p, "join a multi-host run; each process serves its share and writes its "
                        "own part")
    p.add_argument("--no-progress", action="store_true")
    add_kernels_arg(p)
    add_quantize_arg(p)
    add_prefill_chunk_arg(p)


@dataclasses.dataclass
class Record:
    line: int
    id: object = None
    ids: list | None = None
    max_new: int = 0
    sampling: tuple = (0.0, 0, 1.0)
    seed: int = 0
    stop: list | None = None
    error: str | None = None
    response_format: dict | None = None


def read_done(path: Path) -> tuple[set, set]:
    """``(ids, lines)`` already in an output file. A last line cut mid-write (no newline,
    or not JSON) is truncated away, so appending continues from whole lines."""
    ids, lines = set(), set()
    if not path.is_file():
        return ids, lines
    data = path.read_bytes()
    good = 0
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            break
        good += len(raw)
        if rec.get("id") is not None:
            ids.add(_key(rec["id"]))
        lines.add(rec.get("line"))
    if good < len(data):
        log.warning("%s: dropping a cut last line (%d bytes)", path, len(data) - good)
        with open(path, "r+b") as f:
            f.truncate(good)
    return ids, lines


def _key(x) -> str:
    return json.dumps(x, sort_keys=True)


def parse(text: str, line: int, target, args) -> Record:
    """One input line -> a :class:`Record` (``error`` set when it cannot be served)."""
    from jspec import messages
    from jspec.plan import check_prompt

    rec = Record(line)
    try:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("a record must be a JSON object")
    except (json.JSONDecodeError, ValueError) as e:
        rec.error = f"bad JSON: {e}"
        return rec
    rec.id = d.get("id")
    try:
        if rec.id is None:
            raise ValueError("no id")
        if "messages" in d:
            if "prompt" in d or "prompt_ids" in d:
                raise ValueError("give one of 'messages', 'prompt' and 'prompt_ids'")
            rec.ids = messages.render(target, d["messages"])
            rec.stop = messages.stop_ids(target)      # unless the record's "stop" says
        elif "prompt_ids" in d:
            rec.ids = [int(t) for t in d["prompt_ids"]]
        elif isinstance(d.get("prompt"), str):
            if target.tokenizer is None:
                raise ValueError("a text prompt needs a model with a tokenizer")
            rec.ids = target.tokenizer.encode(d["prompt"])
        else:
            raise ValueError("no prompt (give 'prompt' text, 'prompt_ids' or 'messages')")
        check_prompt(rec.ids, target.config.vocab_size, rec.id)
        rec.max_new = int(d.get("max_new_tokens", args.max_new_tokens))
        if not 0 <= rec.max_new <= args.max_new_cap:
            raise ValueError(f"max_new_tokens={rec.max_new} outside [0, {args.max_new_cap}]")
        limit = target.config.max_position_embeddings
        if len(rec.ids) + rec.max_new > limit:
            raise ValueError(f"prompt of {len(rec.ids)} tokens plus {rec.max_new} new ones is "
                             f"longer than the model's limit of {limit} positions")
        rec.sampling = _sampling(d, args)
        rec.seed = int(d["seed"]) if "seed" in d else \
            (args.seed * 1_000_003 + zlib.crc32(_key(rec.id).encode())) % 2 ** 31
        if "stop" in d:
            rec.stop = [_stop_id(s, target) for s in d["stop"]]
        rec.response_format = _response_format(d, target, rec)
    except (ValueError, TypeError) as e:
        rec.error = str(e)
    return rec


def _response_format(d: dict, target, rec: Record) -> dict | None:
    """A record's structured output: ``response_format`` (jspec.generate's), or the short
    forms ``regex`` (a string) and ``choices`` (a list of strings); checked and compiled
    here (cached, as the engine checks a request), so a bad grammar is that record's error."""
    from jspec.engine import Request
    from jspec.engine.grammars import automaton_for
    given = [k for k in ("response_format", "regex", "choices") if k in d]
    if len(given) > 1:
        raise ValueError(f"give one of {given}")
    if not given:
        return None
    k = given[0]
    fmt = d[k] if k == "response_format" else {"type": "regex", "regex": d[k]} \
        if k == "regex" else {"type": "choice", "choices": d[k]}
    automaton_for(target, Request(rec.ids, stop_ids=rec.stop, id=rec.id, response_format=fmt))
    return fmt


def _sampling(d: dict, args) -> tuple:
    """A record's (temperature, top_k, top_p), its missing fields from the flags; checked."""
    from jspec.sampling import check

    t, k, p = (d.get("temperature", args.temperature), d.get("top_k", args.top_k),
               d.get("top_p", args.top_p))
    if isinstance(k, float) and k.is_integer():
        k = int(k)                          # JSON writers may give 40.0
    check(t, k, p)
    return float(t), int(k), float(p)


def _stop_id(s, target) -> int:
    if isinstance(s, int):
        return s
    if target.tokenizer is None:
        raise ValueError("stop strings need a model with a tokenizer; give token ids")
    ids = target.tokenizer.encode(s, bos=False)
    if len(ids) != 1:
        raise ValueError(f"stop string {s!r} is {len(ids)} tokens; stops are single tokens")
    return ids[0]


class _Stop:
    """SIGTERM / SIGINT: finish the chunk in flight, then stop."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        log.warning("signal %d: finishing the chunk in flight, then exiting", signum)
        self.requested = True


def pending(input_path, part: Path, target, args, rank: int, world: int) -> list:
    """This process's records of ``input_path`` (lines ``rank``, ``rank + world``, ...) not
    yet in ``part``; a repeated id among them is marked as an error."""
    done_ids, done_lines = read_done(part)
    records = []
    with open(input_path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if (n - 1) % world != rank or not text.strip():
                continue
            records.append(parse(text, n, target, args))
    seen, todo = set(done_ids), []
    for r in records:
        key = None if r.id is None else _key(r.id)
        if (key in done_ids) or (key is None and r.line in done_lines):
            continue
        if r.error is None and key in seen:
            r.error = f"duplicate id {r.id!r}"
        if key is not None and r.error is None:
            seen.add(key)
        todo.append(r)
    return todo


def run(args, target=None) -> int:
    """Serve ``args.input`` (the parsed flags of :func:`add_args`); ``target``: ``args.model``
    loaded already (by a caller that needed it first), else loaded here."""
    from jspec import distributed

    multi = distributed.join(args)
    if args.mesh:
        raise ValueError("the engine does not shard over a mesh yet; run one process per host "
                         "with --distributed (each serves its share on its own devices)")
    import jax

    import jspec
    from jspec.args import load_drafter_arg
    from jspec.spec_config import parse_spec

    rank, world = (jax.process_index(), jax.process_count()) if multi else (0, 1)
    out_path = Path(args.output)
    part = out_path if world == 1 else out_path.with_name(
        f"{out_path.name}.part-{rank}-of-{world}")
    target = target if target is not None else jspec.load_target(
        args.model, quantize=getattr(args, "quantize", None))
    drafter = load_drafter_arg(args.drafter, target) if args.drafter else None
    spec = parse_spec(args.spec) if args.spec else None
    todo = pending(args.input, part, target, args, rank, world)
    stop = _Stop()
    with open(part, "a", encoding="utf-8") as out:
        def write(obj):
            out.write(json.dumps(obj) + "\n")
            out.flush()

        good = []
        for r in todo:
            if r.error is None:
                good.append(r)
                continue
            print(f"jspec run: line {r.line}, id {r.id!r}: {r.error}", file=sys.stderr)
            if args.on_error == "write":
                write({"id": r.id, "line": r.line, "error": r.error})
        finished = _serve(target, drafter, spec, good, args, write, stop)
    if stop.requested:
        print(f"jspec run: stopped by signal after {finished} requests; rerun the same command "
              f"to resume", file=sys.stderr)
        return 0
    if world > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("jspec run: parts written")
        if rank == 0:
            merge([out_path.with_name(f"{out_path.name}.part-{i}-of-{world}")
                   for i in range(world)], out_path)
    return 0


def _serve(target, drafter, spec, records, args, write, stop) -> int:
    """Serve ``records`` with one engine (per-record sampling settings are runtime values);
    returns how many finished."""
    from tqdm import tqdm

    from jspec.engine import Engine, Request
    from jspec.sampling import SamplingConfig, is_greedy

    bar = tqdm(total=len(records), unit="req", disable=args.no_progress or None,
               file=sys.stderr, dynamic_ncols=True)
    finished, tokens, accepted, t0 = 0, 0, [], time.perf_counter()
    try:
        if not records:
            return 0
        # The flags are the defaults; sampling is compiled in only when some record samples.
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p,
                                  per_request=any(not is_greedy(t, k) for t, k, _ in
                                                  (r.sampling for r in records)))
        eng = Engine(target, drafter, slots=args.slots,
                     spec=spec if args.policy == "fixed" and drafter is not None else None,
                     policy="auto" if args.policy == "auto" and drafter is not None else None,
                     sampling=sampling, max_new_tokens=max(1, max(r.max_new for r in records)),
                     longest_prompt=max(len(r.ids) for r in records), chunk=args.chunk,
                     kernels=args.kernels, prefill_chunk=args.prefill_chunk)
        by_index = dict(enumerate(records))
        reqs = [Request(r.ids, r.max_new, seed=r.seed, stop_ids=r.stop, id=r.id,
                        temperature=r.sampling[0], top_k=r.sampling[1], top_p=r.sampling[2],
                        response_format=r.response_format)
                for r in records]
        for d in eng.stream(reqs, order="longest"):
            if d.done:
                c, r = d.completion, by_index[d.index]
                s = c.stats
                write({"id": r.id, "line": r.line, "text": c.text, "token_ids": c.tokens,
                       "new_tokens": s["new_tokens"],
                       "mean_accept_len": s.get("mean_accept_len", 1.0),
                       "iterations": s["iterations"], "stop_reason": s["stop_reason"],
                       "latency_s": round(s["latency_s"], 4)})
                finished += 1
                tokens += s["new_tokens"]
                accepted.append(s.get("mean_accept_len", 1.0))
                bar.update(1)
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}",
                                accept=f"{sum(accepted) / len(accepted):.2f}")
            if stop.requested:
                return finished
    finally:
        bar.close()
    return finished


def merge(parts: list[Path], out: Path) -> None:
    """Whole lines of every part, in part order, into ``out`` (a temporary file, renamed)."""
    with atomic.atomic_open(out) as f:
        for p in parts:
            read_done(p)                        # drops a cut last line
            f.write(p.read_text(encoding="utf-8"))
