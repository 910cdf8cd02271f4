"""``python -m jspec.bench peers``: jspec, llama.cpp and transformers on the same GGUF, the same
prompts and the same machine, in one run.

Every system gets the same prompt token ids (jspec's rendering of each conversation with the
model's chat template), the same ``--max-new-tokens`` and the same stop id (the template's end
of turn, ``<|im_end|>`` for SmolLM2), and decodes greedily at batch 1:

* **jspec** (the GGUF dequantized, ``--dtype``, default float32): plain ``generate``, and
  speculative ``generate`` with each ``--drafter NAME=SPEC[@S,K,N]`` (default ``ngram=ngram``,
  jspec's prompt lookup, as a chain of 4, plus every checkpoint shipped under
  ``checkpoints/MODEL/drafters/`` when ``--model`` is a fetchable name).
* **llama.cpp** through ``llama-cpp-python`` (the Q4_1 blocks as stored, decoded natively):
  plain ``Llama.generate`` at top-k 1, and its prompt lookup (``LlamaPromptLookupDecoding``
  with ``num_pred_tokens`` = each ``--lookup-tokens``). Every call starts from an empty KV
  cache (``Llama.reset``), so no call reuses another's prefill.
* **transformers** (``from_pretrained(gguf_file=...)``, dequantized to float32): plain greedy
  ``generate``, and its prompt lookup (``prompt_lookup_num_tokens`` = each ``--lookup-tokens``).

A peer that is not installed is skipped with a one-line note. Timing: for each prompt, every
mode of every system runs once untimed (compilation, caches), then ``--repeats`` rounds of one
call each, round-robin (:func:`jspec.timing.round_robin`), so machine noise hits all alike; a
mode's time on a prompt is its best call. A call's time is the whole call (prefill included).

Columns:
  system, mode   ``plain``, ``lookup K=..`` (a peer's prompt lookup), or a jspec drafter
                 name with its tree ``S,K,N``
  tok/s          generated tokens over all prompts / the sum of the best times (batch 1)
  x own plain    tok/s over the same system's plain tok/s
  accept len     generated tokens / target forward passes (prefill included, as jspec's
                 ``mean_accept_len`` counts them): jspec from its stats, llama.cpp by counting
                 ``Llama.eval`` calls, transformers by counting the model's forward calls
                 (plain = 1.00)
  tokens         generated tokens over all prompts (a stop id, when hit, included)
  = own plain    prompts whose tokens equal the same system's plain tokens ("yes 6/6")
  = jspec plain  prompts whose tokens equal jspec plain's (cross-system agreement; llama.cpp
                 computes in Q4_1 x Q8 integer dot products, so it may differ)

A second table gives tok/s per prompt category (the held-out set's chat / code /
summarization / editing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable, Sequence

from jspec.bench.registry import Command, run_module

PEERS = ("jspec", "llamacpp", "transformers")
COLUMNS = ["system", "mode", "tok/s", "x own plain", "accept len", "tokens", "= own plain",
           "= jspec plain"]
DEFAULT_PROMPTS = "checkpoints/{model}/prompts/heldout.json"
DEFAULT_DRAFTERS = ["ngram=ngram"]
REPO = Path(__file__).resolve().parents[1]


class PeerMissing(Exception):
    """A peer that cannot run here (not installed, or failed to load): skipped, with a note."""


@dataclasses.dataclass
class Out:
    """One call's result: the generated ids (a stop id, when hit, included), the seconds the
    call took, and the target forward passes it made (None: unknown)."""
    tokens: list[int]
    seconds: float
    passes: int | None = None


@dataclasses.dataclass
class Mode:
    system: str
    mode: str
    run: Callable[[list[int]], Out]      # prompt ids -> Out
    plain: bool = False

    @property
    def key(self) -> str:
        return f"{self.system}/{self.mode}"


def trim(tokens: Sequence[int], stop: Sequence[int], limit: int) -> list[int]:
    """``tokens`` up to and including the first stop id, at most ``limit`` of them."""
    out = []
    for t in list(tokens)[:limit]:
        out.append(int(t))
        if int(t) in stop:
            break
    return out


# --------------------------------------------------------------------------- prompts
def load_prompts(path: str | os.PathLike) -> list[tuple[str, list[dict]]]:
    """``[(category, messages)]`` from a JSON list of conversations (each a list of messages,
    or a string: one user message), with categories from ``STEM_categories.json`` beside it
    (``-`` when there is none)."""
    path = Path(path)
    convs = json.loads(path.read_text())
    cats_file = path.with_name(f"{path.stem}_categories.json")
    cats = json.loads(cats_file.read_text()) if cats_file.is_file() else ["-"] * len(convs)
    if len(cats) != len(convs):
        raise ValueError(f"{cats_file}: {len(cats)} categories for {len(convs)} prompts")
    out = []
    for c, conv in zip(cats, convs):
        if isinstance(conv, str):
            conv = [{"role": "user", "content": conv}]
        out.append((str(c), conv))
    return out


def pick(prompts: list, limit: int | None, categories: Sequence[str] | None = None) -> list:
    """At most ``limit`` prompts (None: all) of ``categories`` (None: all), spread over the
    categories: the first of each category in order of first appearance, then the second of
    each, and so on. Returns ``[(index in the file, category, messages)]``."""
    rows = [(i, c, m) for i, (c, m) in enumerate(prompts)
            if not categories or c in categories]
    order = list(dict.fromkeys(c for _, c, _ in rows))
    by_cat = {c: [r for r in rows if r[1] == c] for c in order}
    spread = []
    for j in range(max((len(v) for v in by_cat.values()), default=0)):
        spread += [by_cat[c][j] for c in order if j < len(by_cat[c])]
    return spread if limit is None else spread[:limit]


# --------------------------------------------------------------------------- jspec
def parse_drafter_arg(text: str) -> tuple[str, str, str | None]:
    """``NAME=SPEC[@S,K,N[/cal]|@auto]`` -> ``(name, spec, tree)``; a bare ``SPEC`` is named
    after its kind (``ngram``) or its directory."""
    name, eq, rest = text.partition("=")
    if not eq:
        name, rest = "", text
    spec, _, tree = rest.partition("@")
    if not name:
        name = Path(spec).name if ("/" in spec or os.sep in spec) else spec.split(":")[0]
    if not spec:
        raise ValueError(f"--drafter wants NAME=SPEC[@S,K,N], got {text!r}")
    return name, spec, tree or None


def shipped_drafters(model: str) -> list[str]:
    """``NAME=DIR`` for each drafter checkpoint shipped under ``checkpoints/MODEL/drafters``."""
    d = REPO / "checkpoints" / model / "drafters"
    if not d.is_dir():
        return []
    return [f"{p.name}={p}" for p in sorted(d.iterdir()) if p.is_dir() and any(p.iterdir())]


def jspec_modes(target, drafters: Sequence[str], max_new: int,
                stop: Sequence[int], system: str = "jspec") -> list[Mode]:
    """jspec plain and speculative ``generate`` with each ``NAME=SPEC[@S,K,N]`` drafter."""
    import jspec
    from jspec.args import load_drafter_arg
    from jspec.spec_config import parse_spec, spec_label

    def call(drafter=None, spec=None):
        def run(ids):
            r = jspec.generate(target, [ids], max_new_tokens=max_new, stop_ids=list(stop),
                               drafter=drafter, spec=spec)
            st = r.stats[0]
            return Out(trim(r.tokens[0], stop, max_new), r.wall_s, st.get("iterations"))
        return run

    modes = [Mode(system, "plain", call(), plain=True)]
    for text in drafters:
        name, spec_arg, tree = parse_drafter_arg(text)
        d = load_drafter_arg(spec_arg, target)
        spec = "auto" if tree == "auto" else parse_spec(tree) if tree else d.default_spec
        label = spec if isinstance(spec, str) else spec_label(spec) if spec else "default"
        modes.append(Mode(system, f"{name} {label}", call(d, spec)))
    return modes


# --------------------------------------------------------------------------- transformers
def transformers_load(path: str, threads: int):
    """The GGUF through ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` in float32."""
    try:
        import torch
        import transformers
    except Exception as e:
        raise PeerMissing(f"transformers not importable ({type(e).__name__}: {e}); install "
                          f"jspec[hf]") from None
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    p = Path(path)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    except Exception as e:
        raise PeerMissing(f"transformers could not load {p.name} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return model


def transformers_modes(model, max_new: int, stop: Sequence[int],
                       lookup: Sequence[int]) -> list[Mode]:
    """transformers plain greedy ``generate`` and its prompt lookup (one mode per K), a
    forward hook counting the target's passes."""
    import torch
    import transformers
    passes = [0]
    model.register_forward_pre_hook(lambda *a: passes.__setitem__(0, passes[0] + 1))

    def call(k=None):
        gc = transformers.GenerationConfig(
            do_sample=False, num_beams=1, max_new_tokens=max_new, eos_token_id=list(stop),
            pad_token_id=int(stop[0]) if stop else 0, prompt_lookup_num_tokens=k)

        def run(ids):
            x = torch.tensor([ids], dtype=torch.long)
            passes[0] = 0
            t0 = time.perf_counter()
            with torch.inference_mode():
                y = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                   generation_config=gc)
            dt = time.perf_counter() - t0
            return Out(trim(y[0, x.shape[1]:].tolist(), stop, max_new), dt, passes[0])
        return run

    return [Mode("transformers", "plain", call(), plain=True)] + [
        Mode("transformers", f"lookup K={k}", call(k)) for k in lookup]


# --------------------------------------------------------------------------- llama.cpp
def llamacpp_load(path: str, threads: int, n_ctx: int, lookup: Sequence[int]) -> dict:
    """``{mode: Llama}``: one plain ``Llama`` and one per prompt-lookup K (the draft model is
    fixed at construction)."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except Exception as e:
        raise PeerMissing(f"llama_cpp not importable ({type(e).__name__}: {e}); "
                          f"pip install llama-cpp-python") from None
    kw = dict(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
              n_batch=512, verbose=False, logits_all=False)
    try:
        llms = {"plain": Llama(**kw)}
        for k in lookup:
            llms[f"lookup K={k}"] = Llama(
                **kw, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))
    except Exception as e:
        raise PeerMissing(f"llama.cpp could not load {Path(path).name} ({type(e).__name__}: "
                          f"{e})") from None
    return llms


def llamacpp_modes(llms: dict, max_new: int, stop: Sequence[int]) -> list[Mode]:
    """llama.cpp greedy ``Llama.generate`` (top-k 1, no penalties) per loaded ``Llama``, from an
    empty cache each call; passes counted as ``Llama.eval`` calls."""
    def call(llm):
        passes = [0]
        inner = llm.eval

        def counting_eval(tokens):
            passes[0] += 1
            return inner(tokens)
        llm.eval = counting_eval

        def run(ids):
            passes[0] = 0
            t0 = time.perf_counter()
            llm.reset()
            out = []
            for t in llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0,
                                  temp=0.0, repeat_penalty=1.0, reset=True):
                out.append(int(t))
                if int(t) in stop or len(out) >= max_new:
                    break
            dt = time.perf_counter() - t0
            return Out(out, dt, passes[0])
        return run

    return [Mode("llamacpp", name, call(llm), plain=name == "plain") for name, llm in llms.items()]


# --------------------------------------------------------------------------- the run
def measure(modes: Sequence[Mode], prompts: Sequence[tuple], repeats: int,
            log: Callable[[str], None] = print) -> list[dict]:
    """Per prompt ``(index, category, ids)``: every mode warm, then ``repeats`` round-robin
    rounds. ``[{"index", "category", "prompt_len", "modes": {key: {"tokens", "seconds",
    "passes"}}}]``, seconds the best call's."""
    from jspec.timing import round_robin
    records = []
    for n, (index, category, ids) in enumerate(prompts):
        calls = {m.key: (lambda m=m: m.run(ids)) for m in modes}
        timed = round_robin(calls, repeats, seconds=lambda r, _: r.seconds)
        rec = {"index": index, "category": category, "prompt_len": len(ids), "modes": {}}
        for key, t in timed.items():
            r = t.result
            rec["modes"][key] = {"tokens": r.tokens, "seconds": t.best, "passes": r.passes}
        records.append(rec)
        plain = rec["modes"][modes[0].key] if modes else None
        log(f"  prompt {n + 1}/{len(prompts)} (#{index}, {category}, {len(ids)} ids): "
            + ", ".join(f"{k} {len(v['tokens']) / v['seconds']:.1f}"
                        for k, v in rec["modes"].items()) + " tok/s"
            + (f" [{len(plain['tokens'])} tokens]" if plain else ""))
    return records


def summarize(modes: Sequence[Mode], records: Sequence[dict]) -> list[dict]:
    """One row per mode over all ``records`` (see the module docstring's columns)."""
    plain_of = {m.system: m.key for m in modes if m.plain}
    # The first jspec system's plain decoding (with --mode, each mode is a system of its own).
    jplain = next((k for sys_, k in plain_of.items() if sys_.startswith("jspec")), None)
    n = len(records)
    rows = []
    for m in modes:
        runs = [r["modes"][m.key] for r in records]
        tokens = sum(len(x["tokens"]) for x in runs)
        secs = sum(x["seconds"] for x in runs)
        passes = [x["passes"] for x in runs]
        row = {"system": m.system, "mode": m.mode, "tokens": tokens,
               "tok/s": tokens / secs if secs > 0 else float("nan"),
               "accept len": (tokens / sum(passes)
                              if passes and None not in passes and sum(passes) else None)}
        for col, ref in (("= own plain", plain_of.get(m.system)), ("= jspec plain", jplain)):
            if ref is None:
                continue
            same = sum(r["modes"][m.key]["tokens"] == r["modes"][ref]["tokens"] for r in records)
            row[col] = f"{'yes' if same == n else 'no'} {same}/{n}"
            row[col.replace("= ", "equal_").replace(" ", "_")] = same
        rows.append(row)
    plain_tps = {r["system"]: r["tok/s"] for m, r in zip(modes, rows) if m.plain}
    for row in rows:
        if row["system"] in plain_tps:
            row["x own plain"] = row["tok/s"] / plain_tps[row["system"]]
    return rows


def by_category(modes: Sequence[Mode], records: Sequence[dict]) -> tuple[list[str], list[dict]]:
    """tok/s per mode and prompt category: ``(columns, rows)``."""
    cats = list(dict.fromkeys(r["category"] for r in records))
    rows = []
    for m in modes:
        row = {"system": m.system, "mode": m.mode}
        for c in cats:
            runs = [r["modes"][m.key] for r in records if r["category"] == c]
            secs = sum(x["seconds"] for x in runs)
            row[c] = sum(len(x["tokens"]) for x in runs) / secs if secs else None
        rows.append(row)
    return ["system", "mode"] + cats, rows


def busy_note(threads: int, threshold: float = 1.0) -> str | None:
    """A warning when other processes load the machine: llama.cpp's and torch's threads wait
    for each other at spinning barriers, so with ``--threads`` = cores and any other process
    running, their figures collapse (llama.cpp plain measured 0.7 tok/s beside a background
    job on this 2-core machine, 116 tok/s on it idle), far more than jspec's."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return None
    if load < threshold:
        return None
    return (f"the 1-minute load average is {load:.1f}: llama.cpp and torch spin at barriers "
            f"across {threads} threads and slow down many times beside other "
            f"processes; compare systems on an idle machine (or lower --threads)")


# --------------------------------------------------------------------------- command
def add_args(s) -> None:
    s.add_argument("--model", default="smollm2",
                   help="a fetchable name or a .gguf path (default: smollm2)")
    s.add_argument("--prompts", default=None,
                   help="JSON list of conversations (default: checkpoints/MODEL/prompts/"
                        "heldout.json; categories from its _categories.json)")
    s.add_argument("--limit", type=int, default=12,
                   help="prompts, spread over the categories (default 12; 0: all)")
    s.add_argument("--category", action="append", default=None,
                   help="only prompts of this category (repeatable; e.g. chat)")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=2,
                   help="timed round-robin rounds per prompt after one warm-up (best is kept)")
    s.add_argument("--drafter", action="append", default=None, metavar="NAME=SPEC[@S,K,N]",
                   help="a jspec drafter (repeatable): a checkpoint directory, ngram[:MIN:MAX], "
                        "random:KIND, ...; @S,K,N[/cal] or @auto picks its tree (default: "
                        "ngram=ngram, plus the checkpoints under checkpoints/MODEL/drafters)")
    s.add_argument("--lookup-tokens", type=int, nargs="+", default=[4], metavar="K",
                   help="the peers' prompt-lookup draft lengths, one mode each (default 4, as "
                        "jspec's ngram chain)")
    s.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS,
                   help="systems to run (default: all three)")
    s.add_argument("--dtype", default="float32", help="jspec's weight dtype (default float32)")
    s.add_argument("--mode", action="append", default=None,
                   help="jspec weight modes instead of --dtype, each its own system row "
                        "(repeatable; benchmarks.quant.MODES: fp32 bf16w int8 int8/ch+head ...)")
    s.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="llama.cpp and torch threads (default: every core)")
    s.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp context (default 2048; "
                   "raised to fit the longest prompt + max-new-tokens)")
    s.add_argument("--json", metavar="OUT", help="also write the rows and per-prompt results")


def main(a) -> dict:
    import jspec
    from jspec import messages
    from jspec.bench import common
    from jspec.fetch import resolve_model

    if a.max_new_tokens < 1 or a.repeats < 1:
        raise SystemExit("--max-new-tokens and --repeats must be >= 1")
    path = str(resolve_model(a.model))
    model_name = a.model if not Path(a.model).exists() else Path(a.model).stem
    from benchmarks.quant import check_modes, load_mode
    check_modes(a.mode or [])
    targets = ({f"jspec {m}": load_mode(path, m)[0] for m in a.mode} if a.mode
               else {"jspec": jspec.load_target(path, dtype=a.dtype)})
    target = next(iter(targets.values()))
    stop = list(messages.stop_ids(target) or [])
    prompts_file = a.prompts or str(REPO / DEFAULT_PROMPTS.format(model=a.model))
    chosen = pick(load_prompts(prompts_file), a.limit or None, a.category)
    if not chosen:
        raise SystemExit(f"no prompts in {prompts_file} for categories {a.category}")
    prompts = [(i, c, messages.render(target, m)) for i, c, m in chosen]
    drafters = a.drafter if a.drafter is not None else (
        DEFAULT_DRAFTERS + shipped_drafters(a.model))

    notes, modes = [], []
    if "jspec" in a.peers:
        for system, t in targets.items():
            modes += jspec_modes(t, drafters, a.max_new_tokens, stop, system)
    if "llamacpp" in a.peers:
        n_ctx = max(a.n_ctx, max(len(p[2]) for p in prompts) + a.max_new_tokens + 32)
        try:
            modes += llamacpp_modes(llamacpp_load(path, a.threads, n_ctx, a.lookup_tokens),
                                    a.max_new_tokens, stop)
        except PeerMissing as e:
            notes.append(f"llamacpp skipped: {e}")
    if "transformers" in a.peers:
        try:
            modes += transformers_modes(transformers_load(path, a.threads), a.max_new_tokens,
                                        stop, a.lookup_tokens)
        except PeerMissing as e:
            notes.append(f"transformers skipped: {e}")
    busy = busy_note(a.threads) if {"llamacpp", "transformers"} & set(a.peers) else None
    if busy:
        notes.append(busy)
    for n in notes:
        print(f"note: {n}")
    if not modes:
        raise SystemExit("no system to run")

    cats = ", ".join(f"{c} {sum(p[1] == c for p in prompts)}"
                     for c in dict.fromkeys(p[1] for p in prompts))
    print(f"peers on {Path(path).name}: {len(prompts)} prompts ({cats}) from {prompts_file}, "
          f"batch 1, greedy, max {a.max_new_tokens} new tokens, stop {stop}, best of "
          f"{a.repeats} after a warm-up, round-robin per prompt; load avg {common.load_avg()}")
    records = measure(modes, prompts, a.repeats)
    rows = summarize(modes, records)
    print(f"\n{len(prompts)} prompts, {a.max_new_tokens} new tokens max, threads {a.threads}, "
          f"load avg {common.load_avg()}:")
    print(common.format_table(rows, COLUMNS))
    cat_cols, cat_rows = by_category(modes, records)
    if len(cat_cols) > 3:
        print("\ntok/s by category:")
        print(common.format_table(cat_rows, cat_cols))
    payload = {"model": path, "model_name": model_name, "prompts_file": prompts_file,
               "max_new_tokens": a.max_new_tokens, "repeats": a.repeats,
               "threads": a.threads, "stop_ids": stop, "notes": notes, "columns": COLUMNS,
               "rows": rows, "by_category": cat_rows, "records": records}
    if a.json:
        common.write_json(a.json, payload)
    return payload


COMMAND = Command("peers", "jspec vs llama.cpp vs transformers on the same GGUF and prompts: "
                  "tok/s at batch 1, accept length, tokens equal to plain", add_args, main,
                  description=__doc__)

if __name__ == "__main__":
    run_module(COMMAND)
