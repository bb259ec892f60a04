"""Prompt blocks on disk: the keys and values of prompt prefixes, kept between runs (the prefix cache's
second tier, generation/prefix_cache.py), checked whole before use.

An entry is one file, `<dir>/<h[:2]>/<h>.lmpb`, where `h` is the hash chain over the prompt's token ids up to
the block's end, started from the digest of everything that changes the numbers (`numerics_key` of
generation/prefix_cache.py: the model's fingerprint, its dtype and kernel plan, the CPU, torch, lmcli's
model and kernel code). The file:

  8 bytes magic, 8 bytes header length (little-endian), the JSON header, then the data:
  the token ids from the prompt's start to the block's end (int64), each layer's keys then values
  (the header's dtype and shapes, in order), and for a prompt's tail its last logits (float32).

The header holds the format, the key digest, the block's first slot and length, the number of ids, each
tensor's dtype and shape, the data's size and a CRC-32 of the header and every data byte. Before anything
is allocated the header's length is bounded, its sizes must be exactly those the caller expects (the
model's layers) and the file's size must be exactly what they add up to; then the data is read, its
checksum compared, and its ids compared with the request's, token for token (the hash only finds the
file). Anything else (a damaged, truncated, foreign or stale entry, a directory in its place) is
skipped, deleted and noted once under --verbose, and the prefix is computed (and written) again.

Writes go through io/atomic.py (a temporary beside the entry, renamed over it), so two processes writing
the same prefix each rename a complete file, and a writer that fails midway (a full disk, a read-only
directory) leaves nothing; the disk tier then stops writing for the rest of the run. The directory is
kept under a size bound: past it, the least recently used entries (by modification time, which a read
touches) are deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lmcli.errors import first_line
from lmcli.io.sizes import PROMPT_CACHE_ENV, PROMPT_CACHE_SIZE_ENV, VERBOSE_ENV

FORMAT = 1  # bump when the file layout or what the header means changes
MAGIC = b"LMCLIPB\x01"
MAX_HEADER = 1 << 20  # a header claiming more is not one of ours
SUFFIX = ".lmpb"
DEFAULT_MAX_BYTES = 2 << 30
DIR_ENV, SIZE_ENV, VERBOSE_ENV = PROMPT_CACHE_ENV, PROMPT_CACHE_SIZE_ENV, VERBOSE_ENV  # see io/sizes.py

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}


class Damaged(ValueError):
    """An entry that is not what this format writes, or not what the caller asked for."""


@dataclass(frozen=True)
class Shape:
    """What one stored tensor must be: dtype and shape (keys and values of a layer, per layer)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for size in self.shape:
            n *= size
        return n


@dataclass
class Block:
    """A loaded entry: the ids from the prompt's start to its end, its tensors, its logits (a tail's)."""

    ids: list[int]
    begin: int
    tensors: list[torch.Tensor]
    logits: torch.Tensor | None


def chain(previous: bytes, ids: Sequence[int], kind: bytes = b"block") -> bytes:
    """The next link of the hash chain: `previous` (a digest) and the next ids."""
    digest = hashlib.sha256(previous)
    digest.update(kind + b"\0")
    digest.update(struct.pack(f"<{len(ids)}q", *ids))
    return digest.digest()


