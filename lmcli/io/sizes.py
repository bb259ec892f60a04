"""Byte counts as people read them (what the caches, downloads and listings print)."""

from __future__ import annotations


def human_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"
