"""The one thread that owns the model: every request's rows run in one continuous batch.

Requests put their rows on a bounded queue (`submit`; over `max_queue` waiting rows it refuses at once,
the server's 429). The thread takes rows into free places of the batch as ContinuousRun does for a job,
and after each step hands each row's new text (and logprobs) to its request's asyncio queue on the
event loop (loop.call_soon_threadsafe: the thread never waits for a reader, so a slow reader slows no
one; what it has not read yet is bounded by its row's max_tokens). A row whose request is gone (the
client disconnected) or past its time limit is ended at the next step, which frees its place.

The rows are ContinuousRun's, so a row's tokens are those of its single run (`lmcli generate` with the
same settings) on the batch-invariant path, whoever its neighbours are.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lmcli.generation.continuous import ContinuousRun
from lmcli.generation.rows import PreparedRow, RowResult, finish_row, generate_batch

CANCELLED, TIMED_OUT = "cancelled", "time_limit"  # finish reasons of rows the server ends itself


@dataclass
class Event:
    """What a row's request hears: its new text and logprob entries ("token"), its end ("done", with the
    result), or a failure ("error", with the message)."""

    kind: str
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    result: RowResult | None = None
    message: str = ""
    tokens: int = 0  # the row's tokens so far
    status: int = 500  # of an error: 503 when the server is shutting down


class RowSink:
    """One row's way back to its request: (index, event) onto the request's asyncio queue, on its loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, Event]], index: int,
                 deadline: float):
        self.loop, self.queue, self.index = loop, queue, index
        self.deadline = deadline  # time.monotonic() past which the row is ended
        self.cancelled = False  # set from the loop when the client goes away; read by the scheduler
        self.sent_chars = 0
        self.sent_logprobs = 0
        self.finished = False

    def put(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone, nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, event))

    def progress(self, result: RowResult) -> None:
        """Send what the row added since the last call (text already safe to show, see streaming.RowText)."""
        text = result.text.text
        steps = result.logprobs or []
        if len(text) > self.sent_chars or len(steps) > self.sent_logprobs:
            self.put(Event("token", text[self.sent_chars:], steps[self.sent_logprobs:], tokens=len(result.tokens)))
            self.sent_chars, self.sent_logprobs = len(text), len(steps)

    def done(self, result: RowResult) -> None:
        if self.finished:
            return
        self.progress(result)
        self.finished = True
        self.put(Event("done", result=result))

    def fail(self, message: str, status: int = 500) -> None:
        if not self.finished:
            self.finished = True
            self.put(Event("error", message=message, status=status))


def _gone(sink: RowSink | None) -> bool:
    return sink is None or sink.cancelled


class QueueFull(Exception):
    pass


