"""A decode step's token choice for many rows at once, on torch's threads.

Each row of a continuous batch chooses its token with its own processors and its own random stream;
those calls share nothing, and their heavy parts (numpy's sort, torch's ops) release the GIL, so the
rows of a step can choose side by side: `RowChooser.run` spreads them over as many worker threads as
torch may use (`torch.get_num_threads()`, which lmcli/threads.py moves with the load), each worker
taking the next row not yet taken. With one thread there is no worker: the rows choose in the caller,
in order, as before.

A worker runs torch with one OpenMP thread. Without that, every worker thread that calls a torch op
starts an OpenMP team of its own (torch's count at that moment, per calling thread), and two workers
on two cores would run four spinning threads. One thread per worker changes no row's numbers for the
tasks sent there: the caller sends only rows whose processors give the same result on any thread count
(`ProcessorChain.same_on_any_thread`; a float sum over a whole row, as in typical-p, splits across
threads and rounds differently), and keeps the rest, constrained rows included, on its own thread.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class RowChooser:
    """Runs a step's independent per-row tasks, in parallel where they may be; closed with `close()`."""

    def __init__(self) -> None:
        self._workers: _Workers | None = None

    def run(self, tasks: Sequence[Callable[[], T]], anywhere: Sequence[bool]) -> list[T]:
        """Every task's result, in the tasks' order. A task marked `anywhere` may run on a worker thread;
        the others run here, one after another, before the workers start. Tasks must not share state.
        The first failed task's error (in the tasks' order) is raised once all have run."""
        spread = [i for i, ok in enumerate(anywhere) if ok]
        groups = min(torch.get_num_threads(), len(spread))
        if groups < 2:
            return [task() for task in tasks]
        results: list[Any] = [None] * len(tasks)
        for i, ok in enumerate(anywhere):
            if not ok:
                results[i] = tasks[i]()
        if self._workers is None or self._workers.count < groups:
            self.close()
            self._workers = _Workers(groups)
        for i, result in zip(spread, self._workers.run([tasks[i] for i in spread], groups)):
            results[i] = result
        return results

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers = None


class _Workers:
    """`count` threads, each running torch on one OpenMP thread, waiting for work."""

    def __init__(self, count: int):
        self.count = count
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        started = threading.Barrier(count + 1)
        ours = torch.get_num_threads()
        self._threads = [threading.Thread(target=self._serve, args=(started,), name=f"lmcli-choice-{n}", daemon=True)
                         for n in range(count)]
        for thread in self._threads:
            thread.start()
        started.wait()
        # A worker's set_num_threads(1) is its own OpenMP setting, but it also writes torch's
        # process-wide count, which threads started later begin with: put back the caller's.
        torch.set_num_threads(ours)

    def _serve(self, started: threading.Barrier) -> None:
        # torch sets a thread's OpenMP count from its process-wide one when the thread first asks for it
        # (get_num_threads, or any parallel op), so ask first: set after that, the one thread stays.
        torch.get_num_threads()
        torch.set_num_threads(1)
        started.wait()
        while (job := self._inbox.get()) is not None:
            job()

    def run(self, tasks: Sequence[Callable[[], T]], groups: int) -> list[T]:
        pending = collections.deque(enumerate(tasks))
        results: list[Any] = [None] * len(tasks)
        errors: list[BaseException | None] = [None] * len(tasks)
        finished = threading.Semaphore(0)
        inference = torch.is_inference_mode_enabled()  # thread-local: the workers take the caller's

        def drain() -> None:
            try:
                with torch.inference_mode(inference):
                    while pending:
                        try:
                            i, task = pending.popleft()
                        except IndexError:
                            return
                        try:
                            results[i] = task()
                        except BaseException as error:  # raised in the caller, below
                            errors[i] = error
            finally:
                finished.release()

        for _ in range(groups):
            self._inbox.put(drain)
        for _ in range(groups):
            finished.acquire()
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise first
        return results

    def close(self) -> None:
        for _ in self._threads:
            self._inbox.put(None)
        for thread in self._threads:
            thread.join()
