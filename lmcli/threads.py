"""How many threads torch uses and how its OpenMP threads wait, chosen for the machine as it is.

OpenMP threads that spin at every barrier while another process holds their core wait for the
scheduler instead of working: with one of two cores busy elsewhere, decoding with torch's defaults
(all cores, libgomp's long spin) ran 12-18x slower than with passive waiting. So before torch loads
(libgomp reads its environment once, when torch's import loads it), `configure()` sets:

- OMP_NUM_THREADS: the CPUs this process may use (sched_getaffinity) less those other processes
  keep busy (the load average, or the tasks runnable now if fewer; at least 1). Under torchrun the
  ranks on this machine share the CPUs, so that ranks x threads never exceeds them.
- OMP_WAIT_POLICY=PASSIVE when a CPU is busy elsewhere at the start (or torchrun ranks share the
  machine): an idle thread sleeps at once rather than spinning. On a quiet machine libgomp's default
  (spin, then sleep) is kept: it decodes much faster there (measured quiet and beside a busy core with
  tools/thread_settings.py: see the README).

The user wins: `--threads N` over everything, then OMP_NUM_THREADS / OMP_WAIT_POLICY / GOMP_SPINCOUNT
from the environment (a wait variable the user set means lmcli sets neither). If torch was imported
before lmcli could choose (a program that imported it first), only an explicit `--threads` is applied:
the wait behaviour is already fixed and the thread count is the program's own.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

THREADS_VAR = "OMP_NUM_THREADS"
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
WAIT_CHOICE = {"OMP_WAIT_POLICY": "PASSIVE"}
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
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
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

    def describe(self) -> str:
        count = "torch's default threads" if self.threads is None else \
            f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        return f"{count}, {self.wait} — {self.why}"


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
    if requested is not None:
        threads: int | None = requested
        why = "--threads"
    elif THREADS_VAR in users:
        threads = _whole_number(users[THREADS_VAR].split(",")[0])
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
    if any(name in users for name in WAIT_VARS):
        wait = f"{_wait_text(users)} from the environment"
    elif busy or machine.local_ranks > 1:
        env_out.update(WAIT_CHOICE)
        wait = f"{_wait_text(WAIT_CHOICE)} (idle threads sleep: a spinning one can stall on a taken core)"
    else:
        # A quiet machine: libgomp's spin-then-sleep decodes the default model 1.6x faster than sleeping
        # at once (55 against 34 tok/s at 2 threads, tools/thread_settings.py); a core taken only after
        # the start can still slow it, as it did before lmcli chose.
        wait = f"{_wait_text({})} (no CPU busy elsewhere at the start)"
    return Choice(threads, wait, why, env_out)


_current: Choice | None = None


def configure(requested: int | None = None, env: MutableMapping[str, str] = os.environ) -> Choice:
    """Choose and apply the thread settings (call before torch loads); a later call without `requested`
    returns the first choice. With torch loaded, only `requested` changes anything (torch.set_num_threads)."""
    global _current
    if requested is None and _current is not None:
        return _current
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    choice = choose(read_machine(env), env, requested, torch_threads)
    if torch is not None:
        if requested is not None:
            torch.set_num_threads(requested)
    else:
        ours = {name for name in env.get(SET_BY_LMCLI_VAR, "").split(",") if name}
        for name in ours - set(choice.env):  # an earlier choice of lmcli's that this one does not make
            env.pop(name, None)
        env.update(choice.env)
        if choice.env:
            env[SET_BY_LMCLI_VAR] = ",".join(sorted(choice.env))
        else:
            env.pop(SET_BY_LMCLI_VAR, None)
    _current = choice
    return choice


def describe() -> str:
    """What was chosen and why, one line (`lmcli info`)."""
    return (_current or configure()).describe()


def signature() -> str:
    """The settings in effect, for keys of things measured under them (the kernel plans): torch's
    thread count and how its threads wait."""
    import torch

    return f"threads={torch.get_num_threads()}, {_wait_text(os.environ)}"
