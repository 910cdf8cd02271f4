"""``python -m jspec serve`` in a subprocess on 127.0.0.1, for tests that drive it over HTTP.

:func:`start` picks a free port, starts the server (its output in a log file), and waits for
``/health``, recording every status it saw on the way (503 while the engine warms, then
200). The process is the command users run, so the CLI, the app and the engine's thread are
all tested together, and the test process never imports JAX for it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    health: list[int]           # /health statuses seen while starting, in order

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start(args: list[str], log: Path, timeout_s: float = 600, env: dict | None = None) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "jspec", "serve", "--host", "127.0.0.1", "--port", str(port),
           *args]
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    out = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    out.close()
    server = Server(proc, port, log, [])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{server.log_tail()}")
        try:
            code = httpx.get(server.base + "/health", timeout=5).status_code
        except httpx.TransportError:        # not listening yet
            time.sleep(0.2)
            continue
        if not server.health or server.health[-1] != code:
            server.health.append(code)
        if code == 200:
            return server
        time.sleep(0.2)
    stop(server)
    raise RuntimeError(f"the server was not healthy in {timeout_s}s:\n{server.log_tail()}")


def stop(server: Server) -> None:
    """SIGINT (uvicorn's graceful shutdown: the engine's loop stops), then kill if stuck."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(30)
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()
