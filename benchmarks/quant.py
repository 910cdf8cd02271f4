"""Quantized targets on SmolLM2 (or any chat model): per mode against the float target, on
held-out chat prompts, in one run.

* quality: greedy agreement (the fp32 target's greedy tokens, teacher-forced, and how many of
  them are also each mode's argmax) and the mean KL(fp32 || mode) of the next-token
  distribution over the same positions;
* weight bytes held and load time (a GGUF's Q8_0/Q4_0 blocks kept, other types requantized);
* plain and EAGLE-3 (4,1,5)-chain tok/s at batch 1 and 8, every (mode, batch, method) timed
  round-robin in one run. Without ``--drafter`` the EAGLE-3 head is random with its accept
  length forced to 3 (what each mode's verify and draft steps cost); with a trained head's
  directory, its real accept length against each target, and whether the tokens equal that
  target's own plain output; where a row parts, how near a tie the two tokens were there;
* the target's weight bytes read per token (a step reads every weight once: the weights over
  the batch, and over the accept length when speculating).

``python -m jspec.bench quant --model smollm2 --limit 4 --max-new-tokens 48``
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.registry import Command, run_module

# bf16: load_target(dtype="bfloat16") (weights and activations); bf16w: quantize="bf16" (bf16
# weights, fp32 activations). From a GGUF, int8 and w8a8 keep the file's 32-input blocks
# (Q4_1 requantized to int8 per 32 inputs); "/ch" quantizes the fp32 weights per output channel
# instead, "+head" quantizes the LM head too (QuantConfig(lm_head=True)).
MODES = ("fp32", "bf16", "bf16w", "int8", "int8/ch", "int8/ch+head", "w8a8", "w8a8/ch",
         "w8a8/ch+head", "fp8")


def add_args(s) -> None:
    s.add_argument("--model", default="smollm2")
    s.add_argument("--prompts", default="checkpoints/smollm2/prompts/heldout.json")
    s.add_argument("--limit", type=int, default=4)
    s.add_argument("--max-new-tokens", type=int, default=48)
    s.add_argument("--modes", default=",".join(MODES))
    s.add_argument("--drafter", default=None, help="a trained EAGLE-3 head's directory (default: "
                   "a random head with its accept length forced to 3, which times the costs)")
    s.add_argument("--batches", default="1,8")
    s.add_argument("--gguf", action="store_true",
                   help="also: the GGUF's Q4_1 and a Q8_0 re-encoding kept quantized (load s, "
                        "resident bytes, logits against fp32)")
    s.add_argument("--repeats", type=int, default=2)


def check_modes(modes) -> None:
    """Unknown modes fail here, before any weight is read."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {', '.join(bad)}: expected {', '.join(MODES)}")


def load_mode(path, mode):
    """A target in one of :data:`MODES`, its load seconds and its serving weights' bytes."""
    import jspec
    check_modes([mode])
    t0 = time.perf_counter()
    if mode in ("fp32", "bf16"):
        t = jspec.load_target(path, dtype="float32" if mode == "fp32" else "bfloat16")
    else:
        from jspec.checkpoint.quantize import quantize_target
        from jspec.quant import QuantConfig
        base, head = mode.removesuffix("+head"), mode.endswith("+head")
        qc = QuantConfig({"bf16w": "bf16"}.get(base, base.removesuffix("/ch")), lm_head=head)
        t = (quantize_target(jspec.load_target(path), qc) if base.endswith("/ch")
             else jspec.load_target(path, quantize=qc))
    params = t.serving_params
    jax.block_until_ready(params)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    return t, time.perf_counter() - t0, nbytes


