"""A GGUF model as loaded, kept on disk: its packed kernels and float tensors, mapped back at the next start.

Loading a quantized GGUF decodes every block, packs the codes for the int4 kernel and joins each
layer's projections; that is most of a start (measured on the default model: about 1 s of 1.3 s
after `import torch`). The result is the same for the same file, code and torch build, so after the
first load it is written here once (`save`) and later loads map it (`restore`): no copy is made, the
tensors are pages of the file.

An entry is one file, `<lmcli cache>/packed/<stem>-<key digest>.lmpk`:
  8 bytes magic, 8 bytes header length (little-endian), the JSON header, zero padding to 64 bytes,
  then each tensor's bytes (64-byte aligned) in the header's order.
The header holds the key (the file's fingerprint, lmcli's source code, torch's version, the CPU and the
kernel settings), the module tree, each kernel's settings, each tensor's dtype, shape and place, and a
CRC-32 of the whole data region (every stored byte). It is checked before anything is used: a stale or damaged entry
(wrong key, size, bounds, dtype, class or checksum) is deleted and the model is loaded from the GGUF
and written again. Entries are written through io/atomic.py, so a writer killed midway leaves only a
hidden temporary, and two writers each rename a complete file of their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmcli.errors import first_line
from lmcli.io.fingerprint import source_digest

if TYPE_CHECKING:
    from lmcli.io.tokenizer import Tokenizer

FORMAT = 2  # bump when the file layout or what the header means changes
MAGIC = b"LMCLIPK\x01"
ALIGN = 64
MAX_HEADER = 16 << 20  # a header claiming more is not one of ours
PIECE_BYTES = 1 << 22  # the checksum reads the data in pieces of this size
ENV = "LMCLI_PACKED_CACHE"  # "0": neither read nor write entries



# The tensor dtypes an entry may hold, by the names its header gives them.
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                                                      torch.int8, torch.int32, torch.int64, torch.bool)}


class Damaged(ValueError):
    """An entry that is not what this format writes, or does not fit the model."""


def enabled() -> bool:
    return os.environ.get(ENV, "") != "0"


def _code_version() -> str:
    """lmcli's own sources that decide what a load builds (readers, kernels, models, quantization):
    an entry written by other code is stale."""
    return source_digest(("io/gguf*.py", "models/*.py", "kernels/*.py", "io/group_quantized.py", "loading.py", "io/packed_cache.py"))


def cache_key(gguf_path: Path, dtype: str | torch.dtype | None, fingerprint: str) -> dict[str, Any]:
    """What an entry must have been made under to be used for loading `gguf_path` with `dtype` now;
    `fingerprint`: the checkpoint's (lmcli.io.fingerprint, as the resolved model has it)."""
    stat = gguf_path.stat()
    return {
        "format": FORMAT,
        "source": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "fingerprint": fingerprint,
        "code": _code_version(),
        "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
        "dtype": "auto" if dtype is None or str(dtype) == "auto" else str(dtype),
        "kernel_env": {name: os.environ.get(name, "") for name in ("LMCLI_KERNEL", "LMCLI_FAST_KERNELS", "LMCLI_NATIVE")},
    }


def entry_path(gguf_path: Path, key: dict[str, Any]) -> Path:
    from lmcli.paths import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "packed" / f"{gguf_path.stem}-{digest}.lmpk"


def entries_for(gguf_path: Path) -> list[Path]:
    """This GGUF file's entries (any key), for `lmcli info`."""
    from lmcli.paths import cache_dir

    return sorted((cache_dir() / "packed").glob(f"{gguf_path.stem}-*.lmpk"))


# --- writing ----------------------------------------------------------------------------------------


