"""What a person sees: live streaming outputs, the job progress bar, and one-line summaries (rich).

- `TerminalOutput` / `PlainOutput` write generated pieces live: rich with a dimmed
  prompt in a terminal; bare text, flushed piece by piece, in a pipe.
- `JobProgress` is a batch job's progress bar on stderr.
- `row_summary` / `job_summary` are the dim lines printed after a run.
- `checkpoint_facts` / `print_facts` are `lmcli info`; `print_models` is `lmcli models`.
- `probability_style` / `ProbabilityShading` colour streamed text by probability (--color-probs).

rich is imported only when something is shown, to keep `import lmcli` quick.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from lmcli.io.sizes import human_bytes

if TYPE_CHECKING:
    from lmcli.io.tokenizer import Tokenizer
    from lmcli.resolve.model_ref import ResolvedModel

STOP_REASONS = {"eos": "end of text", "length": "token limit", "stop": "stop string", "interrupted": "Ctrl-C"}


class PlainOutput:
    """Pipes and files: only the generated text, flushed as it comes, nothing else."""

    def __init__(self, stream: IO[str] | None = None):
        self._stream = stream if stream is not None else sys.stdout

    def prompt(self, text: str) -> None:
        pass  # no echo: the output of `lmcli generate ... > file` is the completion

    def write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()

    def end(self) -> None:
        # A completion is one record: end it with a newline, as line-based tools expect
        # (`| wc -l`, `read`); the completion itself is everything before that newline.
        self._stream.write("\n")
        self._stream.flush()


class TerminalOutput:
    """A terminal: the prompt dimmed, then the completion as each step returns it."""

    def __init__(self, console=None):
        if console is None:
            from rich.console import Console

            console = Console()
        self._console = console

    def prompt(self, text: str) -> None:
        self._print(text, style="dim")

    def write(self, text: str, style: str | None = None) -> None:
        self._print(text, style)

    def end(self) -> None:
        self._console.print()

    def _print(self, text: str, style: str | None = None) -> None:
        # Model text is not rich markup, emoji codes or something to highlight;
        # soft_wrap leaves line breaking to the terminal so pieces join seamlessly.
        self._console.print(
            visible_controls(text), style=style, end="", markup=False, emoji=False, highlight=False, soft_wrap=True
        )
        self._console.file.flush()


# C0 controls other than tab and newline, and DEL, shown as their Unicode "control pictures" (ESC -> ␛),
# so model output cannot move the cursor or send escape sequences to the terminal.
_CONTROL_PICTURES = {code: 0x2400 + code for code in range(32) if chr(code) not in "\t\n"} | {0x7F: 0x2421}


def visible_controls(text: str) -> str:
    return text.translate(_CONTROL_PICTURES)


class JobProgress:
    """A rich progress bar on stderr (rows, tokens/s, ETA); silent when stderr is not a terminal."""

    def __init__(self, total: int, completed: int = 0, enabled: bool = True):
        self._bar = None
        self._tokens = 0
        self._started = time.perf_counter()
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        if not console.is_terminal:
            return
        self._bar = Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rows"),
            TextColumn("{task.fields[speed]}"),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = self._bar.add_task("rows", total=total, completed=completed, speed="")
        self._bar.start()

    def advance(self, tokens: int = 0) -> None:
        self._tokens += tokens
        if self._bar is not None:
            speed = self._tokens / max(time.perf_counter() - self._started, 1e-9)
            self._bar.update(self._task, advance=1, speed=f"{speed:.1f} tok/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def row_summary(result: Any) -> str:
    """One line about a finished row (a `RowResult`): tokens, speed, latency, why it stopped, its seed,
    and the decoding settings it used."""
    tokens = len(result.tokens)
    seconds = max((result.finished_at or result.started) - result.started, 1e-9)
    parts = [f"{tokens} tokens", f"{tokens / seconds:.1f} tokens/s"]
    if result.first_token_at is not None:
        parts.append(f"{(result.first_token_at - result.started) * 1000:.0f} ms to first token")
    parts.append(f"stopped: {STOP_REASONS.get(result.finish_reason, result.finish_reason)}")
    if result.row.seed is not None:
        parts.append(f"seed {result.row.seed}")
    parts.append(", ".join(f"{name} {value}" for name, value in result.row.settings.used().items()))
    return " · ".join(parts)


def rows_text(count: int) -> str:
    """"1 row", "2 rows": how every message counts rows."""
    return f"{count} row" if count == 1 else f"{count} rows"


def job_summary(report: Any, output_path: Path | None) -> str:
    """One line about a finished job (a `JobReport`)."""
    parts = [rows_text(report.written) + " written" + (f" to {output_path}" if output_path else "")]
    if report.skipped:
        parts.append(f"{report.skipped} already done")
    parts.append(f"{report.tokens} tokens")
    parts.append(f"{report.tokens / max(report.seconds, 1e-9):.1f} tokens/s")
    continuous = getattr(report, "continuous", None)  # generation.continuous.ContinuousStats
    if continuous is not None and continuous.steps:
        parts.append(f"batch {continuous.occupancy:.0%} full")
        parts.append(f"prefill {continuous.prefill_computed} of {continuous.prefill_requested} tokens computed"
                     + _reuse(getattr(continuous, "from_disk", 0), getattr(continuous, "from_memory", 0)))
        if getattr(continuous, "prompt_cache", None):
            parts.append(continuous.prompt_cache)
    return " · ".join(parts)


def _reuse(from_disk: int, from_memory: int) -> str:
    return f" ({from_disk} from disk, {from_memory} from memory)" if from_disk or from_memory else ""


def prompt_cache_line(prefix: Any) -> str:
    """One line about a run's prompt cache (generation/prefix_cache.PrefixCache, or None: not used)."""
    if prefix is None:
        return "prompt cache: not used (only where reusing keys is exact: quantized weights, batch-invariant kernels)"
    stats = prefix.stats
    line = (f"prefill {stats.computed} of {stats.requested} tokens computed"
            + _reuse(stats.from_disk, stats.from_memory))
    return line + " · " + prompt_cache_state(prefix)


