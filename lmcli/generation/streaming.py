"""Text that streams out of a generation: incremental detokenisation and stop strings.

Three small pieces, each usable alone:

- `StreamDecoder` turns ids into text one id at a time; the pieces joined
  equal the tokenizer's full decode.
- `StopMatcher` cuts a stream of text at the first stop string. Text that could
  still turn out to be the start of a stop string is held back until it is
  clear, so nothing after (or part of) a stop string is ever emitted.
- `RowText` turns one row's token ids into final text: incremental
  detokenisation (`StreamDecoder`) followed by a StopMatcher.
  The pieces it returns concatenate to exactly the completion.

Where the pieces go (terminal, pipe) is `lmcli.console`.

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for bytes that are not (yet) a whole character


class StreamDecoder:
    """Turns ids into text one id at a time; the pieces joined equal `tokenizer.decode(all_ids)`.

    Each push decodes a short window that starts a little before the new ids ("prefix offset")
    and returns only what lies past the text already emitted ("read offset"). Starting the window
    at an earlier, already-final token keeps context-dependent decoding (SentencePiece's leading
    space, merged byte tokens) the same as in the full decode. Text is held back while it ends in
    U+FFFD (a multi-byte character whose bytes have not all arrived) or while a run of
    byte-fallback tokens ("<0xE4>") may go on: the decoder turns a run into text all at once, and
    one bad byte later in the run turns the whole run into U+FFFD.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._invisible = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._reset()

    def _reset(self) -> None:
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: a token whose text is final
        self._read_offset = 0  # everything before this has been emitted
        self._in_byte_run = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self._ids.append(token_id)
        if token_id not in self._invisible:  # skipped tokens vanish before decoding, joining runs
            self._in_byte_run = self.tokenizer.is_byte_token(token_id)
        if self._in_byte_run:
            return ""
        emitted = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if len(window) > len(emitted) and not window.endswith(REPLACEMENT_CHAR):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return window[len(emitted):]
        return ""

    def flush(self) -> str:
        """The text still held back (an unfinished character becomes U+FFFD); ends the stream."""
        emitted = self._decode(self._ids[self._prefix_offset:self._read_offset])
        rest = self._decode(self._ids[self._prefix_offset:])[len(emitted):]
        self._reset()
        return rest


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


class RowText:
    """Token ids in, final text out, for one row: detokenise, then cut at stop strings.

    The text is what the new tokens add after the prompt: `decode(prompt + new)`
    minus `decode(prompt)`. Decoding the new tokens on their own would differ at
    the seam: SentencePiece drops the leading space of the first token of a text,
    so "Hello" + "▁world" would print as "Helloworld".
    """

    CONTEXT_TOKENS = 4  # prompt tokens decoded along with the first new ones

    def __init__(self, tokenizer: Any, stops: Iterable[str] = (), prompt_ids: Sequence[int] = ()) -> None:
        self._decoder = StreamDecoder(tokenizer)
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
