"""`lmcli bench`: lmcli (each weight format), transformers and llama.cpp on the same weights, in one run.

Each engine runs in its own subprocess (a "worker"), so the peak resident memory it reports is its own
and nothing another engine loaded counts against it. The workers load once and then take turns: every
measurement round asks each worker in turn for the same piece of work, so a burst of load from other
processes on a shared machine hits all engines alike; the figures are the medians over the rounds.

Work measured (all greedy, random prompt ids from a fixed seed, no EOS, so every engine does the same work):
  prefill   one 256-token prompt at batch 1: time to first token, and prompt tokens/s
  decode    32 new tokens after a 32-token prompt at batch 1 and 8: tokens/s from the per-token
            timestamps after the first token (prefill is not in it)
  scaling   lmcli only: decode tokens/s at context 128, 1k and 4k (batch 1) and at batch 1, 8 and 32
  quality   each quantized lmcli format against lmcli float32: greedy continuations of the real-model
            prompts (identical ones, and the share of tokens before the first divergence) and the mean
            KL divergence of its next-token distribution from float32's over a fixed 512-token text

Worker protocol: the parent starts `python -m lmcli.bench.main --worker SPEC_JSON`, then writes one JSON
request per line to its stdin and reads one JSON reply per line from its stdout; anything else the
engine prints goes to stderr, which the parent keeps in a file and shows if the worker fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcli.bench.background_load import BackgroundLoad
from lmcli.bench.measure import (
    Worker,
    _add_ratios,
    _measure_engines,
    _measure_quality,
    _measure_scaling,
    decode_rate,
    greedy_agreement,
    mean_kl_divergence,
)
from lmcli.bench.report import print_report
from lmcli.bench.sections import section_functions
from lmcli.bench.settings import ENGINES, FORMATS, BenchSettings, settings_from_options

if TYPE_CHECKING:  # torch loads only when a benchmark runs: `lmcli --help` stays quick
    import torch

    from lmcli.resolve.model_ref import ResolvedModel

__all__ = ["ENGINES", "FORMATS", "BenchSettings", "decode_rate", "greedy_agreement", "main", "mean_kl_divergence",
           "print_report", "run", "settings_from_options"]


# ----------------------------------------------------------------------------- the machine


def cpu_facts() -> dict[str, Any]:
    """The CPU's model name, the vector/matrix extensions that matter here, and torch's capability."""
    import torch

    from lmcli.machine import cpu_model_and_flags
    from lmcli.models import native_attention

    name, flags = cpu_model_and_flags()
    model = name or "unknown"
    extensions = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                              "amx_bf16", "amx_int8") if f in flags]
    return {"cpu": model, "extensions": extensions, "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "attention": native_attention.describe()}


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s that torch reads from memory, summing a float32 tensor larger than any cache (best of `repeats`)."""
    import torch

    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()  # first touch
    best = min(_seconds(data.sum) for _ in range(repeats))
    return data.numel() * 4 / best


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _converted_for_transformers(path: Path, dtype: torch.dtype) -> str | None:
    """An HF directory with the GGUF's dequantised weights (kept under the lmcli cache), which transformers
    loads in seconds rather than parsing the GGUF itself for a minute; None if it cannot be written."""
    from lmcli.io.atomic import replace_directory
    from lmcli.io.fingerprint import checkpoint_fingerprint
    from lmcli.io.gguf import convert_gguf
    from lmcli.resolve.default_model import cache_dir

    fingerprint = checkpoint_fingerprint(path).removeprefix("sha256:")
    target = cache_dir() / "bench" / f"{path.stem}-{fingerprint}-{str(dtype).removeprefix('torch.')}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return str(target)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=_made(target.parent)))
    try:
        convert_gguf(path, staging / "hf", dtype=dtype)
        replace_directory(staging / "hf", target)
    except (OSError, ValueError):
        return None
    finally:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _native_format(path: Path) -> str | None:
    """The GGUF's quantization as llama.cpp names it (general.file_type), e.g. 'Q4_1'; None if not a GGUF."""
    if path.suffix != ".gguf":
        return None
    from lmcli.io.gguf_reader import read_gguf_metadata

    file_type = read_gguf_metadata(path).get("general.file_type")
    try:
        import gguf

        return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else "GGUF"
    except (ImportError, ValueError):
        return f"file type {file_type}"


