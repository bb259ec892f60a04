"""Compiled programs kept on disk: built once per model, machine and batch size, loaded at later starts.

Building the decode step (models/compiled_step.py: torch.export, then AOTInductor's C++ compiler)
takes minutes; loading the result takes a fraction of a second. An entry is one directory,
`<lmcli cache>/compiled/<label>-b<batch>-<key digest>/`, holding the package `step.pt2` (the program
without the weights: the model's own tensors are given to it at load) and `entry.json`: the key it
was built under (the model's fingerprint, lmcli's model sources, torch's version, the CPU capability,
the thread count, the batch size, dtype and kernel choices), the package's size and its SHA-256, and
what the builder recorded to load it (`program`: the program's own constants, such as the rotary
tables, which change its numbers as much as the package does, so they are under a SHA-256 of their own).
It is checked before use; a stale or damaged entry is deleted with one `note:` line and built again.
A program that fails (its build, the builder's check against eager decoding, its load, or a run) is
recorded as bad once (`record_bad`: `<entry>.bad` beside where the entry would be, holding its key and
why), and is then neither built, loaded nor tried again for that key (`known_bad`): the default
decodes eagerly without a word, --compile says so in one line. A build fills a hidden staging directory beside the entry and
renames it into place when complete (io/atomic.py), so a build killed midway leaves nothing that
looks like an entry (the next build for it removes the leftovers), and two processes building at
once each place a whole entry. A new entry replaces the ones it supersedes: the same model, machine,
thread count and batch size built by another lmcli or torch (`remove_superseded`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmcli.errors import first_line
from lmcli.io.fingerprint import source_digest

if TYPE_CHECKING:
    from torch import nn

FORMAT = 3  # bump when what an entry holds or means changes
PACKAGE, META = "step.pt2", "entry.json"
MAX_META = 1 << 20  # an entry.json claiming more is not one of ours
PIECE = 1 << 16  # bytes of each tensor checksummed for the model's fingerprint


class Unavailable(RuntimeError):
    """No compiled program for this run (one line: why); the caller decodes eagerly."""


class KnownBad(Unavailable):
    """The program for this key failed before and was recorded so (`record_bad`): not tried again."""


class Damaged(ValueError):
    """An entry that is not what this cache writes, or was built under another key."""


def root() -> Path:
    from lmcli.paths import cache_dir

    return cache_dir() / "compiled"


def code_version() -> str:
    """lmcli's sources that decide what the compiled program computes: a program built from other code is stale."""
    return source_digest(("models/*.py", "kernels/*.py", "io/group_quantized.py", "config.py", "io/compiled_cache.py"))


def model_fingerprint(model: nn.Module) -> str:
    """The loaded model's identity, from what the program bakes in: each tensor's name, shape and dtype,
    a CRC-32 of its first and last PIECE bytes, and the config (a few MB read, whatever the file was)."""
    digest = hashlib.sha256(repr(getattr(model, "config", None)).encode())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        data = tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else tensor.detach()
        crc = zlib.crc32(data[:PIECE].numpy().tobytes())
        crc = zlib.crc32(data[-PIECE:].numpy().tobytes(), crc)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{crc}\n".encode())
    return digest.hexdigest()[:24]


def cache_key(model: nn.Module, batch_size: int) -> dict[str, Any]:
    """What an entry must have been built under to run `model`'s decode step at `batch_size` rows now."""
    choices = getattr(model, "kernel_choices", {})
    return {
        "format": FORMAT, "model": model_fingerprint(model), "code": code_version(),
        "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(), "batch": batch_size,
        "dtype": str(getattr(model, "dtype", "")), "batch_invariant": bool(getattr(model, "batch_invariant", False)),
        "kernels": {kind: choice.describe() for kind, choice in sorted(choices.items())},
    }


