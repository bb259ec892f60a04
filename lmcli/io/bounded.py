"""Reading files of a size a stranger chooses: refused past a bound before they fill memory.

`read_bounded` reads a whole file of at most `limit` bytes; its size on disk is checked first, and a
device or pipe (`/dev/zero`, whose size says nothing) is read no further than one byte past the
bound. `bounded_lines` streams a file line by line, each line at most `max_line` bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from lmcli.errors import LmcliError

MiB = 2**20
MAX_TOKENIZER_FILE = 512 * MiB  # tokenizer.json / tokenizer.model (the largest real ones are ~35 MB)
MAX_CONFIG_FILE = 64 * MiB  # tokenizer_config.json, special_tokens_map.json, chat_template.jinja ...
MAX_TRANSCRIPT = 256 * MiB  # a chat transcript saved by /save
MAX_INPUT_LINE = 64 * MiB  # one line of a job's --input

_CHUNK = MiB


def size_text(size: int) -> str:
    return f"{size / MiB:,.0f} MiB" if size >= MiB else f"{size:,} bytes"


def read_bounded(path: str | Path, limit: int, error: type[LmcliError], what: str = "") -> bytes:
    """The bytes of `path`, refused with `error` (naming the file) when it holds more than `limit`."""
    name = f"{what} {path}".strip()
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size > limit:
                raise error(f"{name}: the file is {size_text(size)}, more than the {size_text(limit)} lmcli reads")
            data = file.read(limit + 1)
    except OSError as e:
        raise error(f"cannot read {name}: {e.strerror or e}") from None
    if len(data) > limit:
        raise error(f"{name}: more than the {size_text(limit)} lmcli reads")
    return data


def bounded_lines(path: str | Path, max_line: int, error: type[LmcliError], what: str = "") -> Iterator[bytes]:
    """Each line of `path` without its newline, read as a stream; a line longer than `max_line`
    bytes is refused with `error` naming the file and the line."""
    name = f"{what} {path}".strip()
    try:
        with open(path, "rb") as file:
            number = 0
            while True:
                line = file.readline(max_line + 1)
                if not line:
                    return
                number += 1
                if len(line) > max_line and not (len(line) == max_line + 1 and line.endswith(b"\n")):
                    raise error(f"{name}, line {number}: longer than {size_text(max_line)}")
                yield line.removesuffix(b"\n")
    except OSError as e:
        raise error(f"cannot read {name}: {e.strerror or e}") from None
