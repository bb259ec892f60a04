"""`lmcli bench --sections prefill`: the compiled prefill chunks against eager prefill, at batch 1
(installed here whether or not `compile_decode` would install them on this CPU: see compiled_prefill.pays_here).

One child process on a scratch lmcli cache loads the model and prefills a random prompt of
`prefill_tokens` tokens (`generate(..., max_new_tokens=1)`: the time to the first token):
  build     the first prefill after `compile_decode()`: the chunk program exported and compiled
  prefill   tok/s eager, compiled, and eager in the program's chunks (what chunking alone costs), in
            interleaved rounds (`repeats`, median), in the same process
  logits    the last token's logits, compiled against eager: the largest difference against the
            largest logit, and whether the greedy token is the same
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

_CHILD = """
import json, sys, time
import torch
import lmcli
path, length, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, _ = lmcli.load(path or None)
from lmcli.generation.step import Step
step = Step.of(model)  # the decoding step every scheduler runs the model through
ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
def prefill():
    start = time.perf_counter()
    model.generate(ids, 1, False)
    return time.perf_counter() - start
def prefill_in_chunks():  # eager, in the program's chunks: what the chunking alone costs
    from lmcli.models.compiled_prefill import CHUNK
    cache = model.init_cache(1, length + 1)
    is_token = torch.ones(1, length + 1, dtype=torch.bool)
    start = time.perf_counter()
    with torch.inference_mode():
        step.prefill(ids, torch.arange(length)[None], torch.arange(length), is_token, cache, CHUNK)
    return time.perf_counter() - start
def last_logits():
    cache = model.init_cache(1, length)
    is_token = torch.ones(1, length, dtype=torch.bool)
    with torch.inference_mode():
        return step.prefill(ids, torch.arange(length)[None], torch.arange(length), is_token, cache)[0].float()
prefill()  # first calls map pages and warm the kernels
eager_logits = last_logits()
from lmcli.models.compiled_prefill import CachedPrefill
program = model._compiled_prefill = CachedPrefill(model)  # installed here even where compile_decode would not
build = prefill()
compiled_logits = last_logits()
times = {"eager": [], "compiled": [], "eager_chunked": []}
for _ in range(rounds):
    for name in times:
        model._compiled_prefill = program if name == "compiled" else None
        times[name].append(prefill_in_chunks() if name == "eager_chunked" else prefill())
used = program.runner is not None and not program.failed
print(json.dumps({"build_s": build, "used": used, "autotune": program.autotune, "eager_s": times["eager"], "compiled_s": times["compiled"],
                  "eager_chunked_s": times["eager_chunked"],
                  "max_difference": float((compiled_logits - eager_logits).abs().max()),
                  "largest_logit": float(eager_logits.abs().max()),
                  "same_token": bool(compiled_logits.argmax() == eager_logits.argmax()),
                  "threads": torch.get_num_threads()}))
"""


def measure(settings: Any, resolved: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    path = str(resolved.path) if resolved.path is not None else ""
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-prefill-") as scratch:
        env = {**os.environ, "LMCLI_CACHE_DIR": str(Path(scratch) / "cache")}
        if settings.threads:
            env["OMP_NUM_THREADS"] = str(settings.threads)
        progress(f"prefill: eager and compiled, {settings.prefill_tokens} tokens (the first build takes minutes)")
        run = subprocess.run([sys.executable, "-c", _CHILD, path, str(settings.prefill_tokens), str(settings.repeats)],
                             env=env, capture_output=True, text=True, timeout=3600)
    lines = run.stdout.strip().splitlines()
    result: dict[str, Any] = json.loads(lines[-1]) if run.returncode == 0 and lines else {
        "error": (run.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return {**result, "tokens": settings.prefill_tokens, "rounds": settings.repeats,
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "cpus": os.cpu_count()}


def report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"Compiled prefill at batch 1 ({result['tokens']} tokens, median of {result['rounds']} "
                        f"interleaved; load {result['load_average'] or 0:.1f} on {result['cpus']} CPUs)")
    for column in ("", "figure"):
        table.add_column(column, justify="left" if not column else "right")
    if "error" in result:
        table.add_row("failed", result["error"])
        console.print(table)
        return
    tokens = result["tokens"]
    build = result["build_s"]
    table.add_row("build (the first compiled prefill: export, compile, then the prefill)", f"{build:.1f} s")
    table.add_row("compiled program used", "yes" if result["used"] else "NO (eager)")
    table.add_row("int4 kernels chosen by inductor's autotuner (AMX here)", "yes" if result.get("autotune") else
                  "no: the eager kernel")
    names = {"eager": "eager", "eager_chunked": "eager in the program's chunks", "compiled": "compiled"}
    rates = {name: tokens / statistics.median(result[f"{name}_s"]) for name in names if result.get(f"{name}_s")}
    for name, rate in rates.items():
        table.add_row(f"prefill, {names[name]}", f"{rate:.1f} tok/s")
    table.add_row("compiled / eager", f"{rates['compiled'] / rates['eager']:.2f}x")
    if "eager_chunked" in rates:
        table.add_row("compiled / eager in the same chunks", f"{rates['compiled'] / rates['eager_chunked']:.2f}x")
    table.add_row("last logits: largest difference / largest logit",
                  f"{result['max_difference']:.3g} / {result['largest_logit']:.3g}")
    table.add_row("same greedy token", "yes" if result["same_token"] else "NO")
    table.add_row("threads", str(result["threads"]))
    console.print(table)
