"""What a person sees: live streaming outputs, the job progress bar, and one-line summaries (rich).

- `TerminalOutput` / `PlainOutput` write generated pieces live: rich with a dimmed
  prompt in a terminal; bare text, flushed piece by piece, in a pipe.
- `JobProgress` is a batch job's progress bar on stderr.
- `row_summary` / `job_summary` are the dim lines printed after a run.

rich is imported only when something is shown, to keep `import lmcli` quick.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import IO, Any

STOP_REASONS = {"eos": "end of text", "length": "token limit", "stop": "stop string"}


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

    def write(self, text: str) -> None:
        self._print(text)

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
    """One line about a finished row (a `RowResult`): tokens, speed, latency, why it stopped, its seed."""
    tokens = len(result.tokens)
    seconds = max((result.finished_at or result.started) - result.started, 1e-9)
    parts = [f"{tokens} tokens", f"{tokens / seconds:.1f} tokens/s"]
    if result.first_token_at is not None:
        parts.append(f"{(result.first_token_at - result.started) * 1000:.0f} ms to first token")
    parts.append(f"stopped: {STOP_REASONS.get(result.finish_reason, result.finish_reason)}")
    if result.row.seed is not None:
        parts.append(f"seed {result.row.seed}")
    return " · ".join(parts)


def job_summary(report: Any, output_path: Path | None) -> str:
    """One line about a finished job (a `JobReport`)."""
    parts = [f"{report.written} rows written" + (f" to {output_path}" if output_path else "")]
    if report.skipped:
        parts.append(f"{report.skipped} already done")
    parts.append(f"{report.tokens} tokens")
    parts.append(f"{report.tokens / max(report.seconds, 1e-9):.1f} tokens/s")
    return " · ".join(parts)


def print_dim(line: str) -> None:
    """A summary line on stderr, dimmed, never read as markup."""
    from rich.console import Console

    Console(stderr=True).print(line, style="dim", highlight=False, markup=False, soft_wrap=True)
