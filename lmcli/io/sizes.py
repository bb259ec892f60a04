"""Byte counts as people read them (what the caches, downloads and listings print)."""

from __future__ import annotations

# The prompt cache's settings (io/prompt_blocks.py), here so that the command line reads them without torch.
from lmcli.paths import PROMPT_CACHE_ENV as PROMPT_CACHE_ENV  # a directory, or "off"

PROMPT_CACHE_SIZE_ENV = "LMCLI_PROMPT_CACHE_SIZE"  # bytes, or with a unit: 512M, 2G
VERBOSE_ENV = "LMCLI_VERBOSE"  # "1": notes about caches (an entry not used, and why)


def human_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


def parse_size(text: str) -> int:
    """`2G`, `512M`, `100k`, `12345` -> bytes; ValueError otherwise."""
    text = text.strip()
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    scale = 1
    if text and text[-1].lower() in units:
        scale = units[text[-1].lower()]
        text = text[:-1]
    elif text.lower().endswith(("kb", "mb", "gb", "tb", "ib")):
        raise ValueError("give a size as a number with an optional K, M, G or T")
    value = float(text)
    if not value >= 0 or value * scale > 2**62:
        raise ValueError("a size must be a number >= 0")
    return int(value * scale)
