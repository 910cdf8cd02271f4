"""``python -m jspec.bench phases``: where a speculative iteration's time goes, kernel by
kernel, inside the compiled loop (no host round trips, unlike ``generate(profile=True)``).

It runs plain and speculative ``generate`` once to compile and once under ``jax.profiler``,
reads each executed kernel's duration from the trace, and attributes it to a phase through
the op metadata of the optimized HLO (XLA's dump): ``draft``, ``verify``, ``walk``,
``commit``, ``extend`` (the named scopes of :meth:`SpecDecoder.iterate`), the rest of the
loop body (``emit``/bookkeeping), and the one-off prefill. Times are per verify pass (per
token for plain decoding) and relative to one plain decode step ``t_1``.

    python -m jspec.bench phases --random-config deep16 --drafter mtp --spec 3,1,4 --forced-accept 3
    python -m jspec.bench phases --model checkpoints/default --drafter checkpoints/default/drafters/eagle3

XLA_FLAGS must be settable before JAX starts its backend, so run it as its own process.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from jspec.bench.registry import Command, run_module

PHASES = ("draft", "verify", "walk", "commit", "extend")
CONTROL_FLOW = re.compile(r"^(while|conditional|call)(\.\d+)?$")


def add_args(p) -> None:
    p.add_argument("--model", default=None, help="a target checkpoint (default: --random-config)")
    p.add_argument("--random-config", default="deep16")
    p.add_argument("--drafter", default="mtp", help="a drafter checkpoint, or a kind for random "
                   "weights (eagle1, eagle3, mtp, medusa)")
    p.add_argument("--spec", default=None, metavar="S,K,N")
    p.add_argument("--forced-accept", type=float, default=0.0,
                   help="force this mean accept length (random drafters accept ~1 otherwise)")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", default=None)


def _phase(op_name: str) -> str:
    parts = op_name.split("/")
    phase = next((p for p in PHASES if p in parts), None)
    if phase is None:
        phase = "loop other" if "while" in parts else "prefill/setup"
    return phase


INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")


def op_phases(hlo_text: str) -> dict[str, str]:
    """Instruction name -> phase, from the ``op_name`` metadata of an optimized HLO module.

    Fusions and library calls carry their metadata on the instructions they call, and some
    rewritten instructions (dots) carry none: those take their called computation's first
    ``op_name``, else their first operand's phase."""
    comp_ops: dict[str, str] = {}
    instrs: list[tuple[str, str]] = []
    cur = None
    for line in hlo_text.splitlines():
        m = COMP.match(line)
        if m:
            cur = m.group(1)
            continue
        m = INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        instrs.append((name, rest))
        op = re.search(r'op_name="([^"]*)"', rest)
        if op and cur is not None:
            comp_ops.setdefault(cur, op.group(1))
    out: dict[str, str] = {}
    for name, rest in instrs:
        op = re.search(r'op_name="([^"]*)"', rest)
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if op:
            out[name] = _phase(op.group(1))
        elif called and called.group(1) in comp_ops:
            out[name] = _phase(comp_ops[called.group(1)])
    for name, rest in instrs:                        # operands are defined before their users
        if name not in out:
            args = re.search(r"\w\((.*?)\)", rest)
            for operand in re.findall(r"%([\w.\-]+)", args.group(1) if args else ""):
                if operand in out:
                    out[name] = out[operand]
                    break
    return out


def kernel_times(trace_dir: str, module: str) -> dict[str, list[float]]:
    """hlo_op -> durations (us) of ``module``'s kernels in the newest trace under ``trace_dir``."""
    f = sorted(glob.glob(f"{trace_dir}/**/*.json.gz", recursive=True))[-1]
    ev = json.load(gzip.open(f))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    out = collections.defaultdict(list)
    for e in ev:
        a = e.get("args") or {}
        if e.get("ph") == "X" and a.get("hlo_module") == module and "hlo_op" in a:
            out[a["hlo_op"]].append(float(e.get("dur", 0.0)))
    return out


def _newest_module(dump: str, before: set) -> str:
    new = [f for f in glob.glob(f"{dump}/*jit_run*after_optimizations.txt") if f not in before]
    if len(new) != 1:
        raise RuntimeError(f"expected one new jit_run module in {dump}, found {len(new)}")
    return new[0]


