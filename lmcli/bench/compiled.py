"""`lmcli bench --sections compiled`: the cached compiled decode step against eager decoding, at each of
the bench's batch sizes (1 and 8 by default; a batch is the prompt repeated).

Each figure comes from a fresh process on a scratch lmcli cache:
  build        the first `--compile` process: the decode step exported and compiled (once per model,
               machine and batch size), timed around its first decode step
  load         a later process: the entry checked and loaded, timed the same way
  decode       tok/s of `new_tokens` greedy steps after a short prompt (tokens of all rows), eager and
               compiled processes interleaved (`repeats` rounds, median), and whether their tokens are the same
  peak RSS     the largest VmHWM of those processes, eager and compiled
  llama.cpp    at batch 1, where llama-cpp-python is importable and the model is a GGUF file: the same
               prompt and greedy steps in its own fresh process, in the same rounds (every CPU, as the
               engines bench runs it), so compiled, eager and llama.cpp are measured interleaved
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


_LLAMA_CPP_CHILD = """
import json, os, sys, time
import numpy as np
import llama_cpp
path, n = sys.argv[1], int(sys.argv[2])
threads = len(os.sched_getaffinity(0))
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads,
                      n_gpu_layers=0, verbose=False)
prompt = llm.tokenize(sys.argv[3].encode(), add_bos=True)
def run(new):
    llm.reset()
    llm.eval(prompt)
    start, out = time.perf_counter(), []
    for _ in range(new):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return time.perf_counter() - start
run(2)  # first calls map pages and warm the kernels
print(json.dumps({"tokens_per_second": n / run(n)}))
"""


def _llama_cpp_child(path: str, tokens: int, env: dict[str, str]) -> dict[str, Any] | None:
    return _figures(_LLAMA_CPP_CHILD, [path, str(tokens), PROMPT], env, timeout=600)


def _has_llama_cpp(path: str) -> bool:
    import importlib.util

    return path.endswith(".gguf") and importlib.util.find_spec("llama_cpp") is not None


def _child(path: str, compiled: bool, tokens: int, env: dict[str, str], batch: int) -> dict[str, Any] | None:
    return _figures(_CHILD, [path, "1" if compiled else "0", str(tokens), PROMPT, str(batch)], env, timeout=3600)


def _figures(script: str, args: list[str], env: dict[str, str], timeout: int) -> dict[str, Any] | None:
    """The JSON object `script` prints last, run in a fresh process; None where it failed."""
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                            timeout=timeout)
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
            llama_cpp: list[dict[str, Any]] = []
            for round_ in range(settings.repeats):
                for name in runs:
                    progress(f"compiled: batch {batch}, {name} decode, round {round_ + 1}/{settings.repeats}")
                    got = _child(path, name == "compiled", tokens, env, batch)
                    if got is not None:
                        runs[name].append(got)
                if batch == 1 and _has_llama_cpp(path):
                    progress(f"compiled: batch 1, llama.cpp decode, round {round_ + 1}/{settings.repeats}")
                    theirs = _llama_cpp_child(path, tokens, env)
                    if theirs is not None:
                        llama_cpp.append(theirs)
            rates = {name: statistics.median(r["tokens_per_second"] for r in got) for name, got in runs.items() if got}
            if llama_cpp:
                rates["llama.cpp"] = statistics.median(r["tokens_per_second"] for r in llama_cpp)
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
                   "llama.cpp tok/s", "compiled / llama.cpp", "peak RSS MiB eager / compiled", "same greedy tokens"):
        table.add_column(column, justify="right")

    def seconds(value: float | None) -> str:
        return "failed" if value is None else f"{value:.2f}"

    for batch, got in sorted(result["batches"].items(), key=lambda item: int(item[0])):
        rates, peaks = got["tokens_per_second"], got["peak_rss_mib"]
        ratio = f"{rates['compiled'] / rates['eager']:.2f}x" if "eager" in rates and "compiled" in rates else ""
        theirs = rates.get("llama.cpp")
        against = f"{rates['compiled'] / theirs:.2f}x" if theirs and "compiled" in rates else ""
        table.add_row(str(batch), seconds(got["build_s"]), seconds(got["load_s"]),
                      *(f"{rates[name]:.1f}" if name in rates else "failed" for name in ("eager", "compiled")), ratio,
                      f"{theirs:.1f}" if theirs else "-", against,
                      " / ".join(f"{peaks[name]:.0f}" if name in peaks else "-" for name in ("eager", "compiled")),
                      "yes" if got["same_tokens"] else "NO")
    console.print(table)
