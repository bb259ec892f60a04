"""`lmcli bench --sections invariance`: what batch invariance costs on a quantized model.

The batch-invariant default (one fixed kernel per weight kind, attention row by row: README "Batch-
invariant numerics") against the fastest path that gives invariance up (`--fast-kernels`: the measured
kernel plan, batched attention), each in its own worker process, the same work interleaved between the
two and the median of each figure kept (lmcli/bench/measure.py). Then the quality of each against the
float32 dequantised model (`--quantize none --dtype float32`): greedy continuations that agree, and the
mean KL divergence of the next-token distributions over a fixed text.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcli.bench.measure import Worker, _measure_engines, greedy_agreement
from lmcli.bench.settings import BenchSettings
from lmcli.bench.synthetic import TEXT_PROMPTS

if TYPE_CHECKING:
    from rich.console import Console

    from lmcli.resolve.model_ref import ResolvedModel

# Worker name -> the environment kernels/plan.py reads (None: unset); this module must not import
# torch. The third isolates what row-by-row attention costs: the invariant default's kernels, forced,
# with --fast-kernels' batched attention (the measured plan may pick others, and under load worse ones).
MODES: dict[str, dict[str, str | None]] = {
    "invariant": {"LMCLI_FAST_KERNELS": None, "LMCLI_KERNEL": None},
    "fast-kernels": {"LMCLI_FAST_KERNELS": "1", "LMCLI_KERNEL": None},
    "fast, fixed kernels": {"LMCLI_FAST_KERNELS": "1", "LMCLI_KERNEL": "int4pack"},
}
REFERENCE = "float32 dequantised"


def _workers(settings: BenchSettings, path: Path) -> list[Worker]:
    context = max(settings.prefill_tokens, settings.prompt_tokens + settings.new_tokens)
    base = {"checkpoint": str(path), "model": settings.model, "device": settings.device, "dtype": "float32",
            "threads": settings.threads, "context": context, "engine": "lmcli"}
    quantized = "native" if path.suffix == ".gguf" else "int4"  # a float checkpoint: quantized at load
    workers = [Worker(name, {**base, "format": quantized}, env=dict(env)) for name, env in MODES.items()]
    return [*workers, Worker(REFERENCE, {**base, "format": "float"}, env=dict(MODES["invariant"]))]


def measure(settings: BenchSettings, resolved: ResolvedModel, progress: Callable[[str], None]) -> dict[str, Any]:
    workers = _workers(settings, Path(resolved.path))
    modes, reference = workers[:-1], workers[-1]
    try:
        progress(f"invariance: loading {', '.join(MODES)} (one subprocess each)")
        for worker in modes:
            worker.start()
            worker.wait_ready()
        speed = _measure_engines(settings, modes, progress)
        quality = _quality(settings, modes, reference, progress) if settings.quality else {}
    finally:
        for worker in workers:
            worker.stop()
    for name, figures in speed.items():
        figures.pop("tokens", None)
        figures.update(quality.get(name, {}))
    return {"modes": speed, "reference": REFERENCE, "settings": {
        "prefill_tokens": settings.prefill_tokens, "prompt_tokens": settings.prompt_tokens,
        "new_tokens": settings.new_tokens, "batch_sizes": list(settings.batch_sizes), "repeats": settings.repeats,
        "quality_prompts": settings.quality_prompts, "quality_tokens": settings.quality_tokens,
        "kl_tokens": settings.kl_tokens}}


def _quality(settings: BenchSettings, modes: list[Worker], reference: Worker,
             progress: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Per mode: greedy agreement with the float32 dequantised model and the mean KL to it."""
    progress("invariance: quality against the float32 dequantised model")
    texts = list(TEXT_PROMPTS[: settings.quality_prompts])
    greedy = {"op": "greedy", "texts": texts, "new": settings.quality_tokens}
    reference.start()
    reference.wait_ready()
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-") as tmp:
        path = str(Path(tmp) / "reference.safetensors")
        wanted = reference.ask(greedy)
        saved = reference.ask({"op": "logprobs", "tokens": settings.kl_tokens, "path": path})
        reference.stop()
        if "continuations" not in wanted or "tokens" not in saved:
            failure = reference.failure or wanted.get("error") or saved.get("error") or "the reference failed"
            return {worker.name: {"quality_unavailable": failure} for worker in modes}
        result = {}
        for worker in modes:
            got = worker.ask(greedy)
            kl = worker.ask({"op": "kl", "tokens": settings.kl_tokens, "path": path})
            figures: dict[str, Any] = {}
            if "continuations" in got:
                figures["greedy_vs_float32"] = greedy_agreement(wanted["continuations"], got["continuations"])
            if "mean_kl" in kl:
                figures["mean_kl_vs_float32"] = kl["mean_kl"]
            result[worker.name] = figures
    return result


def report(result: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    modes = result["modes"]
    settings = result["settings"]
    table = Table(title=f"Batch invariance: the default against --fast-kernels (medians of {settings['repeats']})")
    table.add_column("")
    for name in modes:
        table.add_column(name, justify="right")
    table.add_column("invariant / fastest", justify="right")
    rows = [(f"prefill {settings['prefill_tokens']} tokens, tok/s", "prefill_tokens_per_s")]
    rows += [(f"decode, batch {b}, tok/s", f"decode_b{b}_tokens_per_s") for b in settings["batch_sizes"]]
    invariant = modes.get("invariant", {})
    for label, key in rows:
        cells = [f"{modes[name][key]:.1f}" if key in modes[name] else "n/a" for name in modes]
        fastest = max((figures.get(key) or 0.0 for name, figures in modes.items() if name != "invariant"), default=0.0)
        ratio = f"{invariant[key] / fastest:.2f}x" if invariant.get(key) and fastest else ""
        table.add_row(label, *cells, ratio)
    reference = result["reference"]
    table.add_row(f"greedy continuations as {reference}", *(
        f"{q['identical']}/{q['prompts']} ({q['tokens_before_divergence']:.0%} of tokens)"
        if (q := modes[name].get("greedy_vs_float32")) else "n/a" for name in modes), "")
    table.add_row(f"mean KL to {reference} ({settings['kl_tokens']} tokens)", *(
        f"{modes[name]['mean_kl_vs_float32']:.5f}" if "mean_kl_vs_float32" in modes[name] else "n/a"
        for name in modes), "")
    console.print(table)
    for name, figures in modes.items():
        if "unavailable" in figures:
            console.print(f"{name}: unavailable ({figures['unavailable']})")
            continue
        why = figures.get("kernels", {}).get("why", {})
        kernels = "; ".join(f"{kind}: {text}" for kind, text in why.items())
        console.print(f"[dim]{name}: {figures.get('activation_dtype', '?')} activations; {kernels}[/dim]")
