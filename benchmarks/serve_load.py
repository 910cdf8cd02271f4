"""``python -m jspec.bench serve-load``: ``python -m jspec serve`` under concurrent load, checked.

The server runs as users start it (a subprocess on 127.0.0.1, a free port, ``--drafter``,
``--slots``), and ``--clients`` asyncio clients (httpx) send ``--requests`` requests of mixed
settings between them: ``/v1/completions`` (and ``/v1/chat/completions`` when
``--chat-template`` is given; the shipped default model has none), streamed and not, greedy
and sampled (seeded), ``max_tokens`` in ``--min-tokens..--max-tokens``. A tenth are cancelled
mid-stream (the client closes the stream after its first chunk) and a tenth are malformed (bad
types, a negative ``max_tokens``, an unknown model, ``top_p`` 2, bad JSON, ...).

Checks (each a row of the table; any ``NO`` makes the command exit 1):

* every well-formed, uncancelled request is answered exactly once: a 200 with one choice and
  one finish reason (streamed: one finishing chunk, the usage chunk, then ``[DONE]``), its
  completion id seen by no other request;
* every greedy answer equals in-process ``jspec.generate`` alone (batch 1, no drafter) on the
  same prompt: its text, and its ``completion_tokens`` where the usage is reported. One
  reference per distinct greedy prompt at ``--max-tokens`` new tokens; a request for fewer is
  compared with the reference's first ``max_tokens`` tokens (greedy decoding is a prefix);
* every malformed request is a 400 in OpenAI's error shape
  (``{"error": {"message": str, "type": str, "param", "code"}}``);
* the server is still healthy afterwards.

Measured: the server's RSS (``VmRSS`` of ``/proc/PID/status``) once the first 500 requests
are answered and once the last 500 are; throughput (completion tokens of the well-formed,
uncancelled requests over the load's wall time) against an in-process
:class:`jspec.engine.Engine` with the same drafter, slots and limits running the same
workload through the server's own live loop (warmed first, as the server warms before
``/health`` is 200; the to-be-cancelled requests cancelled at their first delta), and their
ratio; the time to first token (p50/p99) of the streamed, uncancelled requests,
measured by the client from sending to the first chunk with text.

The server and the engine both run with ``--max-logprobs -1`` (no logprobs computed) and KV
sized for ``--max-prompt-tokens`` + ``--max-tokens``. The load, the in-process references and
the in-process engine run one after another, never at once, so they do not share the CPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jspec.bench.registry import Command, run_module

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTER = "checkpoints/default/drafters/eagle3"
PROMPTS = "checkpoints/default/drafters/heldout_prompts.txt"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
COLUMNS = ["check", "value", "ok"]


# --------------------------------------------------------------------------- the workload
@dataclasses.dataclass(eq=False)
class Item:
    """One request of the load. ``kind``: ``ok``, ``cancel`` or ``bad``."""
    i: int
    kind: str
    path: str                      # /v1/completions or /v1/chat/completions
    body: dict | None              # JSON body (None: ``raw`` is sent as the body)
    raw: bytes | None = None
    prompt: int | None = None      # index into the prompt list (well-formed ones)
    greedy: bool = False
    # filled by the client
    status: int | None = None
    answers: int = 0               # finished answers seen (choices with a finish reason)
    text: str | None = None
    completion_tokens: int | None = None
    ids: tuple = ()
    ttft_s: float | None = None
    problem: str | None = None
    error_body: dict | None = None


def bad_bodies(model: str, prompt: str, cap: int) -> list[tuple[str, dict | None, bytes | None]]:
    """Malformed requests, each a 400: ``(path, body, raw bytes)``."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": prompt}]
    return [
        (c, {"model": model, "prompt": prompt, "max_tokens": -1}, None),
        (c, {"model": model, "prompt": prompt, "max_tokens": "5"}, None),
        (c, {"model": model, "prompt": 5, "max_tokens": 4}, None),
        (c, {"model": "no-such-model", "prompt": prompt, "max_tokens": 4}, None),
        (c, {"model": model, "prompt": prompt, "max_tokens": 4, "top_p": 2}, None),
        (c, {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": -1}, None),
        (c, {"model": model, "prompt": prompt, "max_tokens": 4, "stream": "yes"}, None),
        (c, {"model": model, "prompt": prompt, "max_tokens": cap + 1}, None),
        (c, {"model": model, "prompt": prompt, "max_tokens": 4, "n": 2}, None),
        (c, {"model": model, "prompt": prompt, "max_tokens": 4, "seed": 1.5}, None),
        (c, None, b'{"model": "x", "prompt": '),                      # not JSON
        (ch, {"model": model, "messages": "hello", "max_tokens": 4}, None),
        (ch, {"model": model, "messages": [{"role": 3, "content": "x"}], "max_tokens": 4}, None),
        (ch, {"model": model, "messages": msgs, "max_completion_tokens": -3}, None),
        (ch, {"model": "no-such-model", "messages": msgs, "max_tokens": 4}, None),
    ]


def make_workload(n: int, prompts: list[str], model: str, chat: bool, lo: int, hi: int,
                  seed: int) -> list[Item]:
    """``n`` requests: a tenth cancelled, a tenth malformed, the rest well-formed and mixed."""
    rng = random.Random(seed)
    kinds = ["cancel" if j % 10 == 4 else "bad" if j % 10 == 9 else "ok" for j in range(n)]
    rng.shuffle(kinds)
    bads = bad_bodies(model, prompts[0], hi)
    items = []
    for i, kind in enumerate(kinds):
        if kind == "bad":
            path, body, raw = bads[rng.randrange(len(bads))]
            items.append(Item(i, kind, path, body, raw))
            continue
        p = rng.randrange(len(prompts))
        use_chat = chat and rng.random() < 0.5
        stream = True if kind == "cancel" else rng.random() < 0.5
        greedy = rng.random() < 0.5
        mt = hi if kind == "cancel" else rng.randint(lo, hi)
        body = {"model": model, "max_tokens": mt, "stream": stream}
        if use_chat:
            body["messages"] = [{"role": "user", "content": prompts[p]}]
        else:
            body["prompt"] = prompts[p]
        if stream:
            body["stream_options"] = {"include_usage": True}
        if greedy:
            body["temperature"] = 0
        else:
            body.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.9, 1.0]),
                        seed=rng.randrange(2 ** 31))
        items.append(Item(i, kind, "/v1/chat/completions" if use_chat else "/v1/completions",
                          body, prompt=p, greedy=greedy))
    return items


