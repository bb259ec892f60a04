"""Where lmcli keeps what it writes: one cache directory (`LMCLI_CACHE_DIR`, else ~/.cache/lmcli).

It holds downloaded or assembled models, prompt blocks (the prompt cache, prompts/), the dequantised copies `--quantize none` reuses, the measured
kernel choices (kernels.json) and the benchmark's converted references. A module of its own so that
low layers (kernels/plan.py) can find it without importing the default-model machinery.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("LMCLI_CACHE_DIR") or Path.home() / ".cache" / "lmcli").expanduser()


PROMPT_CACHE_ENV = "LMCLI_PROMPT_CACHE"  # a directory for the prompt cache's blocks, or "off"


def prompt_cache_dir() -> Path | None:
    """Where prompt blocks are kept between runs (io/prompt_blocks.py): LMCLI_PROMPT_CACHE (a directory,
    or "off"), else the cache directory's prompts/."""
    choice = os.environ.get(PROMPT_CACHE_ENV, "").strip()
    if choice.lower() in ("off", "0", "none"):
        return None
    return Path(choice).expanduser() if choice else cache_dir() / "prompts"
