"""How many threads torch uses and how its OpenMP threads wait, chosen for the machine as it is.

OpenMP threads that spin at every barrier while another process holds their core wait for the
scheduler instead of working: with one of two cores busy elsewhere, decoding with torch's defaults
(all cores, libgomp's long spin) ran 12-18x slower than with one thread. The cure is never to run
more threads than there are free cores, and since cores are taken and freed while a long job or a
chat runs, lmcli keeps choosing:

- Before torch loads (libgomp reads its environment once), `configure()` sets OMP_NUM_THREADS: the
  CPUs this process may use (sched_getaffinity) less those other processes keep busy (the load
  average, or the tasks runnable now if fewer; at least 1).
- While generating, `recheck()` (called at every decode step; it only reads the clock unless
  RECHECK_S has passed) measures what the other processes used of our CPUs since the last look
  (/proc/stat less this process's own CPU time) and moves torch.set_num_threads between 1 and the CPUs:
  fewer when a core is taken, more when it is free again. At the start of each call, or after a pause
  (a chat waiting for its user, a gap of over PAUSE_S between calls), the first look counts the tasks
  running that instant instead.
- libgomp's own wait (spin, then sleep) is kept: with no more threads than free cores it is the
  fastest (1.6-2x passive waiting on a quiet machine, tools/thread_settings.py), and the wait policy
  cannot change once torch has loaded, while the thread count can.

A fixed thread count cannot follow the load, so with `--threads N` or the user's OMP_NUM_THREADS and a
CPU busy elsewhere at the start, lmcli sets OMP_WAIT_POLICY=PASSIVE (an idle thread sleeps at once).
So it does under torchrun, whose ranks on this machine share the CPUs: ranks x threads never exceeds
them, and the count is fixed (another rank is not load to give way to).

The user wins: `--threads N` over everything, then OMP_NUM_THREADS / OMP_WAIT_POLICY / GOMP_SPINCOUNT
from the environment (a wait variable the user set means lmcli sets neither), and a program that calls
torch.set_num_threads itself stops the re-checking. If torch was imported before lmcli could choose,
only an explicit `--threads` is applied: the settings are the program's own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

THREADS_VAR = "OMP_NUM_THREADS"
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
WAIT_CHOICE = {"OMP_WAIT_POLICY": "PASSIVE"}
RECHECK_S = 0.5  # how often recheck() looks at the load while generating
FIRST_WINDOW_S = 0.2  # sooner after a look at the tasks running now (an instant can mislead), ~40 ticks on 2 CPUs
PAUSE_S = 1.0  # a longer gap between two recheck() calls is a pause: what the CPUs did in it is no guide to now
# The variables lmcli itself set, so that a later call (or a child process, which inherits them) does not
# mistake lmcli's choice for the user's.
SET_BY_LMCLI_VAR = "LMCLI_THREADS_SET"


@dataclass(frozen=True)
class Machine:
    """What the choice depends on (tests build fake ones)."""

    cpus: int  # CPUs this process may run on
    host_cpus: int  # CPUs of the whole machine, whose load the load average counts
    load: float  # 1-minute load average
    runnable: int | None  # tasks runnable now, this process included; None if unknown
    local_ranks: int = 1  # processes of this torchrun job on this machine

    def busy_elsewhere(self) -> int:
        """CPUs of ours that other processes keep busy: the smaller of the load average and the tasks
        runnable now besides this one (the average lags a load that just ended), in our share of the host."""
        others = self.load if self.runnable is None else min(self.load, max(self.runnable - 1, 0))
        return min(int(others * self.cpus / max(self.host_cpus, self.cpus) + 0.5), self.cpus)


def read_machine(env: Mapping[str, str] = os.environ) -> Machine:
    cpus = len(_our_cpus())
    load, runnable = 0.0, None
    try:
        with open("/proc/loadavg") as file:
            fields = file.read().split()
        load, runnable = float(fields[0]), int(fields[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        with contextlib.suppress(OSError):
            load = os.getloadavg()[0]
    return Machine(cpus=cpus, host_cpus=os.cpu_count() or cpus, load=load, runnable=runnable,
                   local_ranks=_local_ranks(env))


def _local_ranks(env: Mapping[str, str]) -> int:
    """Ranks of this job on this machine: torchrun's LOCAL_WORLD_SIZE, else WORLD_SIZE (all here), else 1."""
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        value = _whole_number(env.get(name))
        if value is not None:
            return value
    return 1


