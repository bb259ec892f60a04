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

Worker protocol: the parent starts `python -m lmcli.bench --worker SPEC_JSON`, then writes one JSON
request per line to its stdin and reads one JSON reply per line from its stdout; anything else the
engine prints goes to stderr, which the parent keeps in a file and shows if the worker fails.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from lmcli.bench_models import TEXT_PROMPTS
from lmcli.errors import UsageError

if TYPE_CHECKING:  # torch loads only when a benchmark runs: `lmcli --help` stays quick
    import torch

ENGINES = ("lmcli", "transformers", "llama.cpp")
FORMATS = ("float", "native", "int4", "int8")  # lmcli weight formats; "native" = the file's own quantization


@dataclass
class BenchSettings:
    """What to measure; the defaults are those shown by `lmcli bench --help`."""

    checkpoint: str | None = None
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"  # activation dtype of the float format (and transformers); auto = float32 on CPU
    engines: Sequence[str] = ENGINES
    formats: Sequence[str] = FORMATS
    prefill_tokens: int = 256
    prompt_tokens: int = 32  # the prompt before the decode runs
    new_tokens: int = 32
    batch_sizes: Sequence[int] = (1, 8)
    repeats: int = 3
    scaling_contexts: Sequence[int] = (128, 1024, 4096)
    scaling_batches: Sequence[int] = (1, 8, 32)
    scaling_tokens: int = 16
    quality: bool = True
    quality_prompts: int = len(TEXT_PROMPTS)
    quality_tokens: int = 32
    kl_tokens: int = 512
    threads: int | None = None  # default: torch's own thread count

    def quick(self) -> BenchSettings:
        """Less of everything: one round, no 4k context or batch 32, a shorter quality check."""
        self.repeats = 1
        self.new_tokens = min(self.new_tokens, 16)
        self.scaling_contexts = tuple(c for c in self.scaling_contexts if c <= 1024)
        self.scaling_batches = tuple(b for b in self.scaling_batches if b <= 8)
        self.quality_prompts = min(self.quality_prompts, 2)
        self.kl_tokens = min(self.kl_tokens, 128)
        return self


# ----------------------------------------------------------------------------- the machine


def cpu_facts() -> dict[str, Any]:
    """The CPU's model name, the vector/matrix extensions that matter here, and torch's capability."""
    import torch

    from lmcli.machine import cpu_model_and_flags

    name, flags = cpu_model_and_flags()
    model = name or "unknown"
    extensions = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                              "amx_bf16", "amx_int8") if f in flags]
    return {"cpu": model, "extensions": extensions, "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__}


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


# ----------------------------------------------------------------------------- figures (pure functions)


def decode_rate(stamps: Sequence[float], batch: int) -> float:
    """Tokens/s between the first and the last token's timestamp (the prefill before the first is excluded)."""
    if len(stamps) < 2:
        return float("nan")
    return batch * (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)


def greedy_agreement(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> dict[str, float]:
    """How far `candidate`'s greedy continuations follow `reference`'s: identical ones, and the mean share
    of tokens generated before the first divergence (after it, the two continue from different texts)."""
    identical, shares = 0, []
    for ref, cand in zip(reference, candidate, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=False)) if a != b), min(len(ref), len(cand)))
        identical += same == len(ref) == len(cand)
        shares.append(same / max(len(ref), 1))
    return {"identical": identical, "prompts": len(reference), "tokens_before_divergence": statistics.fmean(shares)}


