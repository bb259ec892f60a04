"""The GGUF reader's fast path for string arrays (vocabularies, merges) against what was written and
against the gguf package's own GGUFReader, an independent reader of the same bytes."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
from real_models import gemma_gguf, smollm2_gguf  # noqa: F401

from lmcli.errors import GGUFError
from lmcli.io.gguf_reader import read_gguf_metadata

# Bytes a vocabulary can hold: plain, empty, multi-byte, a lone continuation byte, a cut-off 3-byte
# character, a NUL, the byte alphabet's stand-ins.
AWKWARD = [b"the", b"", "ü▁world".encode(), b"\x80", b"\xe2\x96", b"a\x00b", "Ġhello".encode(), b"<0x0A>"]


def _strings(count: int) -> list[bytes]:
    rng = random.Random(17)
    return [*AWKWARD, *(bytes(rng.randrange(256) for _ in range(rng.randrange(12))) for _ in range(count))]


def _write(path: Path, strings: list[bytes]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("t.before", [1, 2, 3])
    writer.add_key_value("t.strs", strings, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    writer.add_string("t.after", "still read")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _their_strings(path: Path, key: str) -> list[str]:
    field = gguf.GGUFReader(str(path)).fields[key]
    return [bytes(field.parts[index]).decode("utf-8", errors="replace") for index in field.data]


def test_string_arrays_read_as_written_and_as_gguf_reads_them(tmp_path):
    strings = _strings(3000)
    path = _write(tmp_path / "strs.gguf", strings)
    ours = read_gguf_metadata(path)
    assert ours["t.strs"] == [raw.decode("utf-8", errors="replace") for raw in strings]
    assert ours["t.strs"] == _their_strings(path, "t.strs")
    assert ours["t.after"] == "still read" and ours["t.before"] == [1, 2, 3]  # the position after is right


def _string_array_start(raw: bytes) -> int:
    """Offset of the first string's length field in t.strs (after key, value type, item type, count)."""
    return raw.index(b"t.strs") + len(b"t.strs") + 4 + 4 + 8


@pytest.mark.parametrize("where", ["in a string", "in a length field", "a length past the end"])
def test_a_string_array_cut_short_is_refused_naming_the_key(tmp_path, where):
    raw = _write(tmp_path / "strs.gguf", [b"abc"] * 1000).read_bytes()
    start = _string_array_start(raw)
    each = 8 + 3
    assert raw[start:start + each] == (3).to_bytes(8, "little") + b"abc"  # the layout this test assumes
    if where == "in a string":
        damaged = raw[:start + 900 * each + 9]
    elif where == "in a length field":
        damaged = raw[:start + 900 * each + 4]
    else:
        at = start + 900 * each
        damaged = raw[:at] + (2**62).to_bytes(8, "little") + raw[at + 8:]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damaged)
    with pytest.raises(GGUFError) as caught:
        read_gguf_metadata(bad)
    message = str(caught.value)
    assert "\n" not in message and "truncated file" in message and "metadata 't.strs'" in message
    assert f"at byte {start + 900 * each + (8 if where != 'in a length field' else 0)}" in message


def _vocabulary_matches_gguf_reader(path: Path) -> None:
    ours = read_gguf_metadata(path)
    fields = gguf.GGUFReader(str(path)).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key in fields:
            assert ours[key] == _their_strings(path, key), key
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in fields:
            field = fields[key]
            theirs = np.concatenate([field.parts[index] for index in field.data])
            assert np.array_equal(np.asarray(ours[key], dtype=theirs.dtype), theirs), key


@pytest.mark.full  # gguf.GGUFReader takes tens of seconds on a real vocabulary
def test_default_model_vocabulary_matches_gguf_reader(smollm2_gguf):
    _vocabulary_matches_gguf_reader(smollm2_gguf)


@pytest.mark.full
def test_gemma_vocabulary_matches_gguf_reader(gemma_gguf):
    _vocabulary_matches_gguf_reader(gemma_gguf)