class BlockStore:
    """Entries under `directory`, at most `max_bytes` of them (least recently used deleted first)."""

    def __init__(self, directory: Path, key_digest: str, max_bytes: int = DEFAULT_MAX_BYTES, verbose: bool = False):
        self.directory = Path(directory)
        self.key_digest = key_digest
        self.max_bytes = max_bytes
        self.verbose = verbose
        self.writable = True
        self.skipped = 0  # entries not used: damaged, truncated, foreign
        self.written = 0
        self.evicted = 0
        self._bytes: int | None = None  # what the directory holds, counted at the first write
        # Names of the entries this process used (read, written, or reused from memory), least recent
        # first: the order trim keeps, newer than any file's time (a file's time is its last first use).
        self._used: dict[str, None] = {}

    # --- paths ---

    def path(self, link: bytes) -> Path:
        name = link.hex()[:40]
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    def used(self, link: bytes) -> None:
        """The entry `link` was used (from memory too): it is now the most recently used."""
        name = self.path(link).name
        if name not in self._used:
            with contextlib.suppress(OSError):
                os.utime(self.path(link))  # for other processes' trims
        self._used.pop(name, None)
        self._used[name] = None

    # --- reading ---

    def load(self, link: bytes, ids: Sequence[int], begin: int, expect: Sequence[Shape],
             logits: int | None = None) -> Block | None:
        """The entry at `link` if it holds exactly the ids `ids` (all of them, from the prompt's start),
        from slot `begin`, tensors shaped `expect` (and, with `logits`, a tail's logits [1, logits]);
        None if there is none or it fails a check (then it is deleted, with a note under --verbose)."""
        path = self.path(link)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:  # a directory in its place, no permission
            self._refuse(path, exc)
            return None
        try:
            block = self._read(fd, ids, begin, expect, logits)
            self._used.pop(path.name, None)
            self._used[path.name] = None
            return block
        except (Damaged, OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            self._refuse(path, exc)
            return None
        finally:
            os.close(fd)

    def _read(self, fd: int, ids: Sequence[int], begin: int, expect: Sequence[Shape], logits: int | None) -> Block:
        size = os.fstat(fd).st_size
        start = os.pread(fd, 16, 0)
        if len(start) < 16 or start[:8] != MAGIC:
            raise Damaged("not a prompt-block file")
        (length,) = struct.unpack("<Q", start[8:16])
        if length > min(MAX_HEADER, size - 16):
            raise Damaged("header length out of bounds")
        header = json.loads(os.pread(fd, length, 16))
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise Damaged("another format")
        if header.get("key") != self.key_digest:
            raise Damaged("made for another model, kernel plan, dtype or lmcli")
        shapes = [Shape(DTYPES[t["dtype"]], tuple(int(s) for s in t["shape"])) for t in header["tensors"]]
        wanted = list(expect) + ([Shape(torch.float32, (1, logits))] if logits is not None else [])
        if shapes != wanted or header.get("ids") != len(ids) or header.get("begin") != begin:
            raise Damaged("not the block asked for (its sizes differ)")
        total = 8 * len(ids) + sum(s.nbytes for s in shapes)  # from the caller's sizes, not the file's claim
        if header.get("data_bytes") != total or 16 + length + total != size:
            raise Damaged("size differs from its header (cut short?)")
        data = bytearray(total)
        view = memoryview(data)
        got = os.preadv(fd, [view], 16 + length) if hasattr(os, "preadv") else _pread_into(fd, view, 16 + length)
        if got != total:
            raise Damaged("cut short")
        if zlib.crc32(data, zlib.crc32(_encode(header, None))) != int(header.get("crc32", "x"), 16):
            raise Damaged("checksum differs")
        stored = torch.frombuffer(data, dtype=torch.int64, count=len(ids)) if ids else torch.empty(0, dtype=torch.int64)
        if stored.tolist() != list(ids):  # compared, not only hashed
            raise Damaged("its token ids differ from the prompt's")
        tensors, offset = [], 8 * len(ids)
        for shape in shapes:
            n = shape.nbytes
            tensors.append(torch.frombuffer(data, dtype=shape.dtype, count=n // shape.dtype.itemsize,
                                            offset=offset).view(shape.shape) if n else torch.empty(shape.shape, dtype=shape.dtype))
            offset += n
        with contextlib.suppress(OSError):
            os.utime(fd)  # a use: the least recently used go first
        kept = tensors[:-1] if logits is not None else tensors
        return Block(list(ids), begin, kept, tensors[-1] if logits is not None else None)

    def _refuse(self, path: Path, exc: BaseException) -> None:
        self.skipped += 1
        if self.verbose:
            sys.stderr.write(f"note: prompt cache: {path.name} not used ({first_line(exc)[:100]}); computing it again\n")
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                _remove_tree(path)
            else:
                path.unlink(missing_ok=True)

    # --- writing ---

    def save(self, link: bytes, ids: Sequence[int], begin: int, tensors: Sequence[torch.Tensor],
             logits: torch.Tensor | None = None) -> bool:
        """Write an entry, replacing any file of its name (the caller computed this block, so whatever is
        there was not read: it may be damaged); False where the disk refuses (then writing stops)."""
        if not self.writable:
            return False
        path = self.path(link)
        from lmcli.io.atomic import atomic_file

        parts = [t.contiguous() for t in tensors] + ([logits.float().contiguous()] if logits is not None else [])
        header = {"format": FORMAT, "key": self.key_digest, "ids": len(ids), "begin": begin,
                  "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in parts]}
        id_bytes = struct.pack(f"<{len(ids)}q", *ids)
        payload = [id_bytes] + [t.view(-1).view(torch.uint8).numpy().tobytes() for t in parts]  # bfloat16 too
        data_bytes = sum(len(p) for p in payload)
        header["data_bytes"] = data_bytes
        crc = zlib.crc32(_encode(header, None))
        for piece in payload:
            crc = zlib.crc32(piece, crc)
        encoded = _encode(header, crc)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir() and not path.is_symlink():  # something else in an entry's place
                _remove_tree(path)
            with atomic_file(path) as temporary, open(temporary, "wb") as file:
                _write(file, encoded)
                for piece in payload:
                    _write(file, piece)
        except OSError as exc:
            self.writable = False
            if self.verbose:
                sys.stderr.write(f"note: prompt cache: cannot write in {self.directory} ({first_line(exc)}); "
                                 "not writing more this run\n")
            return False
        self.written += 1
        self._used.pop(path.name, None)
        self._used[path.name] = None
        self._account(len(encoded) + data_bytes)
        return True

    def _account(self, size: int) -> None:
        if self._bytes is None:
            self._bytes = sum(size for _, size, _ in self.entries())
        else:
            self._bytes += size
        if self._bytes > self.max_bytes:
            self.trim(self.max_bytes)

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every entry (any key), oldest first."""
        found: list[tuple[float, int, Path]] = []
        if not self.directory.is_dir():
            return found
        for sub in self.directory.iterdir():
            if not sub.is_dir():
                continue
            for entry in sub.glob(f"*{SUFFIX}"):
                with contextlib.suppress(OSError):
                    stat = entry.stat()
                    found.append((stat.st_mtime, stat.st_size, entry))
        found.sort(key=lambda e: e[0])
        return found

    def trim(self, max_bytes: int) -> None:
        """Delete the least recently used entries until at most `max_bytes` are kept."""
        entries = self.entries()
        order = {name: i for i, name in enumerate(self._used)}
        entries.sort(key=lambda e: (1, order[e[2].name], 0.0) if e[2].name in order else (0, 0, e[0]))
        total = sum(size for _, size, _ in entries)
        for _, size, entry in entries:
            if total <= max_bytes:
                break
            with contextlib.suppress(OSError):
                entry.unlink()
                self.evicted += 1
            total -= size
        self._bytes = total


def directory_bytes(directory: Path) -> tuple[int, int]:
    """(entries, bytes) of the prompt blocks under `directory`."""
    entries = BlockStore(directory, "").entries()
    return len(entries), sum(size for _, size, _ in entries)


def _encode(header: dict, crc: int | None) -> bytes:
    """The header as written; `crc` None: with eight zeros for its checksum (what the checksum covers)."""
    body = json.dumps({**header, "crc32": "0" * 8 if crc is None else f"{crc:08x}"}, sort_keys=True).encode()
    return MAGIC + struct.pack("<Q", len(body)) + body


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def _write(file, data: bytes) -> None:
    """One write call, so a test can stand in for a disk that fills up midway."""
    file.write(data)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[:len(data)] = data
    return len(data)
