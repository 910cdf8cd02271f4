"""``python -m jspec.bench device``: the prepared one-accelerator benchmark (one H200, < 8 min).

Run it from the repository root::

    OUT=/path/to/out python -m jspec.bench device           # the GPU run: $OUT/device_bench.json
    OUT=/tmp/out python -m jspec.bench device --smoke       # tiny shapes: a CPU check (< ~60 s)

It prints one summary table (a row per section) and a table per section, and writes one JSON
(``$OUT/device_bench.json``; ``OUT`` defaults to ``./out``) with every section under
``sections.<name>``: ``status`` (``ok``, ``error``, ``timeout``, ``skipped``), ``seconds``,
``error`` / ``reason`` when not ok, and the section's numbers.

Every section runs in its own Python process with its own hard time cap (``CAPS``; the whole
run also stops launching sections at ``--budget`` seconds), so one section that fails,
crashes or overruns records that in the JSON and the rest still run. The processes run one
after the other (timings never overlap); the parent process never touches the accelerator.
This module runs them; the sections themselves are :mod:`benchmarks.device_sections`, their
sizes and shared helpers :mod:`benchmarks.device_setup`.

Sections, at Llama-3-8B shape (``configs.random_config("llama3-8b", "bfloat16")``: random
weights drawn on the device, never on the host), batch 1, 2k-token context, page size 16:

- ``copy``: device copy bandwidth, ``jit(x + 1)`` over a 2 GiB float32 buffer (read + write
  bytes / median time; :func:`benchmarks.kernels.copy_bandwidth`);
- ``plain_decode``: one decode step (a 1-token target forward with logits against the 2k
  cache, as the driver's verify runs it: ``SpecDecoder.verify`` on a 1-node tree) at batch 1
  and 8: ms/step, achieved GB/s (weights read + KV read, over the step time) and the
  bandwidth floor (the same bytes / the ``copy`` bandwidth) with ``floor/ms``;
- ``verify``: ``t_V(N)``, one target forward over N tree nodes (a binary tree, its tree
  mask, positions ``context + depth``) for N in {1, 4, 8, 16, 32, 64}, and ``t_V/t_1``
  (t_1 = N = 1), all timed round-robin;
- ``draft``: the EAGLE-3 draft step cost ``c`` = one tree-loop step of a random EAGLE-3
  drafter with a 32k draft vocabulary (K = 4 frontier nodes, its windowed KV, top-K) / t_1,
  as :func:`jspec.bench.spec_simulate.micro_costs` measures it for the (5, 4, 8) tree (it also
  reports its own t_1 and t_V(8));
- ``e2e``: :func:`jspec.generate` end to end, batch 1, 2k prompt, 128 new tokens, plain vs
  the EAGLE-3 drafter (tree (5, 4, 8)) with ``forced_accept`` = 2, 3, 4: warm tokens/s,
  speed-up over plain, and the cost model's ideal ``E / (t_V(8)/t_1 + S c)`` when the
  ``verify`` and ``draft`` sections ran (:func:`jspec.bench.spec_simulate.ideal_speedup`). The four
  programs are compiled concurrently (threads), then timed round-robin;
- ``kernels``: the Pallas kernels as compiled for the device against their jnp references:
  tree attention (8B attention shape, bf16, N in {1, 8, 64}), the greedy and sampling verify
  walks (V = 128256), what ``kernels="auto"`` resolves to for the 8B shape (and how long the
  probe took), and generate(kernels="pallas") vs "reference" tokens on the tiny model;
- ``hf``: transformers' greedy ``generate`` on the same shape (torch, bf16, random weights,
  ``LlamaForCausalLM`` built on cuda), batch 1, 2k prompt, 128 new tokens: tokens/s (skipped
  with the reason when torch, transformers or CUDA is missing);
- ``pytest``: ``python -m pytest -m "slow or not slow"`` over the kernel test files, with a
  timeout; pass/fail/skip counts and the failing ids. Those tests run the kernels in Pallas
  *interpret* mode (plus cross-lowering checks) whatever the backend; the ``kernels``
  section is the check of the kernels compiled for the device.

Compile budget (on the GPU the layer stack is unrolled, as ``generate`` runs it there:
XLA:GPU copies a scanned layer's weights before each matmul; deviceless H200 compiles of
the 8B plain step and iteration took 6.8 s and 11.1 s on a 2-core host, against 1.9 s and
6.7 s scanned): the verify forward at 6 block widths, the batch-1 and batch-8 steps,
micro_costs' three programs and four ``generate`` programs; within ``plain_decode``,
``verify`` and ``e2e`` they are lowered one by one and compiled in parallel threads. ``--smoke`` shrinks every section (the "tiny" config, 64-token context,
N in {1, 4}, batch 1 and 2, 16 new tokens, a few pytest cases).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from benchmarks.device_sections import WORKERS
from benchmarks.device_setup import Plan, device_info
from jspec.bench.registry import Command, run_module

RESULT_NAME = "device_bench.json"
SECTIONS = ("copy", "plain_decode", "verify", "draft", "e2e", "kernels", "hf", "quant", "pytest")
# Hard caps (seconds, process start included) on the H200 and in --smoke. Sum <= BUDGET.
CAPS = {"copy": 20, "plain_decode": 55, "verify": 75, "draft": 60, "e2e": 110, "kernels": 40,
        "hf": 55, "quant": 40, "pytest": 35}
SMOKE_CAPS = {s: 120 for s in SECTIONS}
BUDGET = 495          # seconds: no section starts after this; < 9 min with start-up margin
SMOKE_BUDGET = 600
KERNEL_TESTS = ["tests/kernels/test_kernel_tree_attention.py",
                "tests/kernels/test_kernel_verify_walk.py", "tests/kernels/test_kernels_e2e.py"]
SMOKE_TESTS = ["tests/kernels/test_kernel_verify_walk.py",
               "-k", "auto_on_cpu or dispatch_under_jit"]


def run_worker(name: str, result_path: str, smoke: bool, ctx: dict) -> int:
    """One section in this process: its result (or error) as JSON at ``result_path``."""
    t0 = time.perf_counter()
    out: dict = {}
    try:
        if name != "hf":
            import jax
            # Random weights, caches and keys only need to be random: the "rbg" generator
            # compiles in a fraction of threefry's time (seconds each on a CPU).
            jax.config.update("jax_default_prng_impl", "rbg")
            out["device"] = device_info()
        data = WORKERS[name](Plan(smoke), ctx)
        out.update(data)
        out.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 - recorded, the parent goes on
        out.update(status="error", error=f"{type(e).__name__}: {e}"[:4000],
                   traceback=traceback.format_exc()[-6000:])
    out["seconds"] = time.perf_counter() - t0
    with open(result_path, "w") as f:
        json.dump(out, f, indent=1, default=_json_default)
    return 0 if out["status"] != "error" else 1


# ====================================================================== pytest
_RESULTS = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
# ``pytest -v`` prints "test PASSED"; under xdist (the project's addopts) "[gw0] [ 50%] PASSED test".
_OUTCOME = re.compile(rf"^(\S+::\S+)\s+({_RESULTS})\b"
                      rf"|^\[gw\d+\]\s+\[\s*\d+%\]\s+({_RESULTS})\s+(\S+::\S+)", re.M)


def pytest_outcomes(text: str) -> list[tuple[str, str]]:
    """``[(test id, outcome)]`` from ``pytest -v`` output, with or without xdist."""
    return [(m[0], m[1]) if m[0] else (m[3], m[2]) for m in _OUTCOME.findall(text)]


def run_pytest(plan: Plan, timeout: float, root: str) -> dict:
    files = SMOKE_TESTS if plan.smoke else KERNEL_TESTS
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "slow or not slow",
           *files]
    t0 = time.perf_counter()
    text, returncode, timed_out = _run_capped(cmd, timeout, root)
    outcomes = pytest_outcomes(text or "")
    counts = {}
    for _, o in outcomes:
        counts[o.lower()] = counts.get(o.lower(), 0) + 1
    failed = [t for t, o in outcomes if o in ("FAILED", "ERROR")]
    out = {"status": "timeout" if timed_out else ("ok" if returncode in (0, 5) and not failed
                                                  else "error"),
           "seconds": time.perf_counter() - t0, "command": " ".join(cmd), "returncode":
           returncode, "counts": counts, "failed": failed[:50],
           "ran": len(outcomes), "tail": (text or "")[-3000:],
           "what": "the kernel test files as they are: Pallas interpret mode + cross-lowering "
                   "(not the kernels compiled for the device; see the kernels section)"}
    if failed and not timed_out:
        out["error"] = f"{len(failed)} failed: {', '.join(failed[:5])}"
    if timed_out:
        out["error"] = f"timed out after {timeout:.0f}s with {len(outcomes)} tests done"
    return out


# ====================================================================== parent
def _json_default(o):
    try:
        import numpy as np
        if isinstance(o, (np.integer, np.floating, np.bool_)):
            return o.item()
    except ImportError:  # pragma: no cover
        pass
    return str(o)


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)      # the worker's own session: it and its children
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _run_capped(cmd, timeout: float, root: str) -> tuple[str, int, bool]:
    """Run ``cmd`` in its own session with stdout+stderr captured; past ``timeout`` seconds
    kill it and its children. Returns ``(output, returncode, timed_out)``."""
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        return proc.communicate(timeout=max(1.0, timeout))[0], proc.returncode, False
    except subprocess.TimeoutExpired:
        _kill(proc)
        return proc.communicate()[0], proc.returncode, True


def _launch(name: str, smoke: bool, ctx: dict, timeout: float, root: str, tmp: str) -> dict:
    path = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, "-m", "jspec.bench", "device", "--worker", name, "--result", path,
           "--context-json", json.dumps(ctx)] + (["--smoke"] if smoke else [])
    t0 = time.perf_counter()
    log, returncode, timed_out = _run_capped(cmd, timeout, root)
    wall = time.perf_counter() - t0
    res = None
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    if res is None:
        res = ({"status": "timeout", "error": f"killed after the {timeout:.0f}s cap"} if timed_out
               else {"status": "error", "error": f"worker exited with code {returncode} "
                                                 "and no result"})
    res["wall s"] = wall
    res["cap s"] = timeout
    res.setdefault("seconds", wall)
    if res["status"] != "ok":
        res["log tail"] = (log or "")[-3000:]
    return res


def _headline(name: str, r: dict) -> str:
    if r.get("status") != "ok":
        return (r.get("error") or r.get("reason") or "").splitlines()[0][:90] if (
            r.get("error") or r.get("reason")) else ""
    f = lambda x, d=2: f"{x:.{d}f}"
    try:
        if name == "copy":
            return f"{r['GB/s']:,.0f} GB/s"
        if name == "plain_decode":
            return "; ".join(f"b{x['batch']}: {f(x['ms/step'])} ms, {x['GB/s']:,.0f} GB/s, "
                             f"{x['floor/ms']:.0%} of floor" for x in r["rows"])
        if name == "verify":
            return ", ".join(f"N={x['N']}: {f(x['t_V/t_1'])}" for x in r["rows"]) + " (t_V/t_1)"
        if name == "draft":
            return f"c = {f(r['c'], 3)} ({f(r['draft step ms'], 3)} ms / t_1 {f(r['t_1 ms'], 3)} ms)"
        if name == "e2e":
            return ", ".join(f"E={x['E']}: {f(x['speedup'])}x" for x in r["rows"][1:]) + \
                f" (plain {r['rows'][0]['tokens/s']:.1f} tok/s)"
        if name == "kernels":
            ok = sum(bool(x.get("ok")) for x in r["rows"])
            return f"{ok}/{len(r['rows'])} checks ok ({r['how']}); auto -> {r['auto']['mode']}"
        if name == "hf":
            return f"{r['tokens/s']:.1f} tok/s ({r['attn']})"
        if name == "quant":
            top = max(x["batch"] for x in r["rows"])
            return ", ".join(f"{x['mode']} {f(x['vs bf16'])}x" for x in r["rows"]
                             if x["batch"] == top) + f" of bf16 at b{top}"
        if name == "pytest":
            return ", ".join(f"{v} {k}" for k, v in sorted(r["counts"].items()))
    except (KeyError, TypeError, IndexError):
        return ""
    return ""


def render(payload: dict) -> str:
    from jspec.bench.common import format_table
    secs = payload["sections"]
    out = [f"device: {payload.get('device')}", "",
           format_table([{"section": n, "status": r.get("status"), "s": r.get("seconds"),
                          "wall s": r.get("wall s"), "result": _headline(n, r)}
                         for n, r in secs.items()],
                        ["section", "status", "s", "wall s", "result"])]
    detail = {"plain_decode": ["batch", "context", "ms/step", "GB/s", "floor ms", "floor/ms",
                               "tokens/s", "compile s", "kernels"],
              "verify": ["N", "ms", "t_V/t_1", "compile s", "kernels"],
              "e2e": ["run", "E", "tokens/s", "ms/token", "speedup", "ideal", "accept len",
                      "first s"],
              "kernels": ["check", "max abs err", "ok", "s"],
              "quant": ["mode", "batch", "ms/step", "tokens/s", "weights MB", "vs bf16"]}
    for n, cols in detail.items():
        r = secs.get(n, {})
        if r.get("status") == "ok" and r.get("rows"):
            out += ["", n, format_table(r["rows"], cols)]
    hf, e2e = secs.get("hf", {}), secs.get("e2e", {})
    if hf.get("status") == "ok" and e2e.get("status") == "ok":
        out += ["", f"jspec plain / transformers (batch 1, same shape): "
                    f"{e2e['rows'][0]['tokens/s'] / hf['tokens/s']:.2f}x"]
    return "\n".join(out)


def run_all(smoke: bool, budget: float, only=None, out_dir: str | None = None, log=print) -> dict:
    plan = Plan(smoke)
    out_dir = out_dir or os.environ.get("OUT") or "out"
    os.makedirs(out_dir, exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    caps = SMOKE_CAPS if smoke else CAPS
    start = time.perf_counter()
    payload = {"benchmark": "device", "smoke": smoke, "budget s": budget,
               "command": "python -m jspec.bench device" + (" --smoke" if smoke else ""),
               "plan": {k: v for k, v in vars(plan).items()}, "sections": {}}
    ctx: dict = {}
    path = os.path.join(out_dir, RESULT_NAME)
    with tempfile.TemporaryDirectory(prefix="jspec_device_") as tmp:
        for name in SECTIONS:
            if only and name not in only:
                continue
            left = budget - (time.perf_counter() - start)
            if left < 10:
                payload["sections"][name] = {"status": "skipped", "seconds": 0.0,
                                             "reason": f"run budget of {budget:.0f}s spent"}
                continue
            timeout = min(caps[name], left)
            log(f"[{time.perf_counter() - start:6.1f}s] {name} (cap {timeout:.0f}s) ...")
            if name == "pytest":
                res = run_pytest(plan, timeout, root)
            else:
                res = _launch(name, smoke, ctx, timeout, root, tmp)
            payload["sections"][name] = res
            if res.get("device") and "device" not in payload:
                payload["device"] = res["device"]
            if name == "copy" and res.get("status") == "ok":
                ctx["copy GB/s"] = res["GB/s"]
            log(f"         {res.get('status')} in {res.get('seconds', 0):.1f}s  "
                f"{_headline(name, res)}")
            payload["total s"] = time.perf_counter() - start
            _write(path, payload)                   # after every section: a crash keeps the rest
    _add_ideal(payload)
    payload["total s"] = time.perf_counter() - start
    _write(path, payload)
    payload["path"] = path
    return payload


def _add_ideal(payload: dict) -> None:
    """e2e rows get the cost model's ideal speed-up when verify and draft ran."""
    from jspec.bench.spec_simulate import ideal_speedup
    s = payload["sections"]
    v, d, e = s.get("verify", {}), s.get("draft", {}), s.get("e2e", {})
    if not all(x.get("status") == "ok" for x in (v, d, e)):
        return
    N = e["spec"][2]
    ratio = v["t_V/t_1"].get(str(N))
    if ratio is None:
        return
    steps = e["spec"][0]
    for row in e["rows"][1:]:
        row["ideal"] = ideal_speedup(float(row["E"]), ratio, d["c"], steps)
        row["measured/ideal"] = row["speedup"] / row["ideal"]
    e["ideal model"] = (f"E / (t_V({N})/t_1 + S c), S = {steps} drafter forwards per verify "
                        "(jspec.bench.spec_simulate.ideal_speedup)")


def _write(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def add_args(p) -> None:
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check, < ~60 s)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds after which no section starts (default {BUDGET}; "
                        f"--smoke {SMOKE_BUDGET})")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--context-json", default="{}", help=argparse.SUPPRESS)


def main(a):
    if a.worker:
        return run_worker(a.worker, a.result, a.smoke, json.loads(a.context_json))
    try:   # this process only orchestrates: never let it claim the accelerator's memory
        import jax
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # noqa: BLE001 - a backend already up is fine: it is never used here
        pass
    budget = a.budget if a.budget is not None else (SMOKE_BUDGET if a.smoke else BUDGET)
    payload = run_all(a.smoke, budget, a.only, log=lambda m: print(m, flush=True))
    print()
    print(render(payload))
    print(f"\nwrote {payload['path']} ({payload['total s']:.0f}s)")
    return payload


COMMAND = Command("device", "the prepared one-accelerator benchmark; writes "
                            f"$OUT/{RESULT_NAME} (OUT defaults to ./out)", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
