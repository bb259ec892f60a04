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


def read_bounded(path: str | Path, limit: int, error: type[LmcliError], what: str = "", *,
                 unreadable: str = "cannot read {name}: {reason}",
                 too_large: str = "{name}: the file is {size}, more than the {limit} lmcli reads") -> bytes:
    """The bytes of `path`, refused with `error` (naming the file) when it holds more than `limit`.

    `unreadable` and `too_large` word the refusals (fields: name, reason; name, size, limit) where a
    caller's messages differ; a device or pipe read past the bound says "more than the ... lmcli reads"."""
    name = f"{what} {path}".strip()
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size > limit:
                raise error(too_large.format(name=name, size=size_text(size), limit=size_text(limit)))
            data = file.read(limit + 1)  # bounded whatever the file is: /dev/zero's size says nothing
    except OSError as e:
        raise error(unreadable.format(name=name, reason=e.strerror or e)) from None
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


# ----------------------------------------------------------------------------- nesting

# How deep the arrays and objects of a JSON value from a stranger (a schema, a job row) may nest: past
# this, Python's json module and lmcli's own walks would recurse into a RecursionError, and the
# constraint engine (serde_json) refuses past 128 levels of its own. Real schemas nest a few levels.
MAX_JSON_DEPTH = 100
# A job row's line: a schema lies up to 5 levels inside it (an OpenAI request's body, response_format,
# json_schema, schema), so any schema the command line takes fits in a row too.
MAX_ROW_DEPTH = MAX_JSON_DEPTH + 10

_JSON_STRING = None  # compiled on first use: a JSON string literal, whose brackets are text


def text_deeper_than(text: str, limit: int) -> bool:
    """Whether the JSON `text` nests arrays and objects more than `limit` deep, found without parsing it
    (and without recursion), so the check can come before json.loads. Brackets inside strings do not
    count; in text that is not JSON the answer only errs towards "deeper"."""
    if text.count("[") + text.count("{") <= limit:  # the common case: too few brackets to go that deep
        return False
    import re

    global _JSON_STRING
    if _JSON_STRING is None:
        _JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
    skeleton = re.sub(r"[^\[\]{}]+", "", _JSON_STRING.sub("", text)).encode("ascii")
    import numpy as np

    depth = 0
    for start in range(0, len(skeleton), _CHUNK):  # a chunk at a time: memory stays small on a 64 MiB line
        codes = np.frombuffer(skeleton, dtype=np.uint8, count=min(_CHUNK, len(skeleton) - start), offset=start)
        steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
        levels = np.cumsum(steps, dtype=np.int32) + depth  # the depth after each bracket
        if int(levels.max()) > limit:
            return True
        depth = int(levels[-1])
    return False


def value_deeper_than(value: object, limit: int) -> bool:
    """Whether a parsed JSON value (dicts, lists, scalars) nests more than `limit` deep, walked with a
    stack rather than recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False
