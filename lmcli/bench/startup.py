"""`lmcli bench --sections startup`: how long an answer takes to start, as whole processes.

Each figure is a fresh process, timed from its start to its exit, the runs of all kinds interleaved
(round after round) so that load from other processes falls on each alike; the median is reported:
  import torch           `python -c "import torch"`, the floor every lmcli start pays
  lmcli, from the GGUF   `lmcli generate --greedy -n 1` with the packed cache off (LMCLI_PACKED_CACHE=0):
                         every start decodes, packs and joins the weights and reads the vocabulary
  lmcli, packed entry    the same with the entry an earlier start wrote (io/packed_cache.py)
  first start            the same with an empty cache: loads from the GGUF and writes the entry (once)
  llama.cpp              llama-cpp-python loading the same file and generating one token, if installed
With one new token the process ends right after its first token: its time is the time to first token.
Prefill (tokens per second over `prefill_tokens`) is measured in this process, eager, from the entry.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"

_LLAMA_CPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False, n_threads=int(sys.argv[3]) or None)
llm(sys.argv[2], max_tokens=1, temperature=0.0)
"""


def _timed(command: list[str], env: dict[str, str]) -> float | None:
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, timeout=900)
    took = time.perf_counter() - start
    return took if result.returncode == 0 else None


def measure(settings: Any, resolved: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    path = str(resolved.path) if resolved.path is not None else None
    model_flag = ["-c", path] if path else []
    threads = str(settings.threads or 0)
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-startup-") as scratch:
        base = {**os.environ, "LMCLI_CACHE_DIR": str(Path(scratch) / "cache")}
        if settings.threads:
            base["OMP_NUM_THREADS"] = threads
        generate = [sys.executable, "-m", "lmcli", "generate", *model_flag, "--greedy", "-n", "1", PROMPT]
        runs: dict[str, tuple[list[str], dict[str, str]]] = {
            "import torch": ([sys.executable, "-c", "import torch"], base),
            "lmcli, from the GGUF": (generate, {**base, "LMCLI_PACKED_CACHE": "0"}),
            "lmcli, packed entry": (generate, {**base, "LMCLI_PACKED_CACHE": "1"}),
        }
        if path and path.endswith(".gguf"):
            try:
                import llama_cpp  # noqa: F401
                runs["llama.cpp (llama-cpp-python)"] = ([sys.executable, "-c", _LLAMA_CPP, path, PROMPT, threads], base)
            except ImportError:
                pass
        progress("start-up: first start (writes the packed entry)")
        first = _timed(generate, {**base, "LMCLI_PACKED_CACHE": "1"})
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        rounds = max(3, settings.repeats)
        for round_ in range(rounds):
            for name, (command, env) in runs.items():
                progress(f"start-up: {name}, round {round_ + 1}/{rounds}")
                took = _timed(command, env)
                if took is not None:
                    seconds[name].append(took)
        prefill = _prefill(resolved, settings.prefill_tokens, base["LMCLI_CACHE_DIR"], progress)
    medians = {name: statistics.median(values) for name, values in seconds.items() if values}
    return {"rounds": rounds, "seconds": medians, "first_start": first, "prefill": prefill,
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "cpus": os.cpu_count()}


def _prefill(resolved: Any, tokens: int, cache: str, progress: Callable[[str], None]) -> dict[str, float]:
    """Prefill tokens per second at batch 1, eager, median of three, in this process (model from the entry)."""
    import torch

    import lmcli

    progress(f"start-up: prefill of {tokens} tokens")
    saved = os.environ.get("LMCLI_CACHE_DIR")
    os.environ["LMCLI_CACHE_DIR"] = cache
    try:
        model, _ = lmcli.load(resolved)
    finally:
        if saved is None:
            os.environ.pop("LMCLI_CACHE_DIR", None)
        else:
            os.environ["LMCLI_CACHE_DIR"] = saved
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        model.forward(ids[:, :16])  # first calls map pages and warm the kernels
        for _ in range(3):
            start = time.perf_counter()
            model.forward(ids)
            times.append(time.perf_counter() - start)
    return {"tokens": tokens, "tokens_per_second": tokens / statistics.median(times)}


def report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    seconds = result["seconds"]
    floor = seconds.get("import torch")
    table = Table(title=f"Start-up, whole processes (median of {result['rounds']} interleaved rounds; "
                        f"load {result['load_average'] or 0:.1f} on {result['cpus']} CPUs)")
    for column in ("run", "seconds", "beyond import torch"):
        table.add_column(column, justify="left" if column == "run" else "right")
    rows = dict(seconds)
    if result.get("first_start") is not None:
        rows["first start (writes the packed entry)"] = result["first_start"]
    for name, value in rows.items():
        ours = name.startswith(("lmcli", "first"))  # "beyond import torch" means nothing for llama.cpp
        beyond = f"{value - floor:.2f}" if floor is not None and ours else ""
        table.add_row(name, f"{value:.2f}", beyond)
    console.print(table)
    prefill = result["prefill"]
    console.print(f"prefill, {prefill['tokens']} tokens at batch 1 (eager, int4 kernels): "
                  f"{prefill['tokens_per_second']:.0f} tok/s")
