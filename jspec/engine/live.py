"""The engine taking requests while it runs: :meth:`LiveEngine.submit` from any thread,
:meth:`~LiveEngine.cancel`, and the loop on its own thread (:meth:`~LiveEngine.start`,
:meth:`~LiveEngine.stop`). :class:`LiveEngine` is the live half of
:class:`jspec.engine.Engine` (a mixin, kept here so the engine module stays about the
decode loop itself); :class:`Intake` is the one thing the threads share.

The loop runs the same chunk boundary as :meth:`Engine.stream` (admit, decode, deltas,
:meth:`Engine._step`), between boundaries reading what was submitted and cancelled since
the last one; with nothing pending or live it waits on a condition variable.

Failure: an exception in the loop thread (the engine's or ``on_delta``'s) ends the loop;
every pending and live request then gets a done delta with ``finish_reason="error"`` and no
completion, :meth:`~LiveEngine.stop` re-raises it (as the cause of a ``RuntimeError``),
and the engine takes no more requests (its device state may be lost mid-call).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, NamedTuple

import jax

from jspec.engine.requests import Completion, Delta, Request

log = logging.getLogger("jspec")


class Checked(NamedTuple):
    """A submitted request, validated and tokenized in the caller's thread."""
    req: Any
    ids: list[int]
    t0: float                        # submit time (perf_counter): its latencies count from here


class Intake:
    """What submitters and the loop share, under one condition variable: requests
    submitted since the last boundary, ids asked to cancel, and the ids not yet finished."""

    def __init__(self):
        self.cond = threading.Condition()
        self.new: deque = deque()        # (index, Checked)
        self.cancels: set = set()
        self.ids: set = set()            # submitted, not finished
        self.count = 0                   # submissions numbered (rejected ones leave gaps)
        self.stopping = False
        self.error: BaseException | None = None

    def number(self) -> int:
        with self.cond:
            self.count += 1
            return self.count - 1

    def add(self, index: int, item: Checked) -> Any:
        with self.cond:
            if self.error is not None:
                raise RuntimeError("the engine's loop failed; it takes no more requests") \
                    from self.error
            if item.req.id in self.ids:
                raise ValueError(f"request id {item.req.id!r} is already pending or running")
            self.ids.add(item.req.id)
            self.new.append((index, item))
            self.cond.notify_all()
            return item.req.id

    def cancel(self, rid) -> bool:
        with self.cond:
            if rid not in self.ids:
                return False
            self.cancels.add(rid)
            self.cond.notify_all()
            return True

    def take(self, idle: bool):
        """``(new requests, ids to cancel, stopping)``; when ``idle`` (nothing pending or
        live), first wait for any of them."""
        with self.cond:
            while idle and not (self.new or self.cancels or self.stopping):
                self.cond.wait()
            new, self.new = list(self.new), deque()
            cancels, self.cancels = self.cancels, set()
            return new, cancels, self.stopping

    def finished(self, rid) -> None:
        with self.cond:
            self.ids.discard(rid)


class Blank(NamedTuple):
    """A page-less row, as :meth:`Engine.warm` inserts: done at once, it writes nothing."""
    req: Any
    ids: list[int]
    pages: list[int]


