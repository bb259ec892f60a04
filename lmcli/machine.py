"""What this machine's CPU is, as /proc/cpuinfo says (Linux; elsewhere nothing is known)."""

from __future__ import annotations

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
