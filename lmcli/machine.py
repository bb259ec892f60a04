"""What this machine's CPU is (/proc/cpuinfo) and how busy its CPUs are now (/proc/stat, /proc/loadavg);
Linux only: elsewhere nothing is known."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path


def cpu_model_and_flags() -> tuple[str | None, set[str]]:
    """The first CPU's model name and feature flags (avx2, amx_tile, ...); (None, set()) when unknown."""
    model: str | None = None
    flags: set[str] = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, flags


# --- how busy the CPUs are now (lmcli.threads re-checks its thread count with these) -----------------

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_busy_seconds(cpus: Collection[int]) -> float | None:
    """CPU-seconds the given CPUs have spent on anything but idling since boot, by every process
    (/proc/stat: user, nice, system, irq, softirq and steal, which a hypervisor gave to others); None if unknown."""
    wanted = {f"cpu{cpu}" for cpu in cpus}
    try:
        with open("/proc/stat") as file:
            lines = [line.split() for line in file if line.startswith("cpu")]
        ticks = sum(sum(map(int, (*f[1:4], *f[6:9]))) for f in lines if f[0] in wanted)
    except (OSError, ValueError):
        return None
    return ticks / _TICKS_PER_SECOND


def running_tasks() -> int | None:
    """Tasks of the whole host running or ready to run this instant, this process's included (/proc/loadavg)."""
    try:
        with open("/proc/loadavg") as file:
            return int(file.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def own_running_threads() -> int:
    """This process's threads running or ready to run this instant (at least the caller)."""
    running = 0
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            running += stat.read_text().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return max(running, 1)