def _whole_number(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value >= 1 else None


@dataclass(frozen=True)
class Choice:
    threads: int | None  # None: whatever torch has (the environment's value was not a plain count)
    wait: str  # how idle threads wait, e.g. "OMP_WAIT_POLICY=PASSIVE"
    why: str
    env: dict[str, str] = field(default_factory=dict)  # what lmcli sets before torch loads
    follows_load: bool = False  # lmcli chose the count alone: recheck() may move it with the load
    note: str | None = None  # one line for stderr: the user's OMP_NUM_THREADS was not taken as it was

    def describe(self) -> str:
        count = "torch's default threads" if self.threads is None else \
            f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        follows = f"; re-checked every {RECHECK_S:g} s while generating" if self.follows_load else ""
        return f"{count}{' at the start' if self.follows_load else ''}, {self.wait} — {self.why}{follows}"


def _users(env: Mapping[str, str]) -> dict[str, str]:
    """The thread variables set by the user (not by lmcli, in this process or a parent)."""
    ours = set(env.get(SET_BY_LMCLI_VAR, "").split(","))
    return {name: env[name] for name in (THREADS_VAR, *WAIT_VARS) if name in env and name not in ours}


def _wait_text(env: Mapping[str, str]) -> str:
    set_ = [f"{name}={env[name]}" for name in WAIT_VARS if name in env]
    return ", ".join(set_) or "libgomp's default wait (spins, then sleeps)"


def choose(machine: Machine, env: Mapping[str, str], requested: int | None = None,
           torch_threads: int | None = None) -> Choice:
    """The settings for this machine; `torch_threads` is torch's thread count if torch is already loaded."""
    users = _users(env)
    if torch_threads is not None:  # libgomp has read its environment already
        wait = _wait_text(env)
        if requested is not None:
            return Choice(requested, wait, "--threads (torch was loaded before lmcli, so its wait is as it was)")
        return Choice(torch_threads, wait, "torch was loaded before lmcli chose; its settings are the program's")
    env_out: dict[str, str] = {}
    busy = machine.busy_elsewhere()
    note = None
    if requested is None and THREADS_VAR in users:
        # libgomp takes a list ("4,2": nested levels); the first is torch's. Anything else is no count:
        # lmcli chooses instead, and sets the variable itself so libgomp never reads (and warns about) it.
        given = users[THREADS_VAR]
        count = _whole_number(given.split(",")[0].strip())
        if count is None:
            note = f"note: {THREADS_VAR}={given!r} is not a number of threads; lmcli chooses the count"
            users = {name: value for name, value in users.items() if name != THREADS_VAR}
        elif count > machine.host_cpus:  # torch itself runs no more from the variable: say what runs
            note = (f"note: {THREADS_VAR}={given} is more than this machine's {machine.host_cpus} CPUs, which torch "
                    f"caps it at; using {machine.host_cpus}")
            requested = machine.host_cpus
    if requested is not None:
        threads: int | None = requested
        why = "--threads" if note is None else f"{THREADS_VAR}={users[THREADS_VAR]} from the environment, " \
                                               f"brought down to the CPUs"
    elif THREADS_VAR in users:
        threads = _whole_number(users[THREADS_VAR].split(",")[0].strip())
        why = f"{THREADS_VAR}={users[THREADS_VAR]} from the environment"
    else:
        if machine.local_ranks > 1:
            free = machine.cpus - max(busy - (machine.local_ranks - 1), 0)  # the other ranks are not "elsewhere"
            threads = max(free // machine.local_ranks, 1)
            why = (f"{machine.local_ranks} ranks on this machine share {machine.cpus} CPUs"
                   f"{f' ({busy} busy)' if busy else ''}: {threads} each")
        else:
            threads = max(machine.cpus - busy, 1)
            why = (f"{machine.cpus} CPUs for this process, {busy} busy elsewhere "
                   f"(load {machine.load:.2f}{'' if machine.runnable is None else f', {machine.runnable} runnable'})")
    if threads is not None and (requested is not None or THREADS_VAR not in users):
        env_out[THREADS_VAR] = str(threads)
    follows_load = requested is None and THREADS_VAR not in users and machine.local_ranks == 1
    if any(name in users for name in WAIT_VARS):
        wait = f"{_wait_text(users)} from the environment"
    elif not follows_load and (busy or machine.local_ranks > 1):
        env_out.update(WAIT_CHOICE)
        wait = f"{_wait_text(WAIT_CHOICE)} (a fixed count beside busy CPUs: idle threads sleep at once)"
    else:
        # No more threads than free cores (re-checked while generating): libgomp's spin-then-sleep decodes
        # the default model 1.6-2x faster than sleeping at once (tools/thread_settings.py).
        wait = _wait_text({})
    return Choice(threads, wait, why, env_out, follows_load, note)


def threads_for_window(cpus: int, threads: int, others: float) -> int:
    """The thread count after a window in which other processes used `others` CPUs' worth of our `cpus`
    while we ran `threads`: fewer as soon as a core is taken (a thread on it stalls every barrier), more
    only once a core is clearly free (a busy loop beside 2 spinning threads on 2 cores gets ~0.67 CPU)."""
    free = cpus - others
    if free < threads - 0.5:
        return max(int(free + 0.5), 1)
    if free >= threads + 0.75:
        return min(int(free + 0.25), cpus)
    return threads


def threads_for_tasks(cpus: int, host_cpus: int, running_elsewhere: int) -> int:
    """The thread count from the other tasks running this instant (after a pause), in our share of the host."""
    busy = min(int(running_elsewhere * cpus / max(host_cpus, cpus) + 0.5), cpus)
    return max(cpus - busy, 1)


@dataclass
class LoadReaders:
    """Where a LoadFollower reads the machine and torch (tests give fakes)."""

    cpu_busy: Callable[[], float | None]  # CPU-seconds our CPUs have been busy since boot, every process's work
    running_elsewhere: Callable[[], int | None]  # tasks running this instant that are not this process's threads
    get_threads: Callable[[], int | None]  # torch's thread count; None: torch is not loaded
    set_threads: Callable[[int], None]
    own_cpu: Callable[[], float] = time.process_time  # CPU-seconds this process has used, all its threads
    clock: Callable[[], float] = time.monotonic


def _system_readers() -> LoadReaders:
    from lmcli import machine

    cpus = _our_cpus()

    def running_elsewhere() -> int | None:
        running = machine.running_tasks()
        return None if running is None else max(running - machine.own_running_threads(), 0)

    def get_threads() -> int | None:
        torch = sys.modules.get("torch")
        return None if torch is None else torch.get_num_threads()

    return LoadReaders(cpu_busy=lambda: machine.cpu_busy_seconds(cpus), running_elsewhere=running_elsewhere,
                       get_threads=get_threads, set_threads=lambda n: sys.modules["torch"].set_num_threads(n))


class LoadFollower:
    """Moves torch's thread count with the load while lmcli generates (see the module docstring)."""

    def __init__(self, cpus: int, host_cpus: int, threads: int, readers: LoadReaders):
        self.cpus, self.host_cpus, self.threads, self.readers = cpus, host_cpus, threads, readers
        self.last: tuple[float, float, float] | None = None  # (clock, CPUs busy, own CPU) at the last look
        self.due = float("-inf")
        self.called = float("-inf")  # clock at the last recheck() call
        self.paused = False  # a pause since the last look: the next one counts the tasks running then
        self.stopped: str | None = None  # why it no longer follows
        self.switches = 0

    def recheck(self, fresh: bool = False) -> None:
        """`fresh`: work starts now after a pause of unknown length (what the CPUs did during it is no
        guide); a gap of more than PAUSE_S since the last call counts as one too."""
        now = self.readers.clock()
        self.paused |= fresh or now - self.called > PAUSE_S
        self.called = now
        if now < self.due or self.stopped:
            return
        self.due = now + RECHECK_S
        in_torch = self.readers.get_threads()
        if in_torch is None:
            return
        if in_torch != self.threads:  # the program set its own count (or this thread never saw ours)
            self.stopped = f"torch's thread count was set to {in_torch} by the program"
            return
        busy, own = self.readers.cpu_busy(), self.readers.own_cpu()
        if busy is None:
            self.stopped = "the CPUs' busy time cannot be read"
            return
        if self.paused or self.last is None:
            running = self.readers.running_elsewhere()
            target = self.threads if running is None else threads_for_tasks(self.cpus, self.host_cpus, running)
            self.due = now + FIRST_WINDOW_S
        else:
            then, busy_then, own_then = self.last
            others = max((busy - busy_then) - (own - own_then), 0.0) / max(now - then, 1e-6)
            target = threads_for_window(self.cpus, self.threads, others)
        self.last, self.paused = (now, busy, own), False
        if target != self.threads:
            self.readers.set_threads(target)
            self.threads = target
            self.switches += 1

    def forget(self) -> None:
        """After a fork: the child's own CPU time starts again, so the last look is not comparable."""
        self.last, self.due, self.paused = None, float("-inf"), True


def _our_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


_current: Choice | None = None
_follower: LoadFollower | None = None


def recheck(fresh: bool = False) -> None:
    """Let the thread count follow the load: call at every decode step of any loop (`fresh` at the first
    step of a call; a gap over PAUSE_S between calls counts as a pause too): after a pause the look counts
    the tasks running that instant rather than the CPU time since the last look. Costs a clock read, plus
    a look at /proc (30-110 us) at most every RECHECK_S; does nothing unless lmcli chose the count alone."""
    if _follower is not None:
        _follower.recheck(fresh)


def follower() -> LoadFollower | None:
    """The object moving the thread count with the load (None when the count is fixed)."""
    return _follower


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _follower.forget() if _follower is not None else None)


def configure(requested: int | None = None, env: MutableMapping[str, str] = os.environ) -> Choice:
    """Choose and apply the thread settings (call before torch loads); a later call without `requested`
    returns the first choice. With torch loaded, only `requested` changes anything (torch.set_num_threads)."""
    global _current, _follower
    if requested is None and _current is not None:
        return _current
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    machine = read_machine(env)
    choice = choose(machine, env, requested, torch_threads)
    if torch is not None:
        if requested is not None:
            torch.set_num_threads(requested)
    else:
        if choice.note is not None:
            sys.stderr.write(choice.note + "\n")
        ours = {name for name in env.get(SET_BY_LMCLI_VAR, "").split(",") if name}
        for name in ours - set(choice.env):  # an earlier choice of lmcli's that this one does not make
            env.pop(name, None)
        env.update(choice.env)
        if choice.env:
            env[SET_BY_LMCLI_VAR] = ",".join(sorted(choice.env))
        else:
            env.pop(SET_BY_LMCLI_VAR, None)
    _current = choice
    _follower = None
    if choice.follows_load and choice.threads is not None:
        _follower = LoadFollower(machine.cpus, machine.host_cpus, choice.threads, _system_readers())
    return choice


def describe() -> str:
    """What was chosen and why, one line (`lmcli info`)."""
    return (_current or configure()).describe()


def signature() -> str:
    """The settings in effect, for keys of things measured under them (the kernel plans): torch's
    thread count and how its threads wait."""
    import torch

    return f"threads={torch.get_num_threads()}, {_wait_text(os.environ)}"