def next_logprobs(target, ids):
    """``[len(ids), V]``: log-softmax of the logits at every position of one teacher-forced pass."""
    from jspec import kv_cache as kvc
    from jspec.llama import forward, logits
    c, P = target.config, target.serving_params
    T = len(ids)
    pages = -(-T // 16)
    cache = kvc.init_cache(c.num_layers, c.num_kv_heads, c.head_dim,
                           jnp.arange(pages, dtype=jnp.int32)[None], pages, 16, c.dtype)
    h, _, _ = forward(c, P, jnp.asarray([ids]), jnp.arange(T)[None], cache)
    return np.asarray(jax.nn.log_softmax(logits(c, P, h)[0], -1), np.float64)


def quality(base, targets, prompts, max_new) -> dict:
    """Per mode: greedy agreement with fp32's greedy tokens (teacher-forced) and mean KL."""
    import jspec
    ref = jspec.generate(base, prompts, max_new_tokens=max_new)
    seqs = [p + t for p, t in zip(prompts, ref.tokens)]
    ref_lp = [next_logprobs(base, s) for s in seqs]
    out = {}
    for mode, t in targets.items():
        agree, kl, n = 0, 0.0, 0
        for p, s, lr in zip(prompts, seqs, ref_lp):
            lq = next_logprobs(t, s)
            pos = slice(len(p) - 1, len(s) - 1)
            agree += int((lq[pos].argmax(-1) == np.asarray(s[len(p):])).sum())
            kl += float((np.exp(lr[pos]) * (lr[pos] - lq[pos])).sum())
            n += len(s) - len(p)
        out[mode] = {"greedy_agree": agree / n, "mean_KL": kl / n}
    return out


def speed(targets, prompts, max_new, drafter, batches, repeats) -> dict:
    """tok/s per (mode, batch, plain | EAGLE-3), all timed round-robin in one run; EAGLE-3 runs
    the (4, 1, 5) chain with its accept length forced to 3 (a random head: the costs, not a
    trained head's acceptance) unless ``drafter`` is a trained head."""
    import jspec
    from jspec.bench.spec_simulate import sim_drafter
    from jspec.spec_config import SpecConfig
    from jspec.timing import round_robin, wall_s
    spec = SpecConfig.chain(4)
    sim = drafter is None
    calls, rows_of = {}, {}
    for mode, t in targets.items():
        d = sim_drafter(t.config) if sim else drafter
        for b in batches:
            rows = [prompts[i % len(prompts)] for i in range(b)]
            gen = lambda t=t, rows=rows, **kw: jspec.generate(
                t, rows, max_new_tokens=max_new, stop_ids=[], **kw)
            calls[mode, b, "plain"] = gen
            rows_of[mode, b] = rows
            calls[mode, b, "eagle3"] = functools.partial(
                gen, drafter=d, spec=spec, **({"forced_accept": 3.0} if sim else {}))
    timed = round_robin(calls, repeats, seconds=wall_s)
    out = {}
    for (mode, b, kind), t in timed.items():
        r = t.result
        out[mode, b, kind] = {"tok_s": b * max_new / t.median,
                              "accept": float(np.mean([s["mean_accept_len"] for s in r.stats]))
                              if kind == "eagle3" else 1.0, "tokens": r.tokens}
    if not sim:       # forced acceptance emits no real tokens to compare
        for mode, t in targets.items():
            for b in batches:
                out[mode, b, "parted"] = partings(t, rows_of[mode, b],
                                                  out[mode, b, "plain"]["tokens"],
                                                  out[mode, b, "eagle3"]["tokens"])
    return out


def first_parting(a, b) -> int | None:
    """The first index where token lists ``a`` and ``b`` differ (the shorter one's end if one
    is a prefix of the other), None where they are equal."""
    k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if k == len(a) == len(b) else k


def partings(target, rows, plain, spec) -> list[dict]:
    """Each row whose speculative tokens leave its plain ones: where, and the gap between the
    two tokens' logprobs there, teacher-forced on the shared prefix by ``target`` (a target that
    is not batch-invariant may part only where that gap is within its rounding: a near-tie)."""
    out = []
    for i, (p, a, b) in enumerate(zip(rows, plain, spec)):
        k = first_parting(a, b)
        if k is None:
            continue
        gap = float("inf")      # one row stopped before the other: no tie to weigh
        if k < min(len(a), len(b)):
            lp = next_logprobs(target, p + a[:k])[-1]
            gap = abs(float(lp[a[k]] - lp[b[k]]))
        out.append({"row": i, "at": k, "gap": gap})
    return out


def equal_cell(parted: list[dict]) -> str:
    """``yes``, or how many rows parted and the widest logprob gap where they did."""
    if not parted:
        return "yes"
    return f"no: {len(parted)} rows, gap <= {max(r['gap'] for r in parted):.3f}"


def q8_copy(src, dst) -> None:
    """``src`` GGUF re-encoded with every Q4_1 tensor as Q8_0 (metadata and other tensors as
    they are): SmolLM2 ships no Q8_0 file, and Q8_0 is the type jspec keeps exactly."""
    import gguf
    Q = gguf.GGMLQuantizationType
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        if t.tensor_type == Q.Q4_1:
            q = gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type), Q.Q8_0)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_rows(path, prompts, seqs) -> list[dict]:
    """Each GGUF type kept quantized (``quantize="int8"``) against the same file dequantized
    to fp32: load time, resident bytes, and the logits' max difference / mean KL."""
    import tempfile
    rows = []
    with tempfile.TemporaryDirectory() as d:
        q8 = Path(d) / "q8_0.gguf"
        q8_copy(path, q8)
        for label, f in (("Q4_1 (shipped)", path), ("Q8_0 (re-encoded)", q8)):
            ref, _, ref_bytes = _load(f, "fp32")
            kept, load_s, nbytes = _load(f, "int8")
            diff, kl, n = 0.0, 0.0, 0
            for p, s in zip(prompts, seqs):
                lr, lq = next_logprobs(ref, s), next_logprobs(kept, s)
                diff = max(diff, float(np.abs(lr - lq).max()))
                kl += float((np.exp(lr) * (lr - lq)).sum())
                n += len(s)
            rows.append({"GGUF": label, "kept as": "int8 per 32 (exact)" if "Q8" in label else
                         "int8 per 32 (requantized)", "load s": load_s,
                         "resident MB": nbytes / 1e6, "fp32 MB": ref_bytes / 1e6,
                         "max |logp diff|": diff, "mean KL": kl / n})
    return rows