class LiveEngine:
    """The engine's live interface (see the module doc), and the freeing of rows whose
    device row did not stop (a cancel, a stop string), which :meth:`Engine.stream` shares.
    Needs the engine's ``_request``, ``_ensure_state``, ``_step`` and ``_insert``."""

    def _live_init(self) -> None:
        self._dirty: set[int] = set()        # free slots whose device row never stopped
        self._intake = Intake()
        self._pending: deque = deque()        # admitted in order at each boundary
        self._slots: list = [None] * self.slots
        self._thread: threading.Thread | None = None

    @property
    def live(self) -> int:
        """Requests submitted and not yet finished (pending or in a slot)."""
        with self._intake.cond:
            return len(self._intake.ids)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _not_running(self) -> None:
        """The slots belong to the live loop while it runs or holds requests (stream and
        warm must not touch them meanwhile)."""
        if self.running or self._pending or any(self._slots):
            raise RuntimeError("the engine's live loop is running (or stopped with requests "
                               "unfinished): submit() to it instead")

    def submit(self, request) -> Any:
        """Queue ``request`` (a :class:`Request` or a prompt) for the loop, from any thread;
        returns its id (its own, else its submission number). Checked now: a
        ``ValueError`` for a request this engine cannot serve, and nothing is queued."""
        index = self._intake.number()
        req, ids = self._request(request, index)
        need = self.pages.needed(len(ids) + req.max_new_tokens + self.overshoot)
        if need > min(self.pages.num_pages, self.pages.max_pages):
            raise ValueError(f"request {req.id}: its prompt and max_new_tokens need {need} "
                             f"pages; a row holds {self.pages.max_pages} and the budget is "
                             f"{self.pages.num_pages}")
        return self._intake.add(index, Checked(req, ids, time.perf_counter()))

    def cancel(self, rid) -> bool:
        """Cancel request ``rid``: a pending one is dropped, a running one's slot and pages
        are freed at the next chunk boundary; either way its last delta has
        ``finish_reason="cancelled"``. False when no such request is pending or running;
        True does not promise the cancel wins over the chunk in flight finishing it."""
        return self._intake.cancel(rid)

    def start(self, on_delta: Callable[[Delta], None]) -> None:
        """Run the loop on a daemon thread, handing every delta to ``on_delta`` (called on
        that thread: keep it quick, hand off to other threads yourself)."""
        if self.running:
            raise RuntimeError("the engine's loop is already running")
        if self._intake.error is not None:
            raise RuntimeError("the engine's loop failed; make a new engine") \
                from self._intake.error
        if self.state is None:
            self._ensure_state()
        self._intake.stopping = False
        self._thread = threading.Thread(target=self._serve, args=(on_delta,), daemon=True,
                                        name="jspec-engine")
        self._thread.start()

    def stop(self) -> None:
        """End the loop after the chunk in flight and wait for it. Unfinished requests
        stay, resumed by the next :meth:`start`. Re-raises a failure of the loop. Not from
        ``on_delta`` (the loop's own thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("stop() from on_delta would wait for itself")
        with self._intake.cond:
            self._intake.stopping = True
            self._intake.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._intake.error is not None:
            raise RuntimeError("the engine's loop failed") from self._intake.error

    # ------------------------------------------------------------------ freeing rows
    def _release(self, slot: int, slots: list, dirty: bool) -> None:
        """Free ``slot`` and its pages; ``dirty``: its device row did not stop (a stop string
        or a cancel), so :meth:`_scrub` must blank it before the next chunk."""
        self.pages.give_back(slots[slot].pages)
        self.grammars.release(slot)
        slots[slot] = None
        if dirty:
            self._dirty.add(slot)

    def _scrub(self, slots: list) -> None:
        """Blank the device row of each dirty slot left free: its page table still names
        pages another request may now hold, and a chunk that pads its bucket with the slot
        would write into them. The blank is warm's page-less insert (the smallest prompt
        bucket: nothing new compiles); a slot refilled since needs none (its insert replaced
        the row)."""
        T = self.prompt_buckets[0]
        for s in sorted(self._dirty):
            if slots[s] is None:
                self._insert(s, Blank(Request([0] * T, 1), [0] * T, []))
        self._dirty.clear()

    # ------------------------------------------------------------------ the loop
    def _serve(self, on_delta) -> None:
        def emit(d: Delta):
            if d.done:
                self._intake.finished(d.id)   # live drops before the caller hears
            on_delta(d)

        try:
            while True:
                idle = not (self._pending or any(self._slots))
                new, cancels, stopping = self._intake.take(idle)
                if stopping:
                    return
                self._pending.extend(new)
                for d in self._cancelled(cancels):
                    emit(d)
                if self._pending or any(self._slots):
                    for d in self._step(self._pending, self._slots, None):
                        emit(d)
        except BaseException as e:                     # noqa: BLE001 - surfaced, see doc
            log.exception("the engine's loop failed")
            self._fail(e, on_delta)

    def _cancelled(self, ids: set):
        """Drop the pending requests in ``ids``, free the slots of the live ones."""
        if not ids:
            return
        for item in [p for p in self._pending if p[1].req.id in ids]:
            self._pending.remove(item)
            index, (req, prompt, _) = item
            yield self._cancel_delta(req, index, prompt, [], "")
        live = [s for s, lv in enumerate(self._slots) if lv is not None and lv.req.id in ids]
        toks = jax.device_get(self.state.core.tokens) if live else None
        for s in live:
            lv = self._slots[s]
            self._release(s, self._slots, dirty=True)   # its device row never stopped
            yield self._cancel_delta(lv.req, lv.index, lv.ids, toks[s, :lv.sent].tolist(),
                                     lv.out.sent)

    def _cancel_delta(self, req, index, prompt, tokens, text) -> Delta:
        text = None if self.target.tokenizer is None else text
        stats = {"prompt_len": len(prompt), "new_tokens": len(tokens), "stop_reason": "cancelled"}
        done = Completion(req.id, index, prompt, tokens, text, stats, finish_reason="cancelled")
        return Delta(req.id, index, [], None if text is None else "", done=True,
                     completion=done, finish_reason="cancelled")

    def _fail(self, e: BaseException, on_delta) -> None:
        """Every pending and live request ends with an error delta (best effort)."""
        with self._intake.cond:
            self._intake.error = e
            self._pending.extend(self._intake.new)
            self._intake.new.clear()
            rids = list(self._intake.ids)
            self._intake.ids.clear()
        index = {p[1].req.id: p[0] for p in self._pending}
        index.update({lv.req.id: lv.index for lv in self._slots if lv is not None})
        self._pending.clear()
        self._slots = [None] * self.slots
        for rid in rids:
            try:
                on_delta(Delta(rid, index.get(rid, -1), [], None, done=True,
                               finish_reason="error"))
            except Exception:                          # noqa: BLE001 - the loop is gone
                log.exception("on_delta failed on an error delta")

