"""`lmcli bench --sections compiled`: the cached compiled decode step against eager decoding, at each of
the bench's batch sizes (1 and 8 by default; a batch is the prompt repeated).

Each figure comes from a fresh process on a scratch lmcli cache:
  build        the first `--compile` process: the decode step exported and compiled (once per model,
               machine and batch size), timed around its first decode step
  load         a later process: the entry checked and loaded, timed the same way
  decode       tok/s of `new_tokens` greedy steps after a short prompt (tokens of all rows), eager and
               compiled processes interleaved (`repeats` rounds, median), and whether their tokens are the same
  peak RSS     the largest VmHWM of those processes, eager and compiled
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
path, compiled, n, batch = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[5])
model, tokenizer = lmcli.load(path or None)
ids = torch.tensor([tokenizer.encode(sys.argv[4])] * batch)
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
peak = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print(json.dumps({"first_step_s": first_step, "tokens_per_second": batch * n / max(took - prefill, 1e-9),
                  "tokens": out.tolist(), "peak_rss_mib": peak[0] / 1024 if peak else None}))
"""


def _child(path: str, compiled: bool, tokens: int, env: dict[str, str], batch: int) -> dict[str, Any] | None:
    result = subprocess.run([sys.executable, "-c", _CHILD, path, "1" if compiled else "0", str(tokens), PROMPT,
                             str(batch)],
                            env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0 or not result.stdout.strip():
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(settings: Any, resolved: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    path = str(resolved.path) if resolved.path is not None else ""
    tokens = max(settings.new_tokens, 16)
    batches: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-compiled-") as scratch:
        env = {**os.environ, "LMCLI_CACHE_DIR": str(Path(scratch) / "cache"), "LMCLI_COMPILE": "0"}
        if settings.threads:
            env["OMP_NUM_THREADS"] = str(settings.threads)
        for batch in sorted(set(settings.batch_sizes)):
            progress(f"compiled: batch {batch}, first process (builds the decode step; a minute or more)")
            built = _child(path, True, tokens, env, batch)
            progress(f"compiled: batch {batch}, a later process (loads it)")
            loaded = _child(path, True, tokens, env, batch)
            runs: dict[str, list[dict[str, Any]]] = {"eager": [], "compiled": []}
            for round_ in range(settings.repeats):
                for name in runs:
                    progress(f"compiled: batch {batch}, {name} decode, round {round_ + 1}/{settings.repeats}")
                    got = _child(path, name == "compiled", tokens, env, batch)
                    if got is not None:
                        runs[name].append(got)
            rates = {name: statistics.median(r["tokens_per_second"] for r in got) for name, got in runs.items() if got}
            peaks = {name: max((r["peak_rss_mib"] or 0) for r in got) for name, got in runs.items() if got}
            same = bool(runs["eager"] and runs["compiled"]) and all(
                r["tokens"] == runs["eager"][0]["tokens"] for r in runs["eager"] + runs["compiled"])
            batches[batch] = {"build_s": built and built["first_step_s"], "load_s": loaded and loaded["first_step_s"],
                              "tokens_per_second": rates, "peak_rss_mib": peaks, "same_tokens": same}
    return {"batches": batches, "tokens": tokens, "rounds": settings.repeats,
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "cpus": os.cpu_count()}


def report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"Compiled decode step (fresh processes, {result['tokens']} greedy tokens a row, "
                        f"median of {result['rounds']}; load {result['load_average'] or 0:.1f} on {result['cpus']} CPUs)")
    for column in ("batch", "build s", "load s", "eager tok/s", "compiled tok/s", "compiled / eager",
                   "peak RSS MiB eager / compiled", "same greedy tokens"):
        table.add_column(column, justify="right")

    def seconds(value: float | None) -> str:
        return "failed" if value is None else f"{value:.2f}"

    for batch, got in sorted(result["batches"].items(), key=lambda item: int(item[0])):
        rates, peaks = got["tokens_per_second"], got["peak_rss_mib"]
        ratio = f"{rates['compiled'] / rates['eager']:.2f}x" if "eager" in rates and "compiled" in rates else ""
        table.add_row(str(batch), seconds(got["build_s"]), seconds(got["load_s"]),
                      *(f"{rates[name]:.1f}" if name in rates else "failed" for name in ("eager", "compiled")), ratio,
                      " / ".join(f"{peaks[name]:.0f}" if name in peaks else "-" for name in ("eager", "compiled")),
                      "yes" if got["same_tokens"] else "NO")
    console.print(table)