def _workers(settings: BenchSettings, path: Path, float_dtype: torch.dtype, threads: int | None) -> list[Worker]:
    context = max([settings.prefill_tokens, settings.prompt_tokens + settings.new_tokens,
                   *(c + settings.scaling_tokens for c in settings.scaling_contexts)])
    base = {"checkpoint": str(path), "model": settings.model, "device": settings.device, "dtype": settings.dtype,
            "threads": threads, "context": context}
    workers = []
    if "lmcli" in settings.engines:
        for fmt in settings.formats:
            if fmt == "native" and path.suffix != ".gguf":
                continue  # a float checkpoint's own format is the float one
            workers.append(Worker(f"lmcli {fmt}", {**base, "engine": "lmcli", "format": fmt}))
    if "transformers" in settings.engines:
        converted = _converted_for_transformers(path, float_dtype) if path.suffix == ".gguf" else None
        workers.append(Worker("transformers", {**base, "engine": "transformers", "converted": converted}))
    if "llama.cpp" in settings.engines and path.suffix == ".gguf":
        workers.append(Worker("llama.cpp", {**base, "engine": "llama.cpp"}))
    return workers


def run(settings: BenchSettings, progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Measure everything `settings` asks for; returns the results as plain data (what --json prints)."""
    from lmcli.threads import configure

    chosen = configure()  # before torch loads here; the workers inherit its environment
    from lmcli.resolve.model_ref import resolve_model

    # Resolved once here; each engine's process is handed the path (and the name its config must match).
    resolved = resolve_model(settings.checkpoint, settings.model)
    settings.checkpoint, settings.model = str(resolved.path), resolved.check_as
    results: dict[str, Any] = {"checkpoint": str(resolved.path.resolve())}
    if "engines" in settings.sections:
        results.update(_run_engines(settings, resolved, chosen, progress))
    sections: dict[str, Any] = {}
    for name in settings.sections:
        if name != "engines":
            measure, _ = section_functions(name)
            sections[name] = measure(settings, resolved, progress)
    if sections:
        results["sections"] = sections
    return results


def _run_engines(settings: BenchSettings, resolved: ResolvedModel, chosen: Any,
                 progress: Callable[[str], None]) -> dict[str, Any]:
    """The engine comparison: prefill, decode, scaling and quality of lmcli, transformers and llama.cpp."""
    from lmcli.loading import resolve_device, resolve_dtype

    path = resolved.path.resolve()
    threads = settings.threads  # None: each worker chooses for itself, as lmcli would (llama.cpp: every CPU)
    float_dtype = resolve_dtype(settings.dtype, resolve_device(settings.device))
    native = _native_format(path)

    progress("measuring memory read bandwidth")
    machine = {**cpu_facts(), **({"torch_threads": settings.threads} if settings.threads else {}),
               "read_bandwidth_bytes_per_s": read_bandwidth(),
               "threads": f"{settings.threads} (--threads)" if settings.threads else chosen.describe()}
    workers = _workers(settings, path, float_dtype, threads)
    # The busy loops exist, paused, for the whole run and are killed on leaving (errors and Ctrl-C too).
    with BackgroundLoad(settings.background_load) as load:
        try:
            progress(f"loading {', '.join(w.name for w in workers)} (one subprocess each)")
            for worker in workers:  # one at a time: loading is memory- and CPU-heavy
                worker.start()
                worker.wait_ready()
            engines = _measure_engines(settings, workers, progress, load)
            scaling = _measure_scaling(settings, workers, progress)
            quality = _measure_quality(settings, workers, progress)
        finally:
            for worker in workers:
                worker.stop()

    _add_ratios(engines)
    float_tokens = engines.get("lmcli float", {}).pop("tokens", None)
    reference_tokens = engines.get("transformers", {}).pop("tokens", None)
    for figures in engines.values():
        figures.pop("tokens", None)
    identical = None if float_tokens is None or reference_tokens is None else float_tokens == reference_tokens
    return {
        "native_format": native,
        "float_dtype": str(float_dtype).removeprefix("torch."),
        "machine": machine,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(settings).items()},
        "engines": engines,
        "greedy_identical_lmcli_float_vs_transformers": identical,
        "scaling": scaling,
        "quality": quality,
    }



def main(checkpoint: str | None = None, as_json: bool = False, as_markdown: bool = False,
         **options: Any) -> dict[str, Any]:
    """Run the benchmark and print it (rich tables, JSON with `as_json`, or the engine table as Markdown
    with `as_markdown`); returns the results.

    `options` are `lmcli bench`'s (see settings_from_options) or BenchSettings fields."""
    settings = settings_from_options(checkpoint, **options)
    from rich.console import Console

    status = Console(stderr=True)
    results = run(settings, progress=lambda message: status.print(f"[dim]{message}…[/dim]"))
    if as_json:
        sys.stdout.write(json.dumps(results, indent=1) + "\n")
        return results
    if as_markdown:
        from lmcli.bench.report import markdown_report

        sys.stdout.write(markdown_report(results, "lmcli bench " + " ".join(sys.argv[sys.argv.index("bench") + 1:])
                                         if "bench" in sys.argv else "lmcli bench"))
        return results
    console = Console()
    if "engines" in settings.sections:
        print_report(results, console)
    for name, result in results.get("sections", {}).items():
        section_functions(name)[1](result, console)
    return results

