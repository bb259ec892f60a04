"""`lmcli bench --sections compiled`: the cached compiled decode step against eager decoding, at batch 1.

Each figure comes from a fresh process on a scratch lmcli cache:
  build        the first `--compile` process: the decode step exported and compiled (once per model,
               machine and batch size), timed around its first decode step
  load         a later process: the entry checked and loaded, timed the same way
  decode       tok/s of `new_tokens` greedy steps after a short prompt, eager and compiled processes
               interleaved (`repeats` rounds, median), and whether their tokens are the same
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"

_CHILD = """
import json, sys, time
import torch
import lmcli
path, compiled, n = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
model, tokenizer = lmcli.load(path or None)
ids = torch.tensor([tokenizer.encode(sys.argv[4])])
model.generate(ids, 2, False)  # first calls map pages and warm the kernels
first_step = None
if compiled:
    model.compile_decode()
    start = time.perf_counter()
    model.generate(ids, 2, False)  # prefill (eager) and one step: the program is built or loaded here
    first_step = time.perf_counter() - start
def timed(new):
    start = time.perf_counter()
    out = model.generate(ids, new, False)
    return time.perf_counter() - start, out
prefill, _ = timed(1)
took, out = timed(n + 1)
print(json.dumps({"first_step_s": first_step, "tokens_per_second": n / max(took - prefill, 1e-9),
                  "tokens": out[0].tolist()}))
"""


def _child(path: str, compiled: bool, tokens: int, env: dict[str, str]) -> dict[str, Any] | None:
    result = subprocess.run([sys.executable, "-c", _CHILD, path, "1" if compiled else "0", str(tokens), PROMPT],
                            env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0 or not result.stdout.strip():
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(settings: Any, resolved: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    path = str(resolved.path) if resolved.path is not None else ""
    tokens = max(settings.new_tokens, 16)
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-compiled-") as scratch:
        env = {**os.environ, "LMCLI_CACHE_DIR": str(Path(scratch) / "cache")}
        if settings.threads:
            env["OMP_NUM_THREADS"] = str(settings.threads)
        progress("compiled: first process (builds the decode step; minutes)")
        built = _child(path, True, tokens, env)
        progress("compiled: a later process (loads it)")
        loaded = _child(path, True, tokens, env)
        runs: dict[str, list[dict[str, Any]]] = {"eager": [], "compiled": []}
        for round_ in range(settings.repeats):
            for name in runs:
                progress(f"compiled: {name} decode, round {round_ + 1}/{settings.repeats}")
                got = _child(path, name == "compiled", tokens, env)
                if got is not None:
                    runs[name].append(got)
    rates = {name: statistics.median(r["tokens_per_second"] for r in got) for name, got in runs.items() if got}
    same = bool(runs["eager"] and runs["compiled"]) and all(
        r["tokens"] == runs["eager"][0]["tokens"] for r in runs["eager"] + runs["compiled"])
    return {"build_s": built and built["first_step_s"], "load_s": loaded and loaded["first_step_s"],
            "tokens": tokens, "tokens_per_second": rates, "same_tokens": same, "rounds": settings.repeats,
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "cpus": os.cpu_count()}


def report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"Compiled decode step at batch 1 (fresh processes, {result['tokens']} greedy tokens, "
                        f"median of {result['rounds']}; load {result['load_average'] or 0:.1f} on {result['cpus']} CPUs)")
    for column in ("", "seconds / tok/s"):
        table.add_column(column, justify="left" if not column else "right")

    def seconds(value: float | None) -> str:
        return "failed" if value is None else f"{value:.2f} s"

    table.add_row("build (first process: prefill, one step and the build)", seconds(result["build_s"]))
    table.add_row("load (later processes: prefill, one step and the load)", seconds(result["load_s"]))
    rates = result["tokens_per_second"]
    for name in ("eager", "compiled"):
        table.add_row(f"decode, {name}", f"{rates[name]:.1f} tok/s" if name in rates else "failed")
    if "eager" in rates and "compiled" in rates:
        table.add_row("compiled / eager", f"{rates['compiled'] / rates['eager']:.2f}x")
    table.add_row("same greedy tokens", "yes" if result["same_tokens"] else "NO")
    console.print(table)
