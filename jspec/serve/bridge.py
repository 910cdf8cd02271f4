"""The engine's thread and the server's event loop, joined.

The engine decodes on its own thread (:meth:`jspec.engine.Engine.start`) and calls back
with every :class:`jspec.engine.Delta`. A callback must not touch asyncio objects from that
thread, so each delta is handed to the loop with ``loop.call_soon_threadsafe`` and lands in
the queue of the HTTP request that asked for it. A request with several prompts has one
engine request per prompt and one queue for all of them; each item names its choice.

Bring-up (:meth:`Bridge.bring_up`) warms the engine (compiles every program) on a worker
thread while the server already answers, ``/health`` with 503, then starts the loop.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import traceback
from typing import Any

from jspec.serve.errors import APIError

log = logging.getLogger("jspec.serve")


class Job:
    """The engine requests of one HTTP request: their ids, and the queue their deltas
    reach as ``(choice index, delta)``."""

    def __init__(self, bridge: "Bridge", stream: bool = True):
        self.bridge = bridge
        self.stream = stream                 # False: only the done deltas are delivered
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[Any] = []            # what Engine.submit returned, per choice
        self.open: set[int] = set()          # choices without their done delta yet
        self._polled = 0.0                   # when the client was last seen connected

    async def next(self, is_disconnected=None, poll_s: float = 0.1):
        """The next ``(choice, delta)``. ``is_disconnected`` (an async callable) is polled
        every ``poll_s`` seconds, deltas arriving or not: a client gone raises
        ``ConnectionAbortedError`` (the caller's ``finally`` then cancels what still runs)."""
        loop = asyncio.get_running_loop()
        while True:
            if is_disconnected is None:
                item = await self.queue.get()
            else:
                if loop.time() - self._polled >= poll_s:
                    self._polled = loop.time()
                    if await is_disconnected():
                        raise ConnectionAbortedError("client disconnected")
                try:
                    item = await asyncio.wait_for(self.queue.get(), poll_s)
                except asyncio.TimeoutError:
                    continue
            if isinstance(item, BaseException):
                raise item
            choice, delta = item
            if delta.done:
                self.open.discard(choice)
                if delta.completion is None:     # the engine's loop failed (finish "error")
                    self.cancel()
                    raise APIError("the engine failed while serving this request; see the "
                                   "server's log", status=500)
            return choice, delta

    @property
    def finished(self) -> bool:
        return not self.open

    def cancel(self) -> None:
        """Cancel the choices still running (their slots and pages free at the engine's
        next chunk boundary); nothing more reaches the queue."""
        for choice in sorted(self.open):
            self.bridge.cancel(self.rids[choice])
        self.open.clear()


class Bridge:
    """Owns the engine's lifetime for the server: warm, start, submit, cancel, stop."""

    def __init__(self, engine, warm_kwargs: dict | None = None):
        self.engine = engine
        self.warm_kwargs = warm_kwargs or {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = False
        self.failed: str | None = None      # why bring-up failed, for /health
        self._routes: dict[Any, tuple[Job, int]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.finished = collections.Counter()   # finish reasons of every engine request

    # ------------------------------------------------------------ lifetime
    async def bring_up(self) -> None:
        """Warm the engine off the loop, then start its thread. Failures are logged and
        kept (``/health`` reports them); the server stays up to say so."""
        self.loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self.engine.warm, **self.warm_kwargs)
            self.engine.start(self._on_delta)
        except Exception as e:       # noqa: BLE001 (reported, not raised into the loop)
            self.failed = f"{type(e).__name__}: {e}"
            log.error("engine bring-up failed:\n%s", traceback.format_exc())
            return
        self.ready = True
        log.info("engine warm; serving")

    def stop(self) -> None:
        if self.ready:
            self.ready = False
            try:
                self.engine.stop()
            except RuntimeError:     # the loop had failed; logged when it did
                log.error("the engine's loop had failed", exc_info=True)

    @property
    def live(self) -> int:
        return self.engine.live

    # ------------------------------------------------------------ requests
    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def check(self, requests) -> None:
        """Every engine request checked before any is submitted, so a bad choice refuses
        the whole HTTP request with nothing run."""
        for r in requests:
            try:
                self.engine.check(r)
            except ValueError as e:
                raise APIError(str(e)) from e

    def submit(self, requests, stream: bool = True) -> Job:
        """Submit the requests as the choices of one job. ``stream=False``: the job hears
        only each choice's done delta (a non-streamed answer needs nothing else, and the
        loop is not woken for every chunk). Several choices are all checked (:meth:`check`)
        before any is submitted; one is checked by ``Engine.submit`` itself (the template
        rendered and the prompt tokenized once)."""
        if not self.ready:
            raise APIError(self.failed or "the engine is warming up; retry when /health is 200",
                           status=503)
        if len(requests) > 1:
            self.check(requests)
        job = Job(self, stream)
        try:
            for choice, r in enumerate(requests):
                with self._lock:     # routed before submit: a delta may come at once
                    self._routes[r.id] = (job, choice)
                job.open.add(choice)
                rid = self.engine.submit(r)
                job.rids.append(rid)
                if rid != r.id:
                    with self._lock:
                        self._routes[rid] = self._routes.pop(r.id)
        except ValueError as e:
            job.open.discard(len(job.rids))
            with self._lock:
                self._routes.pop(requests[len(job.rids)].id, None)
            job.cancel()
            raise APIError(str(e)) from e
        return job

    def cancel(self, rid) -> None:
        with self._lock:
            self._routes.pop(rid, None)
        try:
            self.engine.cancel(rid)
        except Exception:            # noqa: BLE001 (finished meanwhile: nothing to free)
            log.debug("cancel %r", rid, exc_info=True)

    def _on_delta(self, delta) -> None:
        """On the engine's thread: hand the delta to its job's loop. Deltas of cancelled or
        unknown requests are dropped. Never raises (it would stop the engine's loop)."""
        try:
            with self._lock:
                if delta.done:
                    self.finished[delta.finish_reason or "stop"] += 1
                route = self._routes.get(delta.id)
                if route is not None and delta.done:
                    del self._routes[delta.id]
            if route is None or not (delta.done or route[0].stream):
                return
            job, choice = route
            self.loop.call_soon_threadsafe(job.queue.put_nowait, (choice, delta))
        except Exception:            # noqa: BLE001
            log.error("delivering a delta failed:\n%s", traceback.format_exc())