def entry_path(label: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root() / f"{label}-b{key['batch']}-{digest}"


def entries() -> list[tuple[Path, int]]:
    """Every complete-looking entry and its size in bytes (for `lmcli info`)."""
    if not root().is_dir():
        return []
    found = []
    for entry in sorted(root().iterdir()):
        if entry.is_dir() and not entry.name.startswith(".") and (entry / META).is_file():
            found.append((entry, sum(f.stat().st_size for f in entry.iterdir() if f.is_file())))
    return found


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _program_sha256(program: Any) -> str:
    """SHA-256 of what entry.json keeps to load the package (its constants' values among it), as JSON."""
    return hashlib.sha256(json.dumps(program, sort_keys=True).encode()).hexdigest()


BAD = ".bad"  # the suffix of a failed program's record, beside where its entry would be


def bad_marker(entry: Path) -> Path:
    return entry.with_name(entry.name + BAD)


def known_bad(label: str, key: dict[str, Any]) -> str | None:
    """Why the program for `key` was recorded as bad, or None (no record, or one for another key)."""
    marker = bad_marker(entry_path(label, key))
    try:
        if marker.stat().st_size > MAX_META:
            return None
        record = json.loads(marker.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    return str(record.get("why", "it failed"))[:200]


def record_bad(label: str, key: dict[str, Any], why: str) -> str:
    """Record that the program for `key` failed (`why`, one line), so that no later run builds, loads or
    tries it again, and remove its entry if one is there. -> `why` and where it is recorded, for the
    caller's one line (a cache that cannot be written only loses the record: the next --compile tries
    once more)."""
    from lmcli.io.atomic import write_atomically

    entry = entry_path(label, key)
    marker = bad_marker(entry)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(marker, json.dumps({"key": key, "why": why}, indent=1), durable=True)
    except OSError:
        return why
    if entry.exists():
        hidden = entry.with_name(f".{entry.name}.bad-{os.getpid()}")
        try:
            os.replace(entry, hidden)  # a reader sees the whole entry or none
        except OSError:
            hidden = entry
        shutil.rmtree(hidden, ignore_errors=True)
    return f"{why}; recorded in {marker}, not tried again"


def check(entry: Path, key: dict[str, Any]) -> Path:
    """The entry's package if the entry is whole and was built under `key`; else Damaged (one line)."""
    return _check(entry, key)[0]


def has_entry(label: str, key: dict[str, Any]) -> bool:
    """Whether an entry for `key` looks complete (cheap: it is checked in full when it is used)."""
    return (entry_path(label, key) / META).is_file()


def any_entry(label: str, batch_size: int) -> bool:
    """Whether any entry for this label and batch size looks complete: a directory listing, no key
    computed (the model's fingerprint costs tens of milliseconds, too much for every start)."""
    return root().is_dir() and any((entry / META).is_file() for entry in root().glob(f"{label}-b{batch_size}-*"))


def _check(entry: Path, key: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    meta_path, package = entry / META, entry / PACKAGE
    try:
        if meta_path.stat().st_size > MAX_META:
            raise Damaged(f"{META} is larger than any this cache writes")
        meta = json.loads(meta_path.read_bytes())
        size = package.stat().st_size
    except (OSError, ValueError) as exc:
        raise Damaged(f"unreadable ({first_line(exc)[:120]})") from None
    if not isinstance(meta, dict) or meta.get("key") != key:
        raise Damaged("built for another model, lmcli, torch, CPU, thread count or batch size")
    if meta.get("size") != size or meta.get("sha256") != _sha256(package):
        raise Damaged(f"{PACKAGE} is not the file that was built (size or checksum differs)")
    program = meta.get("program", {})
    if not isinstance(program, dict):
        raise Damaged(f"{META} is not one this cache writes")
    if meta.get("program_sha256") != _program_sha256(program):
        raise Damaged(f"the program's constants in {META} are not those that were built (checksum differs)")
    return package, program


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _fsync_path(path: Path) -> None:
    """On disk before the staging directory is renamed: a crash then leaves a whole entry or none."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(entry: Path, why: str, then: str = "building it again") -> None:
    """Delete a stale or damaged entry, saying so in one line (and what happens `then`)."""
    sys.stderr.write(f"note: {entry}: {why}; {then}\n")
    shutil.rmtree(entry, ignore_errors=True)


def obtain(label: str, key: dict[str, Any], build: Callable[[Path], Any], what: str) -> Path:
    """The checked package for `key`: the cache's, else one `build(path)` writes now, placed in the cache.

    Raises Unavailable (one line) where it can be neither read nor built and written."""
    return obtain_entry(label, key, build, what)[0]


def obtain_entry(label: str, key: dict[str, Any], build: Callable[[Path], dict[str, Any] | None] | None,
                 what: str) -> tuple[Path, dict[str, Any]]:
    """`obtain`, with what `build` returned when it wrote the package (kept in entry.json as `program`).
    `build` None: only an entry already in the cache; Unavailable where there is none."""
    entry = entry_path(label, key)
    why = known_bad(label, key)
    if why is not None:
        raise KnownBad(f"{what} failed here before ({why}); not tried again (delete {bad_marker(entry)} to retry)")
    if entry.exists():
        try:
            return _check(entry, key)
        except Damaged as exc:
            discard(entry, str(exc), "building it again" if build is not None else "decoding eagerly")
    if build is None:
        raise Unavailable(f"no compiled program for {what} in {entry.parent}")
    from lmcli.io.atomic import make_staging_directory, replace_directory

    try:
        staging = make_staging_directory(entry)
    except OSError as exc:
        raise Unavailable(f"cannot write the compiled-program cache {entry.parent} ({exc.strerror or exc})") from None
    try:
        sys.stderr.write(f"compiling {what} (once for this model, machine and batch size) ... ")
        sys.stderr.flush()
        start = time.perf_counter()
        try:
            program = build(staging / PACKAGE) or {}
        except OSError as exc:  # a full disk, an unwritable cache: not the program's fault, so not recorded
            sys.stderr.write("failed\n")
            raise Unavailable(f"building it failed: {first_line(exc)[:160]}") from None
        except Exception as exc:  # the compiler failed, or the program was not eager's (the builder's check)
            sys.stderr.write("failed\n")
            raise KnownBad(record_bad(label, key, f"building it failed: {first_line(exc)[:160]}")) from None
        package = staging / PACKAGE
        seconds = round(time.perf_counter() - start, 1)
        size = package.stat().st_size
        meta = {"key": key, "size": size, "sha256": _sha256(package), "built_s": seconds, "program": program,
                "program_sha256": _program_sha256(program)}
        _write_durably(staging / META, json.dumps(meta, indent=1))  # written last: an entry without it is incomplete
        _fsync_path(package)
        _fsync_path(staging)  # the directory's names, before it is renamed into place
        staging.chmod(0o755)
        if entry.exists():  # another process placed its own meanwhile: keep the one that checks out
            try:
                found = _check(entry, key)
                shutil.rmtree(staging, ignore_errors=True)
                sys.stderr.write(f"done in {seconds:.0f} s (another process's copy kept)\n")
                return found
            except Damaged:
                pass
        replace_directory(staging, entry)
        sys.stderr.write(f"done in {seconds:.0f} s, {size / 2**20:.1f} MiB, kept in {entry.parent}\n")
        remove_superseded(entry, key)
        return entry / PACKAGE, program
    except OSError as exc:
        raise Unavailable(f"cannot write the compiled-program cache {entry.parent} ({exc.strerror or exc})") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


# What an entry supersedes differs from it only here: another build of lmcli or torch (or of this
# cache's format) for the same model, machine, thread count and batch size. No process of the new
# version can use it; one of the old version may, so only entries older than the new one go.
REPLACED_BY_UPGRADE = ("format", "code", "torch")


def remove_superseded(entry: Path, key: dict[str, Any]) -> list[Path]:
    """Remove the entries `entry` (just placed, built under `key`) supersedes; -> those removed. Each is
    renamed to a hidden name first, so a reader sees a whole entry or none."""
    removed: list[Path] = []
    same = {name: value for name, value in key.items() if name not in REPLACED_BY_UPGRADE}
    try:
        newest = (entry / META).stat().st_mtime
    except OSError:
        return removed
    for other, _ in entries():
        if other == entry:
            continue
        try:
            if (other / META).stat().st_size > MAX_META or (other / META).stat().st_mtime > newest:
                continue
            meta = json.loads((other / META).read_bytes())
            theirs = meta.get("key") if isinstance(meta, dict) else None
            if not isinstance(theirs, dict) or theirs == key:
                continue
            if {name: value for name, value in theirs.items() if name not in REPLACED_BY_UPGRADE} != same:
                continue
            hidden = other.with_name(f".{other.name}.superseded-{os.getpid()}")
            os.replace(other, hidden)
        except (OSError, ValueError):
            continue
        shutil.rmtree(hidden, ignore_errors=True)
        removed.append(other)
    return removed
