"""Every byte of a packed-weights entry that changes the numbers is checked (issue 31, defect 7), and the
entry's other checks each hold on their own (issue 31's audit: trailing bytes, a name over a class
attribute, a missing parameter), and an entry is on disk before it is renamed into place.

The reference is always a load that reads the GGUF itself (LMCLI_PACKED_CACHE=0), which test_gguf and
test_real_models check against transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from real_models import smollm2_gguf  # noqa: F401 (fixture, by name)
from test_startup_packed import _entries, _logits, cache, kernel_probes, tiny_gguf  # noqa: F401 (fixtures)

from lmcli.io import packed_cache

pytestmark = pytest.mark.usefixtures("one_thread")


def _split(data: bytes) -> tuple[dict, int]:
    length = int.from_bytes(data[8:16], "little")
    return json.loads(data[16:16 + length]), -(-(16 + length) // packed_cache.ALIGN) * packed_cache.ALIGN


def _old_samples(total: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pieces the checksum covered before (each tensor's first and last 4 KiB, 32 pieces of 64 KiB)."""
    pieces = {(start, min(length, 4096)) for start, length in spans}
    pieces |= {(start + max(0, length - 4096), min(length, 4096)) for start, length in spans}
    pieces |= {(total * i // 32, min(65536, total - total * i // 32)) for i in range(32)}
    return sorted(pieces)


def _refused_then_rebuilt(path: Path, cache: Path, capfd, want: torch.Tensor, why: str) -> None:
    entry = _entries(cache)[0]
    capfd.readouterr()
    got, _ = _logits(path)
    assert torch.equal(got, want)
    notes = capfd.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith(f"note: {entry.name}: packed weights not used ({why}"), notes
    again, _ = _logits(path)  # the entry written again, whole, and used
    assert torch.equal(again, want) and "not used" not in capfd.readouterr().err


@pytest.fixture
def medium_gguf(tmp_path, monkeypatch) -> Path:
    """tiny_gguf's llama, wide enough (4.5 MB packed) that the old samples left most bytes unread."""
    from test_gguf import write_gguf_like_llama_cpp
    from test_startup_packed import FIELDS, _with_vocabulary, gguf
    from tiny import random_reference

    fields = dict(FIELDS, hidden_size=512, intermediate_size=2048, num_hidden_layers=2)
    model = random_reference("llama", fields)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    _with_vocabulary(monkeypatch, fields["vocab_size"])
    kinds = {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0}
    return write_gguf_like_llama_cpp(tmp_path / "medium.gguf", model.config.to_dict(), state, "llama",
                                     qtype=lambda name, w: kinds.get(name, gguf.GGMLQuantizationType.Q4_0))


@pytest.mark.parametrize("model", ["medium", pytest.param("default", marks=pytest.mark.full)])
def test_changed_block_scales_outside_the_old_samples_are_caught(model, request, cache, capfd):
    """72 bytes of one layer's block scales, away from every piece the sampled checksum read: the default
    model then answered " Paris Paris Paris ..." from the entry, with no note (the default model's case
    takes a minute on a busy machine: `full`)."""
    path = request.getfixturevalue("medium_gguf" if model == "medium" else "smollm2_gguf")
    want, _ = _logits(path, packed=False)
    _logits(path)
    (entry,) = _entries(cache)
    data = bytearray(entry.read_bytes())
    header, start = _split(bytes(data))
    spans = [(t["offset"], t["nbytes"]) for t in header["tensors"]]
    samples = _old_samples(header["data_bytes"], spans)
    outside = [p for kernel in header["kernels"] if "scales_and_zeros" in kernel["buffers"]
               for offset, nbytes in [spans[kernel["buffers"]["scales_and_zeros"]["tensor"]]]
               for p in range(offset + 4096, offset + nbytes - 4096 - 72, 64)
               if all(p + 72 <= a or a + n <= p for a, n in samples)]  # in a block-scale tensor, unsampled
    place = outside[len(outside) // 2]
    values = torch.frombuffer(data, dtype=torch.bfloat16, offset=start + place, count=36)
    values.mul_(8)  # the 36 scales (and zeros) there, 8 times larger
    entry.write_bytes(bytes(data))
    _refused_then_rebuilt(path, cache, capfd, want, "checksum differs")


def _rewrite_header(entry: Path, change) -> None:
    """The entry with its header changed by `change(header)` and its checksum made right again (so that
    only the check under test can refuse it), the data where it was."""
    data = entry.read_bytes()
    header, start = _split(data)
    del header["crc32"]
    change(header)
    crc = packed_cache._checksum(header, memoryview(data)[start:], packed_cache._pieces(header["data_bytes"]))
    encoded = packed_cache._encode(header, crc)
    assert len(encoded) <= start
    body = encoded[16:] + b" " * (start - len(encoded))  # JSON allows the trailing spaces
    entry.write_bytes(packed_cache.MAGIC + len(body).to_bytes(8, "little") + body + data[start:])


def test_a_changed_config_in_the_header_is_caught(tiny_gguf, cache, capfd):
    """The header's config and settings change the numbers as much as the data: under the checksum too."""
    want, _ = _logits(tiny_gguf, packed=False)
    _logits(tiny_gguf)
    (entry,) = _entries(cache)
    data = bytearray(entry.read_bytes())
    at = data.index(b'"rms_norm_eps": ') + len(b'"rms_norm_eps": ')
    data[at] = ord("9") if data[at] != ord("9") else ord("8")  # the same length: the data stays in place
    entry.write_bytes(bytes(data))
    _refused_then_rebuilt(tiny_gguf, cache, capfd, want, "checksum differs")


# Two checks in `make test`; the other three refusals in `make test-full`.
@pytest.mark.parametrize("damage", ["trailing bytes", "a missing parameter", *(
    pytest.param(damage, marks=pytest.mark.full) for damage in ["a parameter over a method",
                                                                "a kernel buffer over a method", "a missing buffer"])])
def test_each_check_of_an_entry_refuses_it_on_its_own(damage, tiny_gguf, cache, capfd):
    want, _ = _logits(tiny_gguf, packed=False)
    _logits(tiny_gguf)
    (entry,) = _entries(cache)
    if damage == "trailing bytes":
        entry.write_bytes(entry.read_bytes() + bytes(64))
        why = "size differs from its header"
    elif damage == "a parameter over a method":
        def change(header):
            ref = header["parameters"].pop("model.norm.weight")
            header["parameters"]["model.norm.double"] = ref  # nn.Module.double, a method
        _rewrite_header(entry, change)
        why = "a module or tensor named 'model.norm.double'"
    elif damage == "a kernel buffer over a method":
        def change(header):
            buffers = header["kernels"][0]["buffers"]
            buffers["forward"] = buffers.pop(next(iter(buffers)))
        _rewrite_header(entry, change)
        why = ""
    elif damage == "a missing parameter":
        _rewrite_header(entry, lambda header: header["parameters"].pop("model.norm.weight"))
        why = "parameters differ from the model's"
    else:
        _rewrite_header(entry, lambda header: header["kernels"][0]["buffers"].popitem())
        why = ""
    _refused_then_rebuilt(tiny_gguf, cache, capfd, want, why)


def test_an_entry_is_on_disk_before_it_is_renamed_into_place(tiny_gguf, cache, monkeypatch):
    """Durability: the entry's file is fsync'd (after its header is written) before the rename makes it
    the entry: a crash in between leaves a hidden temporary, never a half-written entry."""
    from lmcli.io import atomic

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_replace(source, target) -> None:
        events.append(("replace", str(target)))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(atomic.os, "replace", spy_replace)
    _logits(tiny_gguf)
    (entry,) = _entries(cache)
    renamed = events.index(("replace", str(entry)))
    assert any(kind == "fsync" and Path(path).name.startswith(f".{entry.name}.partial-")
               for kind, path in events[:renamed]), events