def main(a) -> None:
    from jspec import messages
    from jspec.fetch import resolve_model
    path = resolve_model(a.model)
    convs = json.loads(Path(a.prompts).read_text())[:a.limit]
    modes = [m.strip() for m in a.modes.split(",")]
    check_modes(modes)
    loaded = {m: load_mode(path, m) for m in modes}
    targets = {m: v[0] for m, v in loaded.items()}
    base = targets.get("fp32") or load_mode(path, "fp32")[0]
    prompts = [messages.render(base, c) for c in convs]
    drafter = None
    if a.drafter:
        from jspec.args import load_drafter_arg
        drafter = load_drafter_arg(a.drafter, base)
    q = quality(base, targets, prompts, a.max_new_tokens)
    if a.gguf:
        import jspec
        ref = jspec.generate(base, prompts, max_new_tokens=a.max_new_tokens)
        grows = gguf_rows(path, prompts, [p + t for p, t in zip(prompts, ref.tokens)])
    batches = [int(b) for b in a.batches.split(",")]
    sp = speed(targets, prompts, a.max_new_tokens, drafter, batches, a.repeats)
    rows = []
    for m in modes:
        row = {"mode": m, "weights MB": loaded[m][2] / 1e6, "load s": loaded[m][1],
               "greedy agree": q[m]["greedy_agree"], "mean KL": q[m]["mean_KL"]}
        for b in batches:
            pl, e3 = sp[m, b, "plain"], sp[m, b, "eagle3"]
            row[f"plain b{b} tok/s"] = pl["tok_s"]
            row[f"EAGLE-3 b{b} tok/s"] = e3["tok_s"]
            row[f"accept b{b}"] = e3["accept"]
            mb = loaded[m][2] / 1e6 / b
            row[f"MB/tok b{b} plain, EAGLE-3"] = f"{mb:.1f}, {mb / e3['accept']:.1f}"
            if drafter is not None:
                row[f"b{b} = own plain"] = equal_cell(sp[m, b, "parted"])
        rows.append(row)
    from jspec.bench import common
    print(f"{a.model}: {len(prompts)} held-out chat prompts, {a.max_new_tokens} new tokens, "
          f"EAGLE-3 (4,1,5) chain, " + ("head " + a.drafter if drafter is not None else
                                        "random head with accept length forced to 3"))
    print(common.format_table(rows, list(rows[0])))
    if a.gguf:
        print("\nGGUF blocks kept quantized, against the same file dequantized to fp32")
        print(common.format_table(grows, list(grows[0])))


COMMAND = Command("quant", "quantized targets against fp32: greedy agreement, KL, bytes, "
                  "load time, tok/s (and a drafter's accept length)", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
