"""Reading a job's output for --resume, line by line (jobs.read_finished says what is kept of it),
and rewriting it without the lines resume drops."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError
from lmcli.io.atomic import atomic_file
from lmcli.io.bounded import MAX_INPUT_LINE

MAX_OUTPUT_LINE = 4 * MAX_INPUT_LINE  # an output row holds its prompt, its text and maybe logprobs


def output_lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, bytes without the newline, whether it ended with one) of each line of an output."""
    try:
        with open(path, "rb") as file:
            for number, line in enumerate(iter(lambda: file.readline(MAX_OUTPUT_LINE + 1), b""), start=1):
                if len(line) > MAX_OUTPUT_LINE:
                    raise LmcliError(f"{path}, line {number}: longer than any row lmcli writes; fix or remove it")
                yield number, line.removesuffix(b"\n"), line.endswith(b"\n")
    except OSError as e:
        raise LmcliError(f"cannot read {path}: {e.strerror or e}") from None


def kept_record(row: dict, record: dict, models: dict[str, Any]) -> dict:
    """What resume needs of a finished row: output_row_key's answer and what _check_resumable reads."""
    model = record.get("model")
    if isinstance(model, dict):
        model = models.setdefault(json.dumps(model, sort_keys=True), model)
    kept = {"input_hash": record.get("input_hash"), "model": model}
    if "custom_id" in row and "response" in row:  # an OpenAI batch response row
        return {"custom_id": row["custom_id"], "response": None, "lmcli": kept}
    return {"id": row["id"], **kept}


def rewrite_without(path: Path, dropped: set[int]) -> None:
    """The output without the lines `dropped`, written beside it and renamed over it (durably)."""
    try:
        with atomic_file(path) as temporary, open(temporary, "wb") as out:
            for number, raw, _ in output_lines(path):
                if number not in dropped:
                    out.write(raw + b"\n")
            out.flush()
            os.fsync(out.fileno())
    except OSError as e:
        raise LmcliError(f"cannot rewrite {path}: {e.strerror or e}") from None
