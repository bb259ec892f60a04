"""What a start skips before the first token: the GGUF's vocabulary when only its settings are read,
and Python's cyclic collector while the model loads (lmcli/command_group.py).

The settings reader (`read_gguf_metadata(texts=False)`) is checked against the full reader, which
test_gguf_vocabulary checks against the `gguf` package: the same values for every key it keeps,
only the arrays of strings left out, and the same error for a file whose strings run past its end.
"""

from __future__ import annotations

import gc
import struct
from pathlib import Path

import pytest
from real_models import smollm2_gguf  # noqa: F401

from lmcli import command_group
from lmcli.errors import GGUFError
from lmcli.io.gguf_reader import read_gguf_metadata
from lmcli.settings.model_defaults import read_model_defaults


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _write_gguf(path: Path) -> Path:
    """A GGUF of metadata only (version 3, no tensors), written byte by byte here: sampling settings
    before and after vocabulary-like arrays of strings, a nested array, numbers."""
    entries = [
        ("general.architecture", 8, _string("llama")),
        ("general.sampling.temp", 6, struct.pack("<f", 0.5)),
        ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 4) + b"".join(map(_string, ["a", "b c", "", "é✓"]))),
        ("tokenizer.ggml.token_type", 9, struct.pack("<IQ", 5, 4) + struct.pack("<4i", 1, 1, 3, 4)),
        ("general.sampling.top_k", 5, struct.pack("<i", 7)),
        ("general.nested", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 8, 2) + _string("x") + _string("y")),
        ("tokenizer.ggml.merges", 9, struct.pack("<IQ", 8, 2) + _string("a b") + _string("b c")),
        ("general.sampling.top_p", 6, struct.pack("<f", 0.75)),
    ]
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries))
    for key, value_type, value in entries:
        body += _string(key) + struct.pack("<I", value_type) + value
    path.write_bytes(body)
    return path


def _without_text_arrays(metadata: dict) -> dict:
    return {key: value for key, value in metadata.items()
            if not (isinstance(value, list) and value and all(isinstance(item, str) for item in value))}


def test_the_settings_reader_leaves_out_only_the_arrays_of_strings(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf")
    full, settings = read_gguf_metadata(path), read_gguf_metadata(path, texts=False)
    assert full["tokenizer.ggml.tokens"] == ["a", "b c", "", "é✓"]  # what the full read gives
    assert settings == _without_text_arrays(full)
    assert settings["general.nested"] == [["x", "y"]]  # only a top-level array of strings is stepped over
    assert settings["general.sampling.top_p"] == 0.75 and settings["general.sampling.top_k"] == 7
    assert read_model_defaults(path).values == {"temperature": 0.5, "top_k": 7, "top_p": 0.75}


@pytest.mark.parametrize("cut", [1, 9])  # inside tokenizer.ggml.merges: its last string, or that string's length
def test_a_string_array_past_the_end_is_the_same_error_either_way(tmp_path, cut):
    path = tmp_path / "m.gguf"
    whole = _write_gguf(path).read_bytes()
    last_entry = len(_string("general.sampling.top_p")) + 4 + 4  # key, type, float32: after the merges
    path.write_bytes(whole[:len(whole) - last_entry - cut])
    with pytest.raises(GGUFError) as full:
        read_gguf_metadata(path)
    with pytest.raises(GGUFError) as settings:
        read_gguf_metadata(path, texts=False)
    assert str(settings.value) == str(full.value) and "tokenizer.ggml.merges" in str(full.value)


def test_the_default_models_settings_are_its_full_metadata_less_the_vocabulary(smollm2_gguf):
    full, settings = read_gguf_metadata(smollm2_gguf), read_gguf_metadata(smollm2_gguf, texts=False)
    assert settings == _without_text_arrays(full)
    assert set(full) - set(settings) >= {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"}


@pytest.fixture
def collector():
    """Python's collector as the test found it, whatever the test does to it."""
    was_enabled = gc.isenabled()
    yield
    gc.unfreeze()
    command_group._collection_deferred = False
    (gc.enable if was_enabled else gc.disable)()


def test_collection_waits_for_the_model_only_on_a_command_that_loads_one(collector):
    gc.enable()
    command_group.defer_collection(["lmcli", "bench", "--quick"])
    assert gc.isenabled()
    command_group.defer_collection(["lmcli", "generate", "--greedy", "hi"])
    assert not gc.isenabled()
    kept = object()  # made during the start-up: lives on, out of later collections
    command_group.resume_collection()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert kept is not None
    command_group.resume_collection()  # a second load (chat's /reload) changes nothing
    assert gc.isenabled()
