"""`lmcli bench`'s tables: what a person sees of the results."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def _rate(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None or value != value else f"{value:,.{digits}f}"


def _label(name: str, figures: dict[str, Any], results: dict[str, Any]) -> str:
    if name == "lmcli float":
        return f"lmcli {results['float_dtype']}"
    if name == "lmcli native":
        return f"lmcli {results['native_format'] or 'native'}"
    if name.startswith("lmcli"):
        return f"{name} (--quantize)"
    if name == "transformers":
        return f"transformers {results['float_dtype']}"
    if name == "llama.cpp":
        threads = f" · {figures['threads']} threads" if figures.get("threads") else ""
        return f"llama.cpp {results['native_format'] or ''} {figures.get('version', '')}".rstrip() + threads
    return name


def _ratio(figures: dict[str, Any], other: str, key: str) -> str:
    ratios = figures.get(f"vs_{other}", {})
    return f"{ratios[key]:.2f}x" if key in ratios else ""


def _shared_cells(figures: dict[str, Any], batches: list[int]) -> list[str]:
    """The figures measured while the busy loops spun (--background-load)."""
    ttft = figures.get("shared_ttft_s")
    return [_rate(ttft * 1000 if ttft is not None else None, 0),
            *(_rate(figures.get(f"shared_decode_b{b}_tokens_per_s")) for b in batches),
            _ratio(figures, "llama.cpp", "shared_decode_b1_tokens_per_s")]


def _print_threads(results: dict[str, Any], console, busy: int) -> None:
    """The thread count each engine had as its batch-1 decodes ended (lmcli's moves with the load)."""
    for name, figures in results["engines"].items():
        if not name.startswith("lmcli") or "decode_b1_threads" not in figures:
            continue
        seen = [",".join(str(t) for t in figures.get(f"{prefix}decode_b1_threads", [])) for prefix in ("", "shared_")]
        shared = f" · {busy} busy: {seen[1]}" if busy and seen[1] else ""
        console.print(f"  {_label(name, figures, results)} threads as each b1 decode ended: {seen[0]}{shared}",
                      highlight=False)


def print_report(results: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(file=sys.stdout)
    machine = results["machine"]
    settings = results["settings"]
    console.print(f"[bold]{Path(results['checkpoint']).name}[/bold] · {machine['cpu']} · "
                  f"{machine['torch_threads']} thread(s) of {machine['logical_cpus']} logical CPUs at the start · "
                  f"torch {machine['torch']} capability {machine['torch_cpu_capability']} · "
                  f"extensions {' '.join(machine['extensions']) or 'none seen'} · "
                  f"attention {machine.get('attention', 'unknown')} · "
                  f"read bandwidth {machine['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s", highlight=False)
    if "threads" in machine:
        console.print(f"threads: {machine['threads']}", highlight=False)
    batches = settings["batch_sizes"]
    busy = settings.get("background_load", 0)
    shared = [f"TTFT ms, {busy} busy", *(f"decode b{b} tok/s, {busy} busy" for b in batches),
              f"b1 {busy} busy vs llama.cpp"] if busy else []
    table = Table(title=f"prefill {settings['prefill_tokens']} tokens (b1) · decode {settings['new_tokens']} "
                        f"tokens after {settings['prompt_tokens']} · median of {settings['repeats']} interleaved "
                        f"round(s)", title_justify="left")
    columns = ["engine", "prefill tok/s", "TTFT ms", *(f"decode b{b} tok/s" for b in batches), "peak RSS MiB",
               "b1 vs transformers", "b1 vs llama.cpp", *shared]
    for column in columns:
        table.add_column(column, justify="left" if column == "engine" else "right")
    for name, figures in results["engines"].items():
        if "unavailable" in figures:
            table.add_row(_label(name, figures, results), *["n/a"] * (len(columns) - 2),
                          f"[dim]{figures['unavailable'][:60]}[/dim]")
            continue
        ttft = figures.get("ttft_s")
        peak = figures.get("peak_rss_bytes")
        table.add_row(
            _label(name, figures, results),
            _rate(figures.get("prefill_tokens_per_s"), 0),
            _rate(ttft * 1000 if ttft is not None else None, 0),
            *(_rate(figures.get(f"decode_b{b}_tokens_per_s")) for b in batches),
            _rate(peak / 2**20 if peak else None, 0),
            *(_ratio(figures, o, "decode_b1_tokens_per_s") for o in ("transformers", "llama.cpp")),
            *(_shared_cells(figures, batches) if busy else ()),
        )
    console.print(table)
    for name, figures in results["engines"].items():
        kernels = figures.get("kernels", {})
        stored = ", ".join(f"{kind} {count / 1e6:,.1f}M" for kind, count in kernels.get("weights", {}).items()
                           if count > 1)
        if stored:
            console.print(f"  {_label(name, figures, results)} weights: {stored}", highlight=False)
        for why in kernels.get("why", {}).values():
            console.print(f"    kernel {why}", highlight=False)
    _print_threads(results, console, busy)
    identical = results["greedy_identical_lmcli_float_vs_transformers"]
    if identical is not None:
        console.print(f"greedy tokens identical (lmcli {results['float_dtype']} vs transformers): "
                      f"{'yes' if identical else 'no'}")
    for name, figures in results["engines"].items():
        ratios = {o: figures[f"vs_{o}"] for o in ("transformers", "llama.cpp") if f"vs_{o}" in figures}
        if ratios:
            parts = [f"{k.removesuffix('_tokens_per_s').replace('_', ' ')} {v:.2f}x vs {o}"
                     for o, r in ratios.items() for k, v in r.items()]
            console.print(f"  {_label(name, figures, results)}: {', '.join(parts)}", highlight=False)

    scaling = results.get("scaling") or {}
    if scaling:
        table = Table(title=f"scaling · {_label(scaling['engine'], {}, results)} · decode tok/s over "
                            f"{scaling['new_tokens']} new tokens", title_justify="left")
        table.add_column("work")
        table.add_column("decode tok/s", justify="right")
        for context, rate in scaling["context"].items():
            table.add_row(f"context {int(context):,} · batch 1", _rate(rate))
        for batch, rate in scaling["batch"].items():
            table.add_row(f"batch {batch} · context {scaling['batch_context']:,}", _rate(rate))
        console.print(table)

    quality = results.get("quality") or {}
    if quality.get("formats"):
        table = Table(title=f"quality against {_label(quality['reference'], {}, results)} · greedy "
                            f"{quality['new_tokens']} tokens on {quality['prompts']} real prompts · KL over "
                            f"{quality['kl_tokens']} tokens of fixed text", title_justify="left")
        for column in ("format", "identical continuations", "tokens before divergence", "mean KL (nats)"):
            table.add_column(column, justify="left" if column == "format" else "right")
        for name, figures in quality["formats"].items():
            table.add_row(_label(name, figures, results),
                          f"{figures['identical']}/{figures['prompts']}" if "identical" in figures else "n/a",
                          f"{figures['tokens_before_divergence']:.0%}" if "identical" in figures else "n/a",
                          f"{figures['mean_kl']:.4f}" if "mean_kl" in figures else "n/a")
        console.print(table)
    elif quality.get("unavailable"):
        console.print(f"quality: {quality['unavailable']}")



def markdown_report(results: dict[str, Any], command: str = "lmcli bench") -> str:
    """The engine comparison as a Markdown table under the machine it ran on and the command that made it
    (`lmcli bench --markdown`): what docs/benchmarks.md keeps, one table per kind of CPU."""
    machine, settings = results["machine"], results["settings"]
    batches = settings["batch_sizes"]
    lines = [f"CPU: {machine['cpu']} · {machine['logical_cpus']} logical CPUs · torch {machine['torch']} capability "
             f"{machine['torch_cpu_capability']} · extensions {' '.join(machine['extensions']) or 'none seen'} · "
             f"read bandwidth {machine['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
             "",
             f"`{command}` on {Path(results['checkpoint']).name}: prefill {settings['prefill_tokens']} tokens (b1), "
             f"decode {settings['new_tokens']} tokens after {settings['prompt_tokens']}, median of "
             f"{settings['repeats']} interleaved round(s).",
             ""]
    columns = ["engine", "prefill tok/s", "TTFT ms", *(f"decode b{b} tok/s" for b in batches), "peak RSS MiB",
               "b1 vs transformers", "b1 vs llama.cpp"]
    lines += ["| " + " | ".join(columns) + " |", "|" + "|".join("---" if c == "engine" else "---:" for c in columns) + "|"]
    for name, figures in results["engines"].items():
        if "unavailable" in figures:
            cells = ["n/a"] * (len(columns) - 1)
        else:
            ttft, peak = figures.get("ttft_s"), figures.get("peak_rss_bytes")
            cells = [_rate(figures.get("prefill_tokens_per_s"), 0), _rate(ttft * 1000 if ttft is not None else None, 0),
                     *(_rate(figures.get(f"decode_b{b}_tokens_per_s")) for b in batches),
                     _rate(peak / 2**20 if peak else None, 0),
                     *(_ratio(figures, o, "decode_b1_tokens_per_s") for o in ("transformers", "llama.cpp"))]
        lines.append("| " + " | ".join([_label(name, figures, results), *cells]) + " |")
    return "\n".join(lines) + "\n"
