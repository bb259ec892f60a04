"""The parts of `lmcli bench` beyond the engine comparison, each in its own module: a name -> where its
`measure` and `report` live. `lmcli bench --sections NAMES` picks them; "engines" is bench/main.py's own table
(prefill, decode, scaling, quality across lmcli, transformers and llama.cpp).

A section module provides:
    measure(settings: BenchSettings, resolved: ResolvedModel, progress: Callable[[str], None]) -> dict
        plain data (what --json prints under "sections"/NAME); it loads what it needs itself.
    report(result: dict, console: rich.console.Console) -> None
        prints its tables.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# name -> module (imported only when the section runs, so `lmcli --help` stays quick)
SECTIONS: dict[str, str] = {
    "engines": "lmcli.bench.main",
    "compiled": "lmcli.bench.compiled",  # the cached compiled decode step: build, load, decode against eager
    "prefill": "lmcli.bench.prefill",  # the compiled prefill chunks against eager prefill, batch 1
    "invariance": "lmcli.bench.invariance",  # the batch-invariant default against --fast-kernels
    "job": "lmcli.bench.job",
    "startup": "lmcli.bench.startup",  # whole-process start-up and first token, with and without the packed cache
    "speculative": "lmcli.bench.speculative",
    "structured": "lmcli.bench.structured",  # decode with and without a JSON Schema, mask times
    "beams": "lmcli.bench.beams",  # beam search with 4 beams against greedy decode: the same model, prompt and tokens
    "server": "lmcli.bench.server",  # lmcli serve: client start-up, 8 streaming clients against a job, first-token latency
    "lora": "lmcli.bench.lora",  # LoRA adapters: decode cost at batch 1, 4 adapters against 1 in a batch of 8
}
DEFAULT_SECTIONS = ("engines",)


def section_functions(name: str) -> tuple[Callable[..., dict[str, Any]], Callable[..., None]]:
    """The `measure` and `report` functions of a section other than "engines"."""
    module = importlib.import_module(SECTIONS[name])
    return module.measure, module.report