class Scheduler:
    """Owns the model and one continuous run on its own thread (`start`, `stop`)."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, max_queue: int, capacity: int,
                 prefix_cache: Any = None):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_queue, self.capacity = batch_size, max_queue, capacity
        self.prefix_cache = prefix_cache
        self.sinks: dict[int | str, RowSink] = {}
        self._waiting: collections.deque[PreparedRow] = collections.deque()
        self._lock = threading.Condition()
        self._admitting = True
        self._stop = False
        self.running = 0  # rows in the batch (or running alone)
        self.thread = threading.Thread(target=self._main, name="lmcli-scheduler", daemon=True)
        self.error: BaseException | None = None
        self.run: ServeRun | None = None

    # --- the event loop's side --------------------------------------------------------------------

    def submit(self, rows: list[PreparedRow], sinks: list[RowSink]) -> None:
        """Queue a request's rows; QueueFull when that would put more than max_queue rows in waiting,
        RuntimeError once the server stops admitting."""
        with self._lock:
            if not self._admitting:
                raise RuntimeError("the server is shutting down")
            if self._queued(len(rows)) > self.max_queue:
                raise QueueFull()
            for row, sink in zip(rows, sinks):
                self.sinks[row.id] = sink
                self._waiting.append(row)
            self._lock.notify()

    def waiting(self) -> int:
        """Rows waiting for a place in the batch: what /health reports and what admission counts."""
        with self._lock:
            return self._queued(0)

    def _queued(self, more: int) -> int:
        # The queue holds rows whose place in the batch is already free: the thread moves them in only
        # between steps (or after a prefill), so a row that arrives while another is still on its way into
        # a free place must not find the queue "full". A row waits only beyond the free places; a row whose
        # client is gone holds none (the thread drops it when it comes to it). Called under the lock.
        live = sum(1 for row in self._waiting if not _gone(self.sinks.get(row.id)))
        free = max(0, self.batch_size - self.running)
        return max(0, live + more - free)

    def stop_admitting(self) -> None:
        with self._lock:
            self._admitting = False

    def start(self) -> None:
        self.thread.start()

    def abort(self) -> None:
        """Stop admitting and end every row still waiting or in flight: its request hears at once that the
        server is shutting down (503), and the row leaves the batch at the next step."""
        with self._lock:
            self._admitting = False
            for row in self._waiting:
                sink = self.sinks.pop(row.id, None)
                if sink is not None:
                    sink.fail("the server is shutting down", 503)
            self._waiting.clear()
            for sink in list(self.sinks.values()):
                sink.cancelled = True
                sink.fail("the server is shutting down", 503)
            self._lock.notify()

    def stop(self, timeout: float) -> None:
        """abort(), then end the thread, waiting up to `timeout` seconds for it."""
        self.abort()
        with self._lock:
            self._stop = True
            self._lock.notify()
        self.thread.join(timeout)

    # --- the scheduler thread ---------------------------------------------------------------------

    def take(self, free: int, idle: bool) -> tuple[list[PreparedRow], bool]:
        """Up to `free` waiting rows (skipping those whose client is gone); waits a little for one when the
        batch is `idle`. Returns (rows, stopping)."""
        taken: list[PreparedRow] = []
        with self._lock:
            if idle and not self._waiting and not self._stop:
                self._lock.wait(0.25)
            while self._waiting and len(taken) < free:
                row = self._waiting.popleft()
                sink = self.sinks.get(row.id)
                if sink is None or sink.cancelled:
                    self.sinks.pop(row.id, None)  # its client is gone already
                    continue
                taken.append(row)
            self.running += len(taken)
            return taken, self._stop

    def _main(self) -> None:
        from lmcli.errors import LmcliError

        errors = (ValueError, RuntimeError, LmcliError)
        while True:
            run = ServeRun(self, self.model, self.tokenizer, self.batch_size, on_done=self._done,
                           alone=self._alone, prefix_cache=self.prefix_cache)
            self.run = run
            try:
                run.run(iter(()), self._isolate, errors=errors)
                return
            except Exception as e:  # a bug: fail the rows in flight, keep serving the others
                self.error = e
                if run.batch is not None:
                    for live in run.batch.rows:
                        if live is not None:
                            self._failed(live.result.row, f"{type(e).__name__}: {e}")
                if self._stop:
                    return

    def _sink(self, row: PreparedRow) -> RowSink | None:
        return self.sinks.get(row.id)

    def _done(self, result: RowResult) -> None:
        sink = self.sinks.pop(result.row.id, None)
        self.running -= 1
        if sink is not None:
            sink.done(result)

    def _failed(self, row: PreparedRow, message: str) -> None:
        sink = self.sinks.pop(row.id, None)
        self.running -= 1
        if sink is not None:
            sink.fail(message)

    def _isolate(self, rows: list[PreparedRow]) -> None:
        for row in rows:
            self._alone(row)

    def _alone(self, row: PreparedRow) -> None:
        """A row run by itself (generate_batch: the same tokens), after its batch failed or when it does not
        fit the batch's columns; it streams as it goes, but is not cancelled before its end."""
        from lmcli.errors import LmcliError

        sink = self.sinks.get(row.id)

        def on_text(result: RowResult, piece: str) -> None:
            if sink is not None:
                sink.progress(result)

        try:
            generate_batch(self.model, self.tokenizer, [row], on_text=on_text, on_done=self._done)
        except (ValueError, RuntimeError, LmcliError) as e:
            self._failed(row, " ".join(str(e).split()) or type(e).__name__)


class ServeRun(ContinuousRun):
    """ContinuousRun fed by the scheduler's queue instead of a job's rows, in a batch of fixed columns,
    reporting each row's progress after every token and ending rows whose request is gone."""

    def __init__(self, scheduler: Scheduler, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.scheduler = scheduler

    def _take(self, pending: Iterator[PreparedRow]) -> list[PreparedRow]:
        busy = self.batch is not None and any(live is not None for live in self.batch.rows)
        free = self.batch_size if self.batch is None else sum(live is None for live in self.batch.rows)
        taken, stopping = self.scheduler.take(free, idle=not busy)
        if stopping and not taken:
            self._exhausted = True
        if self.batch is None and taken:
            self.batch = self._new_batch(0)
        return taken

    def _new_batch(self, need: int) -> Any:
        # Columns for the longest row the server admits (prompt + max_tokens <= capacity, so a row needs
        # fewer than capacity + 1), fixed as rows come and go: every row joins the batch.
        return super()._new_batch((self.scheduler.capacity + 2) // 2)

    def _record(self, live: Any, token: Any, logits: Any) -> bool:
        ended = super()._record(live, token, logits)
        result = live.result
        sink = self.scheduler.sinks.get(result.row.id)
        if ended or sink is None:
            return ended
        sink.progress(result)
        reason = CANCELLED if sink.cancelled else TIMED_OUT if time.monotonic() > sink.deadline else None
        if reason is None:
            return False
        mask = live.policy.mask
        if mask is not None:
            mask.release(0)
        finish_row(result, reason, None, self.on_done)
        return True