# --------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def server_args(a) -> list[str]:
    args = ["--model", a.model, "--slots", str(a.slots), "--max-tokens", str(a.max_tokens),
            "--max-prompt-tokens", str(a.max_prompt_tokens), "--max-logprobs", "-1",
            "--log-level", "warning"]
    if a.drafter:
        args += ["--drafter", a.drafter]
    if a.chat_template:
        args += ["--chat-template", a.chat_template]
    return args


def start_server(a, log: Path, timeout_s: float = 900):
    import httpx
    port = free_port()
    cmd = [sys.executable, "-m", "jspec", "serve", "--host", "127.0.0.1", "--port", str(port),
           *server_args(a)]
    out = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out.close()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{tail(log)}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    raise RuntimeError(f"the server was not healthy in {timeout_s}s:\n{tail(log)}")


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def tail(log: Path, n: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


# --------------------------------------------------------------------------- the clients
def _choice_text(choice: dict, chat: bool, streamed: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("delta" if streamed else "message") or {}
    return part.get("content") or ""


async def send(client, base: str, it: Item) -> None:
    chat = it.path.endswith("chat/completions")
    url = base + it.path
    kw = {"content": it.raw, "headers": {"content-type": "application/json"}} \
        if it.body is None else {"json": it.body}
    t0 = time.perf_counter()
    if it.body is None or not it.body.get("stream") is True:
        r = await client.post(url, **kw)
        it.status = r.status_code
        try:
            js = r.json()
        except ValueError:
            it.problem = f"not JSON: {r.text[:80]!r}"
            return
        if r.status_code != 200:
            it.error_body = js
            return
        ch = js.get("choices") or []
        it.answers = sum(1 for c in ch if c.get("finish_reason"))
        if len(ch) != 1:
            it.problem = f"{len(ch)} choices"
            return
        it.text = _choice_text(ch[0], chat, False)
        it.completion_tokens = (js.get("usage") or {}).get("completion_tokens")
        it.ids = (js.get("id"),)
        return
    async with client.stream("POST", url, **kw) as r:
        it.status = r.status_code
        if r.status_code != 200:
            with contextlib.suppress(ValueError):
                it.error_body = json.loads(await r.aread())
            return
        parts, ids, done = [], set(), False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            js = json.loads(data)
            if "error" in js:
                it.problem = f"error event: {js['error']}"
                continue
            ids.add(js.get("id"))
            if js.get("usage") is not None:
                it.completion_tokens = js["usage"].get("completion_tokens")
            for c in js.get("choices") or []:
                t = _choice_text(c, chat, True)
                if t and it.ttft_s is None:
                    it.ttft_s = time.perf_counter() - t0
                parts.append(t)
                if c.get("finish_reason"):
                    it.answers += 1
            if it.kind == "cancel":
                break                  # the client leaves after its first chunk
        it.text = "".join(parts)
        it.ids = tuple(ids)
        if it.kind != "cancel" and not done:
            it.problem = "stream ended without [DONE]"


async def drive(base: str, items: list[Item], clients: int, pid: int,
                marks: tuple[int, int]) -> dict:
    """Send ``items`` with ``clients`` concurrent clients; RSS once ``marks[0]`` and
    ``marks[1]`` requests are answered. Returns the wall time and the RSS samples."""
    import httpx
    queue = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    answered, rss = 0, {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def worker(client):
        nonlocal answered
        while True:
            try:
                it = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                await send(client, base, it)
            except Exception as e:                              # noqa: BLE001
                it.problem = f"{type(e).__name__}: {e}"
            answered += 1
            for m in marks:
                if answered == m:
                    rss[m] = rss_mib(pid)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "rss": rss}


# --------------------------------------------------------------------------- in process
def load_target(a):
    from jspec.serve.cli import load_model
    target = load_model(a.model)
    if a.chat_template and target.tokenizer is not None:
        p = Path(a.chat_template)
        target.tokenizer.chat_template = p.read_text() if p.is_file() else a.chat_template
    return target


def references(target, items: list[Item], prompts: list[str], n_new: int) -> dict:
    """``(chat, prompt index) -> greedy ids`` by ``jspec.generate`` alone, one call each."""
    import jspec
    from jspec import messages
    refs = {}
    for it in items:
        if it.kind != "ok" or not it.greedy:
            continue
        chat = it.path.endswith("chat/completions")
        key = (chat, it.prompt)
        if key in refs:
            continue
        if chat:
            ids = messages.render(target, [{"role": "user", "content": prompts[it.prompt]}])
            stop = messages.stop_ids(target)
        else:
            ids, stop = target.tokenizer.encode(prompts[it.prompt]), None
        r = jspec.generate(target, [ids], max_new_tokens=n_new, stop_ids=stop)
        refs[key] = [int(t) for t in r.tokens[0]]
    return refs


def engine_run(a, target, items: list[Item]) -> dict:
    """The same workload through an in-process Engine's live loop, the server's own
    (:meth:`Engine.start`, warmed first): every well-formed and to-be-cancelled request
    submitted in the load's order, each ``cancel`` one cancelled at its first delta (as its
    client leaves after the first chunk). Throughput counts the completion tokens of the
    well-formed ones, as the load does, so the ratio is the HTTP layer's cost alone."""
    import threading
    from jspec.args import load_drafter_arg
    from jspec.engine import Engine, Request
    from jspec.sampling import SamplingConfig
    drafter = load_drafter_arg(a.drafter, target) if a.drafter else None
    engine = Engine(target, drafter, slots=a.slots, sampling=SamplingConfig(per_request=True),
                    max_new_tokens=a.max_tokens, longest_prompt=a.max_prompt_tokens)
    engine.warm()
    reqs, to_cancel, ok = [], set(), set()
    for it in items:
        if it.kind == "bad":
            continue
        b = it.body
        kw = dict(id=it.i, max_new_tokens=b["max_tokens"], seed=b.get("seed", 0),
                  temperature=float(b["temperature"]))
        if "top_p" in b:
            kw["top_p"] = float(b["top_p"])
        if "messages" in b:
            kw["messages"] = b["messages"]
        else:
            kw["prompt"] = b["prompt"]
        reqs.append(Request(**kw))
        (to_cancel if it.kind == "cancel" else ok).add(it.i)
    finished, tokens, left = threading.Event(), 0, len(reqs)

    def on_delta(d):                 # the engine's thread
        nonlocal tokens, left
        if d.id in to_cancel:
            to_cancel.discard(d.id)
            engine.cancel(d.id)
        if d.done:
            tokens += len(d.completion.tokens) if d.id in ok else 0
            left -= 1
            if left == 0:
                finished.set()

    engine.start(on_delta)
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    finished.wait()
    wall = time.perf_counter() - t0
    engine.stop()
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}


# --------------------------------------------------------------------------- checks
def error_shape_ok(js) -> bool:
    e = js.get("error") if isinstance(js, dict) else None
    return (isinstance(e, dict) and isinstance(e.get("message"), str) and e["message"] != ""
            and isinstance(e.get("type"), str) and "param" in e and "code" in e)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def check(items: list[Item], refs: dict, target) -> tuple[list[dict], dict]:
    tok = target.tokenizer
    ok = [it for it in items if it.kind == "ok"]
    bad = [it for it in items if it.kind == "bad"]
    cancel = [it for it in items if it.kind == "cancel"]
    # answered exactly once, by a response no other request saw
    seen: dict = {}
    for it in ok:
        for x in it.ids:
            seen[x] = seen.get(x, 0) + 1
    once = [it for it in ok if it.status == 200 and it.problem is None and it.answers == 1
            and it.ids and all(seen[x] == 1 for x in it.ids)]
    got = {it.i for it in once}
    fails = {"not answered exactly once": [
        (it.i, it.status, it.answers, it.problem) for it in ok if it.i not in got][:5]}
    # greedy = generate
    greedy = [it for it in ok if it.greedy]
    same = []
    for it in greedy:
        ref = refs[(it.path.endswith("chat/completions"), it.prompt)][:it.body["max_tokens"]]
        want = tok.decode(ref)
        if it.text == want and it.completion_tokens in (None, len(ref)):
            same.append(it)
    got = {it.i for it in same}
    fails["greedy != generate"] = [
        (it.i, it.path, it.body["max_tokens"], it.text, it.completion_tokens)
        for it in greedy if it.i not in got][:5]
    # malformed: 400 in OpenAI's shape
    good400 = [it for it in bad if it.status == 400 and error_shape_ok(it.error_body)]
    got = {it.i for it in good400}
    fails["malformed not a 400 in OpenAI's shape"] = [
        (it.i, it.body if it.body is not None else it.raw, it.status, it.error_body)
        for it in bad if it.i not in got][:5]
    cancelled = [it for it in cancel if it.status == 200 and it.problem is None]
    got = {it.i for it in cancelled}
    fails["cancelled stream refused"] = [(it.i, it.status, it.problem)
                                         for it in cancel if it.i not in got][:5]
    rows = [
        {"check": "well-formed answered exactly once", "value": f"{len(once)}/{len(ok)}",
         "ok": len(once) == len(ok)},
        {"check": "greedy = jspec.generate alone", "value": f"{len(same)}/{len(greedy)} "
         f"({len(refs)} prompts)", "ok": len(same) == len(greedy)},
        {"check": "malformed -> 400, OpenAI error shape", "value": f"{len(good400)}/{len(bad)}",
         "ok": len(good400) == len(bad)},
        {"check": "cancelled after 1st chunk (200 seen)", "value": f"{len(cancelled)}/"
         f"{len(cancel)}", "ok": len(cancelled) == len(cancel)},
    ]
    return rows, {k: v for k, v in fails.items() if v}


# --------------------------------------------------------------------------- the command
def add_args(s) -> None:
    s.add_argument("--model", default="default", help="the server's --model (default: the "
                   "shipped model)")
    s.add_argument("--drafter", default=DEFAULT_DRAFTER, help="the server's --drafter "
                   f"(default {DEFAULT_DRAFTER}; '' for none)")
    s.add_argument("--slots", type=int, default=8)
    s.add_argument("--clients", type=int, default=64, help="concurrent clients")
    s.add_argument("--requests", type=int, default=2000)
    s.add_argument("--min-tokens", type=int, default=4, help="smallest max_tokens asked")
    s.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens asked; "
                   "also the server's --max-tokens")
    s.add_argument("--max-prompt-tokens", type=int, default=64)
    s.add_argument("--chat-template", help="a Jinja chat template (file or text; 'chatml' for "
                   "ChatML): chat requests join the mix (the default model has none)")
    s.add_argument("--prompts", default=PROMPTS, help="a text file, one prompt a line")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--rss-window", type=int, default=500, help="RSS after the first N and "
                   "after the last N requests")
    s.add_argument("--no-engine", action="store_true", help="skip the in-process engine run")
    s.add_argument("--json", help="write the results here")


