"""A job's input: its rows, read from JSONL (lmcli rows or OpenAI batch requests) or plain text.

What each row may hold and how it ranks against the flags is jobs/runner.py's docstring (the README's job
section); the settings of a row are settings/generation_settings.py's to check.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError, UsageError
from lmcli.settings.generation_settings import JOB_ROW_SETTINGS, GenerationSettings, RowError, input_hash, input_hasher

ROW_FIELDS = ("prompt", "id", *JOB_ROW_SETTINGS)


@dataclass
class JobRow:
    """One input row: either a prompt with its settings, or an error to report."""

    line: int
    id: int | str
    input_hash: str
    prompt: str | list[dict] | None = None  # chat messages for an OpenAI chat request
    settings: GenerationSettings | None = None
    error: str | None = None
    url: str | None = None  # the OpenAI endpoint; None for an lmcli row


def read_rows(path: Path, settings: GenerationSettings) -> list[JobRow]:
    """Read a job's input: JSONL when the name ends in .jsonl, else one prompt per line."""
    rows = list(_parse_rows(path, settings))
    _refuse_duplicate_ids(rows)
    return rows


class JobRows:
    """A job's input read as it is consumed (a 1,000,000-row file is never held in memory): each
    iteration reads the file again, a row at a time. Made by one pass that counts the rows and refuses
    duplicate ids (keeping 8 bytes per row); `where` and slices are views that read lazily too."""

    def __init__(self, path: Path, settings: GenerationSettings, keep=None, step: slice | None = None):
        self.path, self.settings = path, settings
        self._keep, self._slice = keep, step
        self._length: int | None = None
        if keep is None and step is None:
            self._length = _count_refusing_duplicates(path, settings)

    def __iter__(self) -> Iterator[JobRow]:
        rows: Iterator[JobRow] = _parse_rows(self.path, self.settings)
        if self._keep is not None:
            rows = (row for row in rows if self._keep(row))
        if self._slice is not None:
            rows = itertools.islice(rows, self._slice.start, self._slice.stop, self._slice.step)
        return rows

    def __len__(self) -> int:
        if self._length is None:
            self._length = sum(1 for _ in self)
        return self._length

    def __bool__(self) -> bool:
        return len(self) > 0

    def where(self, keep) -> JobRows:
        """The rows for which `keep(row)` is true (a view: `self` must be unfiltered)."""
        return JobRows(self.path, self.settings, keep)

    def __getitem__(self, part: slice) -> JobRows:
        """A data-parallel rank's share, rows[rank::world] (a view)."""
        if not isinstance(part, slice) or self._slice is not None:
            raise TypeError("JobRows takes one slice")
        return JobRows(self.path, self.settings, self._keep, part)


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line, read as a stream (/dev/zero is refused)."""
    from lmcli.io.bounded import MAX_INPUT_LINE, bounded_lines

    for number, raw in enumerate(bounded_lines(path, MAX_INPUT_LINE, LmcliError, "input"), start=1):
        yield number, raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw  # a byte order mark


def _parse_rows(path: Path, settings: GenerationSettings) -> Iterator[JobRow]:
    def lines() -> Iterator[tuple[int, bytes]]:
        return _lines(path)

    from lmcli.io.bounded import MAX_ROW_DEPTH, text_deeper_than

    def decides(raw: bytes) -> bool:  # the first row that can be read decides the format (a too deep one cannot)
        return bool(raw.strip()) and not text_deeper_than(raw.decode("utf-8", "replace"), MAX_ROW_DEPTH)

    parse = _parse_jsonl_line if str(path).endswith(".jsonl") else _text_line_parser(settings)
    if parse is _parse_jsonl_line and is_openai_file(next((raw for _, raw in lines() if decides(raw)), b"")):
        parse = _parse_openai_line
    for number, raw in lines():
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError:
            yield _bad_row(number, number, "not valid UTF-8", repr(raw), settings)
            continue
        yield parse(number, text, settings)


def _text_line_parser(settings: GenerationSettings) -> Callable[[int, str, GenerationSettings], JobRow]:
    """Plain-text lines share the job's settings: their part of each row's input hash is written once."""
    hash_prompt = input_hasher(settings)

    def parse(number: int, text: str, settings: GenerationSettings) -> JobRow:
        prompt = unescape_line(text)
        return JobRow(number, number, hash_prompt(prompt), prompt=prompt, settings=settings)

    return parse


def unescape_line(text: str) -> str:
    """Plain-text input writes a newline inside a prompt as \\n and a backslash as \\\\."""
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "n\\":
            out.append("\n" if text[i + 1] == "n" else "\\")
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _parse_jsonl_line(number: int, text: str, settings: GenerationSettings) -> JobRow:
    obj, bad = _decode(number, text, settings)
    if bad is not None:
        return bad
    if not isinstance(obj, dict):
        return _bad_row(number, number, "a row must be a JSON object", text, settings)
    row_id = obj.get("id", number)
    if isinstance(row_id, bool) or not isinstance(row_id, (int, str)):
        return _bad_row(number, number, '"id" must be a string or an integer', text, settings)
    try:
        unknown = sorted(set(obj) - set(ROW_FIELDS))
        if unknown:
            raise RowError(f'unknown field "{unknown[0]}" (a row may have: {", ".join(ROW_FIELDS)})')
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise RowError('"prompt" is missing' if prompt is None else '"prompt" must be a string')
        if not prompt:  # as on the command line: an empty prompt is refused, not run from BOS alone
            raise RowError('"prompt" is empty')
        row_settings = settings.for_row(obj)
    except RowError as e:
        return _bad_row(number, row_id, str(e), text, settings, prompt=obj.get("prompt"))
    return JobRow(number, row_id, input_hash(prompt, row_settings), prompt=prompt, settings=row_settings)


def is_openai_file(data: bytes) -> bool:
    """Whether a .jsonl file holds OpenAI batch requests: decided by its first row."""
    from lmcli.io.bounded import MAX_ROW_DEPTH, text_deeper_than
    from lmcli.jobs import openai_batch

    first = next((line for line in data.split(b"\n") if line.strip()), b"").decode("utf-8", "replace")
    if text_deeper_than(first, MAX_ROW_DEPTH):  # json.loads would recurse past Python's limit
        return False
    try:
        return openai_batch.is_request(json.loads(first))
    except ValueError:
        return False


def _parse_openai_line(number: int, text: str, settings: GenerationSettings) -> JobRow:
    """An OpenAI batch request (see jobs/openai_batch.py); its body's fields rank as a row's do (under the flags)."""
    from lmcli.jobs import openai_batch

    obj, bad = _decode(number, text, settings, url="?")
    if bad is not None:
        return bad
    custom_id = openai_batch.request_id(obj)
    if custom_id is None:
        return _bad_row(number, number, '"custom_id" must be a non-empty string', text, settings, url="?")
    try:
        url, prompt, overrides, logprobs = openai_batch.parse_request(obj)
        row_settings = dataclasses.replace(
            settings.for_row(overrides), chat=url == openai_batch.CHAT, system=None, logprobs=logprobs
        )
    except RowError as e:
        message = openai_batch.in_body_terms(str(e), obj)
        return _bad_row(number, custom_id, message, text, settings, url=str(obj.get("url")))
    return JobRow(number, custom_id, input_hash(prompt, row_settings), prompt=prompt, settings=row_settings, url=url)


def _decode(number: int, text: str, settings: GenerationSettings, url: str | None = None) -> tuple[Any, JobRow | None]:
    """A line's JSON value, or the error row that says why it has none. Its depth is checked first:
    json.loads recurses a frame a level, and a RecursionError would end the whole job."""
    from lmcli.io.bounded import MAX_ROW_DEPTH, text_deeper_than

    if text_deeper_than(text, MAX_ROW_DEPTH):
        return None, _bad_row(number, number, f"arrays and objects nest more than {MAX_ROW_DEPTH} levels deep",
                              text, settings, url=url)
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, _bad_row(number, number, f"not valid JSON ({e.msg} at column {e.colno})", text, settings, url=url)


def _bad_row(number, row_id, message, text, settings, prompt=None, url=None) -> JobRow:
    prompt = prompt if isinstance(prompt, str) else None
    return JobRow(number, row_id, input_hash(text, settings), prompt=prompt, error=f"line {number}: {message}", url=url)


def id_key(row_id: Any) -> str:
    """A row id as a dict key: 7 and "7" are different ids, and JSON text tells them apart."""
    return json.dumps(row_id)


def _count_refusing_duplicates(path: Path, settings: GenerationSettings) -> int:
    """How many rows the input has; refuses duplicate ids as read_rows does, keeping only a 64-bit
    digest per row (the lines of a digest that repeats are then found by a second pass; a plain-text
    file's ids are its line numbers, so its lines are only counted). The digests
    are kept in 256 arrays by their first byte and sorted one array at a time, so what the sort makes
    of them (Python ints, about 40 bytes each) is for 1/256 of the rows at once."""
    import hashlib
    from array import array

    if not str(path).endswith(".jsonl"):  # plain text: a row's id is its line number, never repeated
        return sum(1 for _, raw in _lines(path) if raw.strip())

    def digest(row: JobRow) -> int:
        return int.from_bytes(hashlib.blake2b(id_key(row.id).encode(), digest_size=8).digest(), "little", signed=True)

    buckets = [array("q") for _ in range(256)]
    count = 0
    for row in _parse_rows(path, settings):
        value = digest(row)
        buckets[value & 255].append(value)
        count += 1
    repeated: set[int] = set()
    for bucket in buckets:
        ordered = sorted(bucket)
        repeated.update(a for a, b in itertools.pairwise(ordered) if a == b)
    del ordered, buckets
    if repeated:
        _refuse_duplicate_ids([row for row in _parse_rows(path, settings) if digest(row) in repeated])
    return count


def _refuse_duplicate_ids(rows: list[JobRow]) -> None:
    seen: dict[str, int] = {}
    for row in rows:
        key = id_key(row.id)
        if key in seen:
            raise UsageError(
                f"input lines {seen[key]} and {row.line} have the same id {key}; ids must be unique"
                " (a row without an id takes its line number)"
            )
        seen[key] = row.line
