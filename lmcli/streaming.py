"""Text that streams out of a generation: stop strings and where the text goes.

Three small pieces, each usable alone:

- `StopMatcher` cuts a stream of text at the first stop string. Text that could
  still turn out to be the start of a stop string is held back until it is
  clear, so nothing after (or part of) a stop string is ever emitted.
- `RowText` turns one row's token ids into final text: incremental
  detokenisation (`lmcli.io.tokenizer.StreamDecoder`) followed by a StopMatcher.
  The pieces it returns concatenate to exactly the completion.
- `TerminalOutput` / `PlainOutput` write those pieces live: rich with a dimmed
  prompt in a terminal; bare text, flushed piece by piece, in a pipe.

Nothing here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO


class StopMatcher:
    """Finds the earliest stop string in text that arrives in pieces.

    `push(text)` returns the part of the text that is safe to emit: text that
    contains no stop string and cannot be the start of one. Once a stop string
    is complete, `stopped` is True and everything from the stop string on is
    dropped.
    """

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""  # a tail that is a proper prefix of some stop string

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        starts = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if starts:
            self.stopped = True
            self._held = ""
            return buffer[: min(starts)]
        held = self._longest_open_prefix(buffer)
        self._held = buffer[len(buffer) - held :]
        return buffer[: len(buffer) - held]

    def flush(self) -> str:
        """The held-back text, once the stream has ended without a stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_open_prefix(self, buffer: str) -> int:
        # The longest tail of `buffer` that a stop string starts with (but is not
        # all of: complete matches were found already). Stop strings are short,
        # so the quadratic scan costs nothing next to a decoding step.
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def stream_decoder(tokenizer):
    """An incremental detokeniser for `tokenizer` (pushes concatenate to the full decode)."""
    from lmcli.io.tokenizer import StreamDecoder

    return StreamDecoder(tokenizer)


class RowText:
    """Token ids in, final text out, for one row: detokenise, then cut at stop strings.

    The text is what the new tokens add after the prompt: `decode(prompt + new)`
    minus `decode(prompt)`. Decoding the new tokens on their own would differ at
    the seam: SentencePiece drops the leading space of the first token of a text,
    so "Hello" + "▁world" would print as "Helloworld".
    """

    CONTEXT_TOKENS = 4  # prompt tokens decoded along with the first new ones

    def __init__(self, tokenizer, stops: Iterable[str] = (), prompt_ids: list[int] = ()):
        self._decoder = stream_decoder(tokenizer)
        self._matcher = StopMatcher(stops)
        self._pieces: list[str] = []
        for token_id in list(prompt_ids)[-self.CONTEXT_TOKENS :]:
            self._decoder.push(token_id)  # context only: its text is the prompt's, not ours

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def push(self, token_id: int) -> str:
        return self._emit(self._matcher.push(self._decoder.push(token_id)))

    def finish(self) -> str:
        """Emit whatever was held back (a partial character, a possible stop prefix)."""
        if self._matcher.stopped:
            return ""
        return self._emit(self._matcher.push(self._decoder.flush()) + self._matcher.flush())

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece


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
