"""Where lmcli keeps what it writes: one cache directory (`LMCLI_CACHE_DIR`, else ~/.cache/lmcli).

It holds downloaded or assembled models, the dequantised copies `--quantize none` reuses, the measured
kernel choices (kernels.json) and the benchmark's converted references. A module of its own so that
low layers (kernels/plan.py) can find it without importing the default-model machinery.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("LMCLI_CACHE_DIR") or Path.home() / ".cache" / "lmcli").expanduser()