def main(a) -> dict:
    from jspec.bench import common
    if a.chat_template == "chatml":
        a.chat_template = CHATML
    prompts = [line for line in Path(REPO / a.prompts if not Path(a.prompts).is_absolute()
                                     else a.prompts).read_text().splitlines() if line.strip()]
    items = make_workload(a.requests, prompts, a.model, bool(a.chat_template), a.min_tokens,
                          a.max_tokens, a.seed)
    target = load_target(a)
    t0 = time.perf_counter()
    refs = references(target, items, prompts, a.max_tokens)
    ref_s = time.perf_counter() - t0
    print(f"serve-load: {len(items)} requests ({sum(i.kind == 'ok' for i in items)} "
          f"well-formed, {sum(i.kind == 'cancel' for i in items)} cancelled, "
          f"{sum(i.kind == 'bad' for i in items)} malformed), {a.clients} clients, "
          f"{a.slots} slots, drafter {a.drafter or 'none'}; {len(refs)} greedy references "
          f"in {ref_s:.1f}s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        t0 = time.perf_counter()
        proc, base = start_server(a, log)
        up_s = time.perf_counter() - t0
        print(f"server up in {up_s:.1f}s (pid {proc.pid}, {base})", flush=True)
        try:
            w = min(a.rss_window, len(items))
            load = asyncio.run(drive(base, items, a.clients, proc.pid, (w, len(items))))
            import httpx
            try:
                healthy = httpx.get(base + "/health", timeout=10).status_code == 200
            except httpx.TransportError:
                healthy = False
            alive = proc.poll() is None
        finally:
            stop_server(proc)
            server_log = tail(log)

    rows, fails = check(items, refs, target)
    rows.append({"check": "server healthy after the load", "value": "alive" if alive else
                 f"exited {proc.returncode}", "ok": alive and healthy})
    ok = [it for it in items if it.kind == "ok"]
    tokens = sum(it.completion_tokens or 0 for it in ok)
    srv_tok_s = tokens / load["wall_s"]
    eng = None if a.no_engine else engine_run(a, target, items)
    ttft = [it.ttft_s * 1000 for it in ok if it.body.get("stream") and it.ttft_s is not None]
    r1, r2 = load["rss"].get(w), load["rss"].get(len(items))
    rows += [
        {"check": f"server RSS MiB after first {w} / last {w}",
         "value": f"{r1:.0f} / {r2:.0f} ({r2 - r1:+.0f})" if r1 and r2 else "-", "ok": None},
        {"check": "server completion tok/s (load wall)", "value":
         f"{srv_tok_s:.1f} ({tokens} tok / {load['wall_s']:.1f}s)", "ok": None},
    ]
    if eng:
        rows += [
            {"check": "in-process Engine (live loop) tok/s", "value":
             f"{eng['tok_s']:.1f} ({eng['tokens']} tok / {eng['wall_s']:.1f}s)", "ok": None},
            {"check": "server / engine throughput", "value": f"{srv_tok_s / eng['tok_s']:.3f}",
             "ok": None},
        ]
    rows.append({"check": f"TTFT ms p50 / p99 ({len(ttft)} streamed)",
                 "value": f"{pct(ttft, 50):.1f} / {pct(ttft, 99):.1f}" if ttft else "-",
                 "ok": None})
    print(f"\nload avg {common.load_avg()}:")
    print(common.format_table(rows, COLUMNS))
    passed = all(r["ok"] is not False for r in rows)
    for k, v in fails.items():
        print(f"FAIL {k}: {v}")
    if not passed:
        print(f"server log tail:\n{server_log}")
    payload = {"passed": passed, "rows": rows, "fails": {k: repr(v) for k, v in fails.items()},
               "load_wall_s": load["wall_s"], "rss_mib": load["rss"], "engine": eng,
               "server_tok_s": srv_tok_s, "ttft_ms": ttft}
    if a.json:
        common.write_json(a.json, payload)
    if not passed:
        raise SystemExit(1)
    return payload


COMMAND = Command("serve-load", "python -m jspec serve under concurrent mixed load: answered "
                  "once, greedy = generate, malformed = 400, RSS, tok/s vs the engine, TTFT",
                  add_args, main, description=__doc__)

if __name__ == "__main__":
    run_module(COMMAND)
