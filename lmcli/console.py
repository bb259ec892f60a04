"""What a person sees: live streaming outputs, the job progress bar, and one-line summaries (rich).

- `TerminalOutput` / `PlainOutput` write generated pieces live: rich with a dimmed
  prompt in a terminal; bare text, flushed piece by piece, in a pipe.
- `JobProgress` is a batch job's progress bar on stderr.
- `row_summary` / `job_summary` are the dim lines printed after a run; the rest describe a
  checkpoint for `lmcli info`.
- `probability_style` / `ProbabilityShading` colour streamed text by probability (--color-probs).

rich is imported only when something is shown, to keep `import lmcli` quick.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcli.io.tokenizer import Tokenizer

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
    return " · ".join(parts)


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


def human_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


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