def _pieces(total: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of the data region that are checksummed: all of it, every byte that
    decides the numbers, in PIECE_BYTES pieces (so a write reads it back without a 100 MB copy).
    Sampled pieces let 72 changed bytes of one tensor's block scales through; the whole
    CRC-32 costs about 40 ms for the default model's 95 MiB (zlib here), on a start of about 1.2 s."""
    return [(offset, min(PIECE_BYTES, total - offset)) for offset in range(0, total, PIECE_BYTES)]


class _FileData:
    """The data region of an open entry, sliced like bytes: `[a:b]` reads those bytes from the file."""

    def __init__(self, fd: int, start: int):
        self.fd, self.start = fd, start

    def __getitem__(self, piece: slice) -> bytes:
        return os.pread(self.fd, piece.stop - piece.start, self.start + piece.start)


def _checksum(header: dict[str, Any], data: memoryview | bytes | _FileData, pieces: list[tuple[int, int]]) -> int:
    """CRC-32 of the header as written without its checksum (its config and kernel settings change the
    numbers too), then of the data's `pieces`."""
    crc = zlib.crc32(_encode(header, None))
    for offset, length in pieces:
        crc = zlib.crc32(data[offset:offset + length], crc)
    return crc


def tokenizer_bytes(tokenizer: Tokenizer) -> torch.Tensor:
    """The tokenizer's backend as its own JSON, the bytes `save` stores. Taken before the weights are
    placed: serialising builds about 12 MiB of temporaries, which at the end of a load would add to its peak."""
    return torch.frombuffer(bytearray(tokenizer.backend.to_str().encode()), dtype=torch.uint8)


def save(header: dict[str, Any], tensors: list[torch.Tensor], tokenizer: Tokenizer | None, hf_config: dict[str, Any],
         path: Path, key: dict[str, Any], tokenizer_json: torch.Tensor | None = None) -> None:
    """Write a model as described (`header`, `tensors`: kernels/packed_model.py's `describe`), its tokenizer
    (`tokenizer_json`: its `tokenizer_bytes`, made now if not given) and the config it was built from as an
    entry at `path`; a one-line warning (and no entry) where that fails."""
    from lmcli.io.atomic import atomic_file

    try:
        json.dumps(hf_config)  # plain values only
    except (ValueError, TypeError) as exc:
        sys.stderr.write(f"note: the loaded weights are not kept in the packed cache ({exc})\n")
        return
    header["hf_config"] = hf_config
    if tokenizer is not None:  # the backend's own JSON, stored as bytes beside the tensors
        text = tokenizer_bytes(tokenizer) if tokenizer_json is None else tokenizer_json
        header["tokenizer"] = {"backend": len(tensors), "bos_token": tokenizer.bos_token,
                               "eos_token": tokenizer.eos_token, "unk_token": tokenizer.unk_token,
                               "pad_token": tokenizer.pad_token, "chat_template": tokenizer.chat_template,
                               "eos_token_id": tokenizer.eos_token_id, "stop_ids": tokenizer.eos_token_ids,
                               "name": tokenizer.name}
        tensors.append(text)
    spans, offset = [], 0
    for tensor in tensors:
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = tensor.numel() * tensor.element_size()
        spans.append((offset, nbytes))
        offset += nbytes
    total = offset
    header.update(key=key, tensors=[{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                      "offset": o, "nbytes": n} for t, (o, n) in zip(tensors, spans, strict=True)],
                  data_bytes=total)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as temporary, open(temporary, "wb+") as file:
            file.truncate(_data_start(len(_encode(header, 0))) + total)
            start = _data_start(len(_encode(header, 0)))
            for tensor, (place, _) in zip(tensors, spans, strict=True):
                file.seek(start + place)
                file.write(tensor.view(-1).view(torch.uint8).numpy().data)  # the tensor's bytes, not copied
            file.flush()
            # Read back piece by piece, not mapped: each fault on a mapping maps its neighbours too, so a
            # mapping here added about 50 MiB to the load's peak.
            crc = _checksum(header, _FileData(file.fileno(), start), _pieces(total))
            encoded = _encode(header, crc)
            assert _data_start(len(encoded)) == start  # the checksum's digits do not move the data
            file.seek(0)
            file.write(encoded)
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:
        sys.stderr.write(f"warning: cannot keep the packed weights in {path.parent} ({first_line(exc)}); "
                         "the next start loads from the GGUF again\n")
        return
    _remove_superseded(path, key)


def _remove_superseded(path: Path, key: dict[str, Any]) -> None:
    """Other entries for the same GGUF file (made under another key: older code, torch or file)."""
    for other in path.parent.glob(f"{path.name.rsplit('-', 1)[0]}-*.lmpk"):
        if other == path:
            continue
        try:
            with open(other, "rb") as file:
                start = file.read(16)
                length = struct.unpack("<Q", start[8:16])[0] if start[:8] == MAGIC and len(start) == 16 else 0
                body = json.loads(file.read(min(length, MAX_HEADER))) if length else {}
            if isinstance(body, dict) and isinstance(body.get("key"), dict) and \
                    body["key"].get("source") == key["source"]:
                other.unlink()
        except (OSError, ValueError):
            continue


def _encode(header: dict[str, Any], crc: int | None) -> bytes:
    """The header as written; `crc` None: with eight zeros for its checksum (what the checksum covers)."""
    body = json.dumps({**header, "crc32": "0" * 8 if crc is None else f"{crc:08x}"}, sort_keys=True).encode()
    return MAGIC + struct.pack("<Q", len(body)) + body


def _data_start(encoded_length: int) -> int:
    return -(-encoded_length // ALIGN) * ALIGN


# --- reading ----------------------------------------------------------------------------------------


def _read_header(mapped: mmap.mmap, key: dict[str, Any]) -> tuple[dict[str, Any], int]:
    if len(mapped) < 16 or mapped[:8] != MAGIC:
        raise Damaged("not a packed-weights file")
    (length,) = struct.unpack("<Q", mapped[8:16])
    if length > min(MAX_HEADER, len(mapped) - 16):
        raise Damaged("header length out of bounds")
    try:
        header = json.loads(bytes(mapped[16:16 + length]))
    except ValueError:
        raise Damaged("header is not JSON") from None
    if not isinstance(header, dict):
        raise Damaged("header is not an object")
    if header.get("key") != key:
        raise Damaged("made for another file, code, torch or CPU")
    start = _data_start(16 + length)
    if not isinstance(header.get("data_bytes"), int) or start + header["data_bytes"] != len(mapped):
        raise Damaged("size differs from its header (cut short?)")
    return header, start


def _tensor_views(mapped: mmap.mmap, header: dict[str, Any], start: int) -> list[torch.Tensor]:
    import numpy as np

    total = header["data_bytes"]
    views, spans = [], []
    buffer = np.frombuffer(mapped, dtype=np.uint8, offset=start, count=total)  # no copy: the file's pages
    for entry in header["tensors"]:
        dtype, shape, offset, nbytes = DTYPES[entry["dtype"]], [int(s) for s in entry["shape"]], entry["offset"], entry["nbytes"]
        numel = 1
        for size in shape:
            if size < 0:
                raise Damaged("negative size")
            numel *= size
        if not (isinstance(offset, int) and offset >= 0 and offset % ALIGN == 0 and offset + nbytes <= total
                and nbytes == numel * dtype.itemsize):
            raise Damaged("a tensor out of bounds")
        spans.append((offset, nbytes))
        views.append(torch.from_numpy(buffer[offset:offset + nbytes]).view(dtype).view(shape))
    if f"{_checksum(header, memoryview(mapped)[start:], _pieces(total)):08x}" != header.get("crc32"):
        raise Damaged("checksum differs")
    return views


class Entry:
    """A checked entry, mapped: the config the model was built from, its tensors and its tokenizer."""

    def __init__(self, header: dict[str, Any], views: list[torch.Tensor]):
        self.header, self.views = header, views
        self.hf_config: dict[str, Any] = header["hf_config"]
        if not isinstance(self.hf_config, dict):
            raise Damaged("no config")

    def tokenizer(self) -> Tokenizer | None:
        from tokenizers import Tokenizer as Backend

        from lmcli.io.tokenizer import Tokenizer

        fields = self.header.get("tokenizer")
        if fields is None:
            return None
        backend = Backend.from_str(bytes(self.views[fields["backend"]].numpy()).decode("utf-8"))
        return Tokenizer(backend, bos_token=fields["bos_token"], eos_token=fields["eos_token"],
                         unk_token=fields["unk_token"], pad_token=fields["pad_token"],
                         chat_template=fields["chat_template"], generation_eos=fields["eos_token_id"],
                         extra_stop_ids=fields["stop_ids"], name=fields["name"])


def open_entry(path: Path, key: dict[str, Any]) -> Entry | None:
    """The entry at `path` if there is one and it passes its checks; a damaged or foreign one is
    deleted (with a one-line note), so the caller loads from the GGUF and writes it again."""
    try:
        with open(path, "rb") as file:
            # Copy-on-write: tensors are writable (torch wants that) and nothing written reaches the file.
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory)
        return None
    except (OSError, ValueError) as exc:  # unreadable, or empty
        refuse(path, exc)
        return None
    try:
        header, start = _read_header(mapped, key)
        return Entry(header, _tensor_views(mapped, header, start))
    except REFUSALS as exc:
        refuse(path, exc)
        return None


REFUSALS = (Damaged, KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError, OSError)


def refuse(path: Path, exc: BaseException) -> None:
    """Note why the entry at `path` is not used, and delete it."""
    sys.stderr.write(f"note: {path.name}: packed weights not used ({first_line(exc)[:100]}); loading from the GGUF\n")
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