def mean_kl_divergence(reference_logprobs: torch.Tensor, candidate_logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(reference || candidate), both [T, vocab] log-probabilities."""
    p = reference_logprobs.exp()
    return float((p * (reference_logprobs - candidate_logprobs)).sum(-1).mean())


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ----------------------------------------------------------------------------- the parent side


@dataclass
class Worker:
    name: str  # the key in the results: "lmcli float", "transformers", ...
    spec: dict[str, Any]
    process: subprocess.Popen | None = None
    log: IO[str] | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None

    def start(self) -> None:
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([sys.executable, "-m", "lmcli.bench_worker", json.dumps(self.spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        bufsize=1)

    def reply(self) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            assert self.log is not None
            self.log.seek(0)
            tail = self.log.read().strip().splitlines()[-3:]
            return {"error": f"worker exited ({self.process.returncode}): {' | '.join(tail) or 'no output'}"}
        return json.loads(line)

    def wait_ready(self) -> None:
        message = self.reply()
        if message.get("ready"):
            self.ready = message
        else:
            self.failure = message.get("unsupported") or message.get("error") or "did not start"
            self.stop()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.failure is not None:
            return {"unsupported": self.failure}
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError as exc:
            return {"error": f"worker gone: {exc}"}
        return self.reply()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.log is not None:
            self.log.close()
            self.log = None


def _converted_for_transformers(path: Path, dtype: torch.dtype) -> str | None:
    """An HF directory with the GGUF's dequantised weights (kept under the lmcli cache), which transformers
    loads in seconds rather than parsing the GGUF itself for a minute; None if it cannot be written."""
    from lmcli.default_model import cache_dir, gguf_fingerprint
    from lmcli.io.atomic import replace_directory
    from lmcli.io.gguf import convert_gguf

    target = cache_dir() / "bench" / f"{path.stem}-{gguf_fingerprint(path)}-{str(dtype).removeprefix('torch.')}"
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


def _workers(settings: BenchSettings, path: Path, float_dtype: torch.dtype, threads: int) -> list[Worker]:
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


def _first_error(replies: list[dict[str, Any]]) -> str | None:
    for reply in replies:
        if "unsupported" in reply or "error" in reply:
            return reply.get("unsupported") or reply.get("error")
    return None


def run(settings: BenchSettings, progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Measure everything `settings` asks for; returns the results as plain data (what --json prints)."""
    import torch

    from lmcli.loading import resolve_device, resolve_dtype

    if settings.checkpoint is None:
        from lmcli.default_model import default_checkpoint_path

        settings.checkpoint = str(default_checkpoint_path())
    path = Path(settings.checkpoint).expanduser().resolve()
    threads = settings.threads or torch.get_num_threads()
    float_dtype = resolve_dtype(settings.dtype, resolve_device(settings.device))
    native = _native_format(path)

    progress("measuring memory read bandwidth")
    machine = {**cpu_facts(), "read_bandwidth_bytes_per_s": read_bandwidth()}
    workers = _workers(settings, path, float_dtype, threads)
    progress(f"loading {', '.join(w.name for w in workers)} (one subprocess each)")
    for worker in workers:  # one at a time: loading is memory- and CPU-heavy
        worker.start()
        worker.wait_ready()
    try:
        engines = _measure_engines(settings, workers, progress)
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
        "checkpoint": str(path),
        "native_format": native,
        "float_dtype": str(float_dtype).removeprefix("torch."),
        "machine": machine,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(settings).items()},
        "engines": engines,
        "greedy_identical_lmcli_float_vs_transformers": identical,
        "scaling": scaling,
        "quality": quality,
    }


def _measure_engines(settings: BenchSettings, workers: list[Worker], progress) -> dict[str, dict[str, Any]]:
    work = [("prefill", {"op": "generate", "batch": 1, "context": settings.prefill_tokens, "new": 1})]
    for batch in settings.batch_sizes:
        work.append((f"decode_b{batch}", {"op": "generate", "batch": batch, "context": settings.prompt_tokens,
                                          "new": settings.new_tokens, "tokens": batch == 1}))
    replies: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for round_ in range(settings.repeats):
        progress(f"round {round_ + 1}/{settings.repeats}")
        for label, request in work:
            for worker in workers:  # interleaved: each worker does this piece of work in turn
                replies.setdefault((worker.name, label), []).append(worker.ask(request))
    engines = {}
    for worker in workers:
        figures: dict[str, Any] = {}
        if worker.failure is not None:
            engines[worker.name] = {"unavailable": worker.failure}
            continue
        figures.update({k: v for k, v in worker.ready.items() if k != "ready"})
        prefill = replies[(worker.name, "prefill")]
        error = _first_error(prefill)
        if error is None:
            figures["ttft_s"] = _median([r["ttft_s"] for r in prefill])
            figures["prefill_tokens_per_s"] = settings.prefill_tokens / figures["ttft_s"]
        else:
            figures["prefill_unavailable"] = error
        for batch in settings.batch_sizes:
            decode = replies[(worker.name, f"decode_b{batch}")]
            error = _first_error(decode)
            if error is None:
                figures[f"decode_b{batch}_tokens_per_s"] = _median([r["decode_tokens_per_s"] for r in decode])
                if batch == 1:
                    figures["tokens"] = decode[-1]["tokens"]
            else:
                figures[f"decode_b{batch}_unavailable"] = error
        figures["peak_rss_bytes"] = worker.ask({"op": "peak_rss"}).get("peak_rss_bytes")
        engines[worker.name] = figures
    return engines


