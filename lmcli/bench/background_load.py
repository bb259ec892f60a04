"""Busy loops that keep cores taken while `lmcli bench --background-load N` measures (a shared machine).

Each loop is its own Python process spinning on the CPU. They are bounded three ways, so none outlives
the benchmark: `stop()` (called on leaving the `with` block, on error and on Ctrl-C alike) kills them;
each ends by itself after `max_seconds`; and each is killed by the kernel if its parent dies (Linux's
parent-death signal), or ends when it sees it has a new parent elsewhere. Between loaded measurements
they are paused (SIGSTOP), so the quiet figures are taken with the same processes present but idle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import TracebackType

MAX_SECONDS = 4 * 3600  # a loop ends by itself after this long, whatever happens to the benchmark

# The loop: ask for SIGKILL when the parent dies (PR_SET_PDEATHSIG = 1), then spin until the deadline
# or until the parent is gone. It checks the clock only every 100k iterations, so it is all CPU work.
_LOOP = """
import ctypes, os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)
except (OSError, AttributeError):
    pass
print("ready", flush=True)  # asked for: the parent may stop this process now
while os.getppid() == parent and time.monotonic() < deadline:
    for _ in range(100_000):
        pass
"""


class BackgroundLoad:
    """`count` busy loops, started paused; `running()` lets them spin, `paused()` stops them again."""

    def __init__(self, count: int, max_seconds: float = MAX_SECONDS):
        self.count = count
        self.max_seconds = max_seconds
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> BackgroundLoad:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        try:
            for _ in range(self.count):
                process = subprocess.Popen([sys.executable, "-c", _LOOP, str(os.getpid()), str(self.max_seconds)],
                                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL)
                self.processes.append(process)
                assert process.stdout is not None
                process.stdout.readline()  # its parent-death signal is set (else stopping it now could orphan it)
                process.stdout.close()
            self.pause()
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def resume(self) -> None:
        for process in self.processes:
            self._signal(process, signal.SIGCONT)

    def pause(self) -> None:
        """Stop the loops, returning once each has stopped (a signal is delivered asynchronously)."""
        for process in self.processes:
            self._signal(process, signal.SIGSTOP)
        for process in self.processes:
            if process.poll() is None:
                os.waitpid(process.pid, os.WUNTRACED)  # reports the stop (SIGSTOP cannot be ignored)

    def stop(self) -> None:
        """Kill and reap every loop (a stopped process dies of SIGKILL too)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
        self.processes = []

    @staticmethod
    def _signal(process: subprocess.Popen, signum: int) -> None:
        if process.poll() is None:
            os.kill(process.pid, signum)


class Loaded:
    """`with Loaded(load):` the loops spin inside the block (nothing happens for None or no loops)."""

    def __init__(self, load: BackgroundLoad | None):
        self.load = load

    def __enter__(self) -> None:
        if self.load is not None:
            self.load.resume()

    def __exit__(self, *exc: object) -> None:
        if self.load is not None:
            self.load.pause()