def prompt_cache_state(prefix: Any) -> str:
    """Where the prompt cache keeps blocks, or why it could not."""
    if prefix.unusable:
        return f"prompt cache: not used ({prefix.unusable})"
    disk = prefix.disk
    if disk is None:
        return "prompt cache: memory only"
    notes = []
    if disk.skipped:
        notes.append(f"{disk.skipped} damaged or foreign entries skipped")
    if not disk.writable:
        notes.append("not writable")
    return f"prompt cache: {disk.directory}" + (f" ({', '.join(notes)})" if notes else "")


def print_dim(line: str) -> None:
    """A summary line on stderr, dimmed, never read as markup."""
    from rich.console import Console

    Console(stderr=True).print(line, style="dim", highlight=False, markup=False, soft_wrap=True)


# From least to most likely: a reader's eye goes to where the model was unsure.
PROBABILITY_COLOURS = ((0.1, "bright_red"), (0.3, "dark_orange"), (0.6, "yellow"), (0.9, "green"))


def probability_style(probability: float | None) -> str | None:
    """The colour for text the model gave `probability`; None (plain) from 0.9 up."""
    if probability is None:
        return None
    for bound, colour in PROBABILITY_COLOURS:
        if probability < bound:
            return colour
    return None


class ProbabilityShading:
    """A streamed piece's probability: that of the least likely token behind it (a piece can join
    several tokens, e.g. the bytes of one character). Reads the row's recorded logprobs."""

    def __init__(self):
        self._seen = 0

    def probability(self, result: Any) -> float | None:
        steps = (result.logprobs or [])[self._seen:]
        self._seen += len(steps)
        return math.exp(min(step["logprob"] for step in steps)) if steps else None


def describe_tokenizer(tokenizer: Tokenizer | None) -> str:
    """One line about a tokenizer, for `lmcli info`."""
    if tokenizer is None:
        return "none (text cannot be encoded)"
    parts = [f"{type(tokenizer.backend.model).__name__}, {tokenizer.vocab_size:,} tokens"]
    if tokenizer.add_bos_token:
        parts.append("adds BOS")
    if tokenizer.eos_token_ids:
        parts.append(f"EOS ids {', '.join(map(str, tokenizer.eos_token_ids))}")
    return "; ".join(parts)


