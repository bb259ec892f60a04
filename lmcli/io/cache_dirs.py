"""The caches lmcli keeps under its cache directory, for `lmcli cache`: what each holds and how big it
is, and emptying them. Torch-free: it only walks directories.

- packed: GGUF models as loaded, mapped at the next start (io/packed_cache.py);
- compiled: compiled decode steps and the record of those that failed (io/compiled_cache.py);
- prompts: the prompt cache's blocks of keys and values (io/prompt_blocks.py; --prompt-cache DIR moves it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from lmcli.paths import cache_dir, prompt_cache_dir

KINDS = ("packed", "compiled", "prompts")
WHAT = {"packed": "packed weights", "compiled": "compiled programs", "prompts": "prompt blocks"}


@dataclass(frozen=True)
class CacheUse:
    kind: str
    directory: Path | None  # None: turned off (the prompt cache with LMCLI_PROMPT_CACHE=off)
    files: int
    bytes: int


def directory_of(kind: str) -> Path | None:
    if kind == "prompts":
        return prompt_cache_dir()
    return cache_dir() / kind


def usage(kind: str) -> CacheUse:
    """How many files, and bytes, the cache `kind` holds (temporaries and records included)."""
    directory = directory_of(kind)
    files = size = 0
    if directory is not None and directory.is_dir():
        for parent, _, names in os.walk(directory):
            for name in names:
                with contextlib.suppress(OSError):
                    size += os.lstat(os.path.join(parent, name)).st_size
                    files += 1
    return CacheUse(kind, directory, files, size)


def clear(kind: str) -> CacheUse:
    """Empty the cache `kind` (its directory removed; the next run makes it again); what it held."""
    held = usage(kind)
    if held.directory is not None and held.directory.is_dir():
        shutil.rmtree(held.directory, ignore_errors=True)  # a file another process is writing may stay
    return held