def profile_call(gen, dump: str, **kw):
    """Compile and run ``gen(**kw)``, then run it again under the profiler; returns
    (result, {phase: [kernels, us]})."""
    import jax
    before = set(glob.glob(f"{dump}/*"))
    gen(**kw)
    phases = op_phases(Path(_newest_module(dump, before)).read_text())
    tdir = tempfile.mkdtemp(prefix="jspec-trace-")
    jax.profiler.start_trace(tdir, create_perfetto_trace=True)
    res = gen(**kw)
    jax.profiler.stop_trace()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for op, durs in kernel_times(tdir, "jit_run").items():
        if CONTROL_FLOW.match(op):          # its time is its body's kernels, counted already
            continue
        ph = phases.get(op, "loop other")
        agg[ph][0] += len(durs)
        agg[ph][1] += sum(durs)
    return res, dict(agg)


def main(a) -> int:
    dump = tempfile.mkdtemp(prefix="jspec-hlo-")
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                               "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_run").strip()
    import functools

    import jax

    import jspec
    from jspec.bench.configs import random_config
    from jspec.drafters import load_drafter, random_drafter
    from jspec.llama import init_params
    from jspec.spec_config import SpecConfig
    from jspec.target import Target

    if a.model:
        target = jspec.load_target(a.model)
        prompt = [a.prompt] if target.tokenizer else [[0, 5, 7, 9, 11]]
    else:
        cfg = random_config(a.random_config)
        target = Target(cfg, init_params(cfg, jax.random.key(0)), None)
        prompt = [[0, 5, 7, 9, 11]]
    if Path(a.drafter).is_dir():
        drafter = load_drafter(a.drafter, target.config)
    else:
        drafter = random_drafter(a.drafter, target.config)
    spec = SpecConfig(*map(int, a.spec.split(","))) if a.spec else drafter.default_spec
    gen = functools.partial(jspec.generate, target, prompt, max_new_tokens=a.new_tokens)

    plain, pp = profile_call(gen, dump)
    steps = len(plain.tokens[0]) - 1                       # the prefill emits the first token
    res, sp = profile_call(gen, dump, drafter=drafter, spec=spec, forced_accept=a.forced_accept)
    iters = res.stats[0]["iterations"]
    plain_step = pp.get("loop other", [0, 0.0])       # the decode loop is plain's whole loop
    t1 = plain_step[1] / steps
    loop_phases = [(ph, sp.get(ph, [0, 0.0])) for ph in (*PHASES, "loop other")]
    rows = [("plain decode step", plain_step, steps)] + [(ph, v, iters) for ph, v in loop_phases]
    print(f"config: {a.model or a.random_config}, drafter {drafter.kind}, spec "
          f"{None if spec is None else (spec.num_steps, spec.topk, spec.num_draft_tokens)}, "
          f"forced accept {a.forced_accept or 'off'}, {a.new_tokens} new tokens, batch 1, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"plain: {steps} decode steps; speculative: {iters} verify passes, accept length "
          f"{res.stats[0]['mean_accept_len']:.2f}\n")
    print(f"{'phase':<18} {'kernels':>8} {'ms':>8} {'x t_1':>7}")
    print(f"{'-' * 18} {'-' * 8} {'-' * 8} {'-' * 7}")
    out = []
    for name, (k, us), n in rows:
        out.append({"phase": name, "kernels": k / n, "ms": us / n / 1e3, "x_t1": us / n / t1})
        print(f"{name:<18} {k / n:>8.1f} {us / n / 1e3:>8.3f} {us / n / t1:>7.3f}")
    loop_kernels = sum(k for _, (k, _) in loop_phases) / iters
    loop = sum(us for _, (_, us) in loop_phases) / iters
    print(f"{'iteration (sum)':<18} {loop_kernels:>8.1f} {loop / 1e3:>8.3f} {loop / t1:>7.3f}")
    print(f"\nkernel time only (gaps between kernels are not in it); per verify pass for the "
          f"phases, per token for the plain step. Breakeven accept length: {loop / t1:.2f}.")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


COMMAND = Command("phases", "kernel time per phase of the compiled speculative loop (jax.profiler "
                            "trace, XLA's HLO dump)", add_args, main)

if __name__ == "__main__":
    sys.exit(run_module(COMMAND))