def human_count(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def describe_gguf_storage(path: Path) -> str:
    """How a GGUF file stores its weights: its file type and the tensor types by count, most bytes first."""
    from collections import Counter

    from gguf import LlamaFileType

    from lmcli.io.gguf_reader import read_gguf_header

    header = read_gguf_header(path)
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for info in header.tensors.values():
        counts[info.type_name] += 1
        sizes[info.type_name] += info.nbytes
    kinds = ", ".join(f"{name} ×{counts[name]}" for name, _ in sizes.most_common())
    file_type = header.metadata.get("general.file_type")
    try:
        label = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if isinstance(file_type, int) else None
    except ValueError:
        label = None
    return f"{label} ({kinds})" if label else kinds


# ----------------------------------------------------------------------------- lmcli info, lmcli models


def checkpoint_facts(resolved: ResolvedModel, model: Any, tokenizer: Tokenizer | None) -> list[tuple[str, str]]:
    """What `lmcli info` says about a loaded model, in order: what it is, its decoding defaults and
    where each comes from, and what lmcli keeps for it."""
    from lmcli.resolve.model_names import size_on_disk
    from lmcli.settings.generation_settings import GenerationSettings

    config, path = model.config, resolved.path
    parameters = model.num_parameters()
    window = config.sliding_window
    defaults = GenerationSettings().with_model_defaults(resolved.defaults)  # what `generate` uses with no flags
    return [
        ("checkpoint", resolved.described()),
        ("architecture", f"{config.architecture} (model_type {config.model_type})"),
        ("parameters", f"{human_count(parameters)} ({parameters:,})"),
        ("dtype", describe_dtype(model)),
        *([("quantization", describe_gguf_storage(path))] if resolved.kind == "gguf" else []),
        ("weights", describe_weights(model)),
        ("context length", f"{config.max_position_embeddings:,} tokens"),
        ("sliding window", f"{window:,} tokens" if window else "none"),
        *(config.stack_facts() if hasattr(config, "stack_facts") else []),  # an encoder-decoder's two stacks
        ("layers", str(config.num_hidden_layers)),
        ("hidden size", str(config.hidden_size)),
        ("heads", f"{config.num_attention_heads} (kv {config.num_key_value_heads})"),
        ("vocabulary", f"{config.vocab_size:,}"),
        ("tokenizer", describe_tokenizer(tokenizer)),
        ("chat template", "yes" if tokenizer is not None and tokenizer.chat_template else "no"),
        *((f"default {name}", f"{value} ({source})") for name, value, source in defaults.described()),
        ("file size", human_bytes(size_on_disk(path))),
        *((f"{kind} kernel", choice.describe()) for kind, choice in getattr(model, "kernel_choices", {}).items()),
        ("native kernels", _describe_native()),
        ("cache", describe_cache(path)),
    ]


def _describe_native() -> str:
    """Which code path of lmcli's C++ kernels runs on this CPU, or why none does (lmcli/native)."""
    from lmcli import native

    return native.describe()


def describe_dtype(model: Any) -> str:
    """"bfloat16", or for half-precision kernels in a float32 residual stream what runs in which."""
    dtype, residual = (str(d).removeprefix("torch.") for d in (model.dtype, getattr(model, "residual_dtype", model.dtype)))
    if dtype == residual:
        return dtype
    return f"{dtype} matrix products, attention and cache; {residual} residual stream, norms, rotary, top logits"


def describe_weights(model: Any) -> str:
    """How the loaded model stores its weights: "int4pack 106.2M, int4pair 28.3M, bfloat16 35.1k"."""
    counts = sorted(model.weight_formats().items(), key=lambda item: -item[1])
    return ", ".join(f"{form} {human_count(n)}" for form, n in counts)


def describe_cache(checkpoint: Path) -> str:
    """What lmcli keeps for this checkpoint under the cache directory, and how big it is."""
    from lmcli.paths import cache_dir
    from lmcli.resolve.default_model import dequantised_copies

    root = cache_dir()
    entries = [f"a dequantised {dtype} copy, {human_bytes(size)} (used by --quantize none)"
               for dtype, size in dequantised_copies(checkpoint)]
    if checkpoint.suffix == ".gguf":
        from lmcli.io.packed_cache import entries_for

        entries += [f"its loaded weights, packed, {human_bytes(entry.stat().st_size)} ({entry.relative_to(root)})"
                    for entry in entries_for(checkpoint)]
    from lmcli.io.compiled_cache import entries as compiled_entries

    entries += [f"a compiled decode step, {human_bytes(size)} ({entry.relative_to(root)})"
                for entry, size in compiled_entries()]
    if (root / "kernels.json").is_file():
        entries.append("measured kernel choices (kernels.json)")
    return f"{root}: " + ("; ".join(entries) if entries else "nothing for this checkpoint")


def print_facts(facts: list[tuple[str, str]], terminal: bool) -> None:
    """`KEY: VALUE` lines in a pipe (`lmcli info | grep`); a two-column table in a terminal."""
    if not terminal:
        for key, value in facts:
            print(f"{key}: {value}")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, box=None)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # long paths wrap rather than end in "…"
    for key, value in facts:
        table.add_row(key, value)
    Console().print(table)