def _add_ratios(engines: dict[str, dict[str, Any]]) -> None:
    """Each lmcli format's speed as a multiple of transformers' and llama.cpp's (higher is faster)."""
    for name, figures in engines.items():
        if not name.startswith("lmcli"):
            continue
        keys = [k for k in figures if k.endswith("_tokens_per_s")]
        for other in ("transformers", "llama.cpp"):
            theirs = engines.get(other, {})
            ratios = {key: figures[key] / theirs[key] for key in keys if key in figures and theirs.get(key)}
            if ratios:
                figures[f"vs_{other}"] = ratios


def _lmcli_worker(workers: list[Worker], preferred: Sequence[str]) -> Worker | None:
    by_name = {w.name: w for w in workers if w.failure is None}
    return next((by_name[f"lmcli {fmt}"] for fmt in preferred if f"lmcli {fmt}" in by_name), None)


def _measure_scaling(settings: BenchSettings, workers: list[Worker], progress) -> dict[str, Any]:
    """How decode speed falls with context and rises with batch, for lmcli's native (else float) weights."""
    worker = _lmcli_worker(workers, ("native", "float", "int4", "int8"))
    if worker is None or not (settings.scaling_contexts or settings.scaling_batches):
        return {}
    base_context = min(settings.scaling_contexts, default=settings.prompt_tokens)
    runs = [("context", c, 1, c) for c in settings.scaling_contexts]
    runs += [("batch", b, b, base_context) for b in settings.scaling_batches]
    results: dict[str, Any] = {"engine": worker.name, "new_tokens": settings.scaling_tokens,
                               "batch_context": base_context, "context": {}, "batch": {}}
    for round_ in range(settings.repeats):
        progress(f"scaling round {round_ + 1}/{settings.repeats} ({worker.name})")
        for kind, value, batch, context in runs:
            reply = worker.ask({"op": "generate", "batch": batch, "context": context, "new": settings.scaling_tokens})
            results[kind].setdefault(str(value), []).append(reply.get("decode_tokens_per_s", float("nan")))
    for kind in ("context", "batch"):
        results[kind] = {value: _median(rates) for value, rates in results[kind].items()}
    return results


def _measure_quality(settings: BenchSettings, workers: list[Worker], progress) -> dict[str, Any]:
    """Each quantized lmcli format against lmcli float32 (greedy agreement, KL divergence)."""
    reference = _lmcli_worker(workers, ("float",))
    candidates = [w for w in workers if w.name.startswith("lmcli") and w is not reference and w.failure is None]
    if not settings.quality or reference is None or not candidates:
        return {}
    progress("quality: greedy continuations and KL divergence against float32")
    texts = list(TEXT_PROMPTS[: settings.quality_prompts])
    greedy = {"op": "greedy", "texts": texts, "new": settings.quality_tokens}
    expected = reference.ask(greedy)
    if "continuations" not in expected:
        return {"unavailable": _first_error([expected])}
    results: dict[str, Any] = {"reference": reference.name, "prompts": len(texts), "new_tokens": settings.quality_tokens,
                               "kl_tokens": settings.kl_tokens, "formats": {}}
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-") as scratch:
        reference_path = str(Path(scratch) / "float32-logprobs.safetensors")
        saved = reference.ask({"op": "logprobs", "tokens": settings.kl_tokens, "path": reference_path})
        for worker in candidates:
            figures: dict[str, Any] = {}
            got = worker.ask(greedy)
            if "continuations" in got:
                figures.update(greedy_agreement(expected["continuations"], got["continuations"]))
            else:
                figures["greedy_unavailable"] = _first_error([got])
            kl = worker.ask({"op": "kl", "tokens": settings.kl_tokens, "path": reference_path}) if "tokens" in saved \
                else saved
            if "mean_kl" in kl:
                figures["mean_kl"] = kl["mean_kl"]
            else:
                figures["kl_unavailable"] = _first_error([kl])
            results["formats"][worker.name] = figures
    return results


# ----------------------------------------------------------------------------- what a person sees


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
        return f"llama.cpp {results['native_format'] or ''} {figures.get('version', '')}".rstrip()
    return name


def print_report(results: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(file=sys.stdout)
    machine = results["machine"]
    settings = results["settings"]
    console.print(f"[bold]{Path(results['checkpoint']).name}[/bold] · {machine['cpu']} · "
                  f"{machine['torch_threads']} threads of {machine['logical_cpus']} logical CPUs · "
                  f"torch {machine['torch']} capability {machine['torch_cpu_capability']} · "
                  f"extensions {' '.join(machine['extensions']) or 'none seen'} · "
                  f"read bandwidth {machine['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s", highlight=False)
    batches = settings["batch_sizes"]
    table = Table(title=f"prefill {settings['prefill_tokens']} tokens (b1) · decode {settings['new_tokens']} "
                        f"tokens after {settings['prompt_tokens']} · median of {settings['repeats']} interleaved "
                        f"round(s)", title_justify="left")
    columns = ["engine", "prefill tok/s", "TTFT ms", *(f"decode b{b} tok/s" for b in batches), "peak RSS MiB",
               "b1 vs transformers", "b1 vs llama.cpp"]
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
            *(f"{figures[f'vs_{o}']['decode_b1_tokens_per_s']:.2f}x"
              if "decode_b1_tokens_per_s" in figures.get(f"vs_{o}", {}) else "" for o in ("transformers", "llama.cpp")),
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


def _names(value: str | Sequence[str], allowed: Sequence[str], option: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip()) if isinstance(value, str) else tuple(value)
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise UsageError(f"{option} {','.join(names) or repr('')}: choose from {', '.join(allowed)}")
    return names


def _sizes(value: str | Sequence[int], option: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(n) for n in value.split(",") if n.strip()) if isinstance(value, str) else tuple(value)
    except ValueError:
        raise UsageError(f"{option} {value!r}: expected comma-separated whole numbers, e.g. 1,8,32") from None
    if any(n < 1 for n in sizes):
        raise UsageError(f"{option} {value!r}: sizes must be at least 1")
    return sizes


def settings_from_options(checkpoint: str | None = None, *, engines: str | Sequence[str] | None = None,
                          formats: str | Sequence[str] | None = None, max_new_tokens: int | None = None,
                          batch_size: int | None = None, contexts: str | Sequence[int] | None = None,
                          scaling_batches: str | Sequence[int] | None = None, skip_quality: bool = False,
                          quick: bool = False, **options: Any) -> BenchSettings:
    """BenchSettings from `lmcli bench`'s options (names as on the command line), validated."""
    settings = BenchSettings(checkpoint=checkpoint, **options)
    if engines is not None:
        settings.engines = _names(engines, ENGINES, "--engines")
    if formats is not None:
        settings.formats = _names(formats, FORMATS, "--formats")
    if max_new_tokens is not None:
        if max_new_tokens < 2:
            raise UsageError("--max-new-tokens must be at least 2: decode speed is timed between tokens")
        settings.new_tokens = max_new_tokens
    if batch_size is not None:
        settings.batch_sizes = tuple(dict.fromkeys((1, *_sizes([batch_size], "--batch-size"))))
    if contexts is not None:
        settings.scaling_contexts = _sizes(contexts, "--contexts")
    if scaling_batches is not None:
        settings.scaling_batches = _sizes(scaling_batches, "--scaling-batches")
    settings.quality = settings.quality and not skip_quality
    return settings.quick() if quick else settings


def main(checkpoint: str | None = None, as_json: bool = False, **options: Any) -> dict[str, Any]:
    """Run the benchmark and print it (rich tables, or JSON with `as_json`); returns the results.

    `options` are `lmcli bench`'s (see settings_from_options) or BenchSettings fields."""
    settings = settings_from_options(checkpoint, **options)
    from rich.console import Console

    status = Console(stderr=True)
    results = run(settings, progress=lambda message: status.print(f"[dim]{message}…[/dim]"))
    if as_json:
        sys.stdout.write(json.dumps(results, indent=1) + "\n")
    else:
        print_report(results)
    return results