_SOURCES = {"package": "PyPI package", "lmcli": "lmcli models dir", "hf": "HF hub cache"}


def print_models(terminal: bool) -> None:
    """`lmcli models`: the real models on this machine, then the architectures and presets.

    In a pipe, one record per line, kind first: `lmcli models | grep ^model` lists the real models."""
    from lmcli import registry
    from lmcli.resolve import model_names

    local = [
        (m.name, "default" if m.default else "", _SOURCES[m.source],
         human_bytes(model_names.size_on_disk(m.path)) if m.path.exists() else "", str(m.path), m.revision, m.note)
        for m in model_names.installed_models()
    ]
    presets = []
    for name in registry.list_presets():
        preset = registry.preset_config(name) or {}
        config = registry.config_from_hf(preset)
        sizes = (config.num_hidden_layers, config.hidden_size, config.max_position_embeddings)
        presets.append((name, config.architecture, *map(str, sizes), preset.get("_name_or_path", "")))
    architectures = ", ".join(registry.list_architectures())
    from lmcli.resolve.hub import PRESETS

    if not terminal:
        for model_row in local:
            print("\t".join(("model", *model_row)).rstrip("\t"))
        print(f"architectures\t{architectures}")
        for row in presets:
            print("\t".join(("preset", *row)))
        for name, ref in PRESETS.items():
            print(f"hub\t{name}\t{ref}")
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    searched = (f"searched: lmcli's models directory {model_names.models_dir()}, "
                f"the HF hub cache {model_names.hf_hub_cache()}")
    models_table = Table(title="Models on this machine (--model NAME)", title_justify="left", caption=searched,
                         caption_justify="left")
    notes = any(row[-1] for row in local)
    columns = ("name", "from", "size", "path", "revision", "note")[: 6 if notes else 5]
    for column in columns:
        models_table.add_column(column, overflow="fold")
    for name, default, *rest in local:
        models_table.add_row(f"{name} [bold](default)[/bold]" if default else name, *rest[: len(columns) - 1])
    if not local:
        models_table.add_row("(none found)", *[""] * (len(columns) - 1))
    console.print(models_table)
    console.print(f"[bold]Architectures:[/bold] {architectures}")
    table = Table(title="Presets (--model NAME with a .safetensors file, or to find its repo locally)",
                  title_justify="left")
    for column in ("preset", "architecture"):
        table.add_column(column)
    for column in ("layers", "hidden", "context"):
        table.add_column(column, justify="right")
    table.add_column("repo")
    for row in presets:
        table.add_row(*row)
    console.print(table)
    hub = Table(title="From the HuggingFace Hub by name (lmcli pull NAME, or -m NAME: downloads on first use)",
                title_justify="left", caption="Any ORG/REPO, ORG/REPO:QUANT or ORG/REPO/FILE.gguf works too.",
                caption_justify="left")
    hub.add_column("name")
    hub.add_column("REF")
    for name, ref in PRESETS.items():
        hub.add_row(name, ref)
    console.print(hub)
