"""lmcli's own C++ kernels: every `csrc/*.cpp` compiled into one shared library, loaded with ctypes.

The sources include no torch headers, so a build takes seconds with the system C++ compiler. Each
source names its own extra flags on a first-lines comment `// lmcli-flags: -mavx2 -mfma` (one
translation unit per instruction set; the code choosing among them asks `__builtin_cpu_supports`).
All are compiled with `-O2 -fPIC -fopenmp`: once torch is imported, the library's libgomp.so.1 is
torch's, so the kernels run on torch's OpenMP threads and follow `torch.set_num_threads`.

The library is built by `make install` (`python -m lmcli.native`) or at first use, into
`<lmcli cache>/native/liblmcli-<key>.so`, the key a digest of the sources, the compiler (its path,
size and modification time) and the flags; written through a temporary and renamed. A build that
fails is recorded beside it (`<key>.failed`, its first error line) and not tried again for that key,
so a machine without a compiler pays for one attempt, not one per start; lmcli then uses torch's
kernels. LMCLI_NATIVE=0 turns the library off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

SOURCES = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-fPIC", "-fopenmp", "-std=c++17", "-fno-fast-math", "-ffp-contract=off")
FORMAT = 1  # bump when the way the library is built or named changes
ENV = "LMCLI_NATIVE"  # "0": never build or load it


@dataclass(frozen=True)
class Build:
    """Where the library for the current sources and compiler is (or would be), and its key."""

    compiler: str | None
    key: str
    path: Path
    failed: Path


def _compiler() -> str | None:
    name = os.environ.get("CXX") or "c++"
    found = shutil.which(name)
    return os.path.realpath(found) if found else None


def _source_files() -> list[Path]:
    return sorted(p for p in SOURCES.iterdir() if p.suffix in (".cpp", ".h", ".hpp"))


def _flags_of(source: Path) -> list[str]:
    """The extra flags a source asks for on a `// lmcli-flags:` line among its first five."""
    with source.open() as f:
        for _, line in zip(range(5), f, strict=False):
            if line.startswith("// lmcli-flags:"):
                return line.removeprefix("// lmcli-flags:").split()
    return []


def current() -> Build:
    from lmcli.paths import cache_dir

    return _current(str(cache_dir()), os.environ.get("CXX", ""))


@functools.cache  # per cache directory and compiler: the sources do not change while lmcli runs
def _current(cache: str, cxx: str) -> Build:
    del cxx  # read by _compiler; part of the cache key
    compiler = _compiler()
    digest = hashlib.sha256(f"{FORMAT}|{' '.join(FLAGS)}|".encode())
    if compiler:
        stat = os.stat(compiler)
        digest.update(f"{compiler}|{stat.st_size}|{stat.st_mtime_ns}|".encode())
    for source in _source_files():
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    key = digest.hexdigest()[:16]
    where = Path(cache) / "native"
    return Build(compiler, key, where / f"liblmcli-{key}.so", where / f"{key}.failed")


def build(into: Build | None = None, verbose: bool = False) -> Path:
    """Compile every source into the library at `into.path` (atomically); returns it. RuntimeError with
    the compiler's first error line on failure (the caller records it)."""
    into = into or current()
    if into.compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'c++'} not found)")
    into.path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into.path.parent, prefix=".build-") as scratch:
        objects = []
        for source in (s for s in _source_files() if s.suffix == ".cpp"):
            obj = Path(scratch) / f"{source.stem}.o"
            _run([into.compiler, *FLAGS, *_flags_of(source), "-c", str(source), "-o", str(obj)], verbose)
            objects.append(str(obj))
        linked = Path(scratch) / into.path.name
        _run([into.compiler, "-shared", "-fopenmp", "-o", str(linked), *objects], verbose)
        os.replace(linked, into.path)  # same directory: atomic
    return into.path


def _run(command: list[str], verbose: bool) -> None:
    if verbose:
        print(" ".join(command), flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{Path(command[0]).name}: {exc}") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if "error" in line.lower()]
        first = (lines or (done.stderr + done.stdout).splitlines() or [f"exit status {done.returncode}"])[0]
        raise RuntimeError(f"{Path(command[0]).name} failed: {first.strip()[:200]}")


class _Library:
    """The loaded library and what it says about this CPU."""

    ISAS: ClassVar[dict[str, int]] = {"avx2": 1, "avx512": 2, "avx512bf16": 3}

    def __init__(self, path: Path):
        import torch  # noqa: F401  (first, so that the library's libgomp.so.1 is torch's)

        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.lmcli_qmm_supported.argtypes = [ctypes.c_int]
        lib.lmcli_qmm_best.argtypes = []
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.lmcli_qmm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, i64, ctypes.c_int, ptr, i64]
        lib.lmcli_native_threads.argtypes = []
        self.lib = lib
        self.qmm = lib.lmcli_qmm
        lib.lmcli_lora.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, i64, ptr, i64, ctypes.c_int, ptr, ctypes.c_int,
                                   i64, ctypes.c_int, ptr, ptr, i64, ctypes.c_int]
        self.lora = lib.lmcli_lora  # csrc/lora.cpp: LoRA's update beside a projection (kernels/lora.py)
        self.supported = [name for name, number in self.ISAS.items() if lib.lmcli_qmm_supported(number)]

    def isa(self) -> int:
        """The path to run: LMCLI_NATIVE_ISA if set (tests), else the best this CPU has (0 if none)."""
        forced = os.environ.get("LMCLI_NATIVE_ISA")
        if forced:
            if forced not in self.ISAS:
                from lmcli.errors import UsageError

                raise UsageError(f"LMCLI_NATIVE_ISA={forced}: unknown (use {', '.join(self.ISAS)})")
            return self.ISAS[forced]
        return int(self.lib.lmcli_qmm_best())

    def threads(self) -> int:
        """OpenMP's thread count as the library sees it (torch.set_num_threads sets it too)."""
        return int(self.lib.lmcli_native_threads())

    def isa_name(self) -> str | None:
        number = self.isa()
        return next((name for name, n in self.ISAS.items() if n == number), None)


@functools.cache
def _load(build_key: str, path: str, failed: str, compiler: str | None) -> tuple[_Library | None, str]:
    del build_key  # part of the cache key only
    lib_path, failed_path = Path(path), Path(failed)
    if not lib_path.exists():
        if failed_path.exists():
            return None, f"build failed before: {_read(failed_path)}"
        try:
            build(Build(compiler, "", lib_path, failed_path))
        except (RuntimeError, OSError) as exc:
            _record_failure(failed_path, str(exc))
            return None, f"build failed: {exc}"
    try:
        library = _Library(lib_path)
    except OSError as exc:  # a damaged file: recorded, so it is not loaded again at every start
        _record_failure(failed_path, f"could not load {lib_path.name}: {exc}")
        lib_path.unlink(missing_ok=True)
        return None, f"could not load: {exc}"
    if not library.supported:
        return None, "this CPU has none of the library's paths (AVX2+FMA, AVX-512)"
    return library, ""


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()[:200] or "unknown error"
    except OSError:
        return "unknown error"


def _record_failure(path: Path, reason: str) -> None:
    try:
        from lmcli.io.atomic import write_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, reason + "\n")
    except OSError:
        pass  # a read-only cache: tried again next time


def library() -> _Library | None:
    """The loaded library (built first if needed), or None where it cannot be had (see `why_not`)."""
    return _load_current()[0]


def why_not() -> str:
    """Why `library()` is None ('' when it is not)."""
    return _load_current()[1]


def _load_current() -> tuple[_Library | None, str]:
    if os.environ.get(ENV, "") == "0":  # read at each call: tests switch it
        return None, f"{ENV}=0"
    b = current()
    return _load(b.key, str(b.path), str(b.failed), b.compiler)


def available_without_building() -> str | None:
    """A cheap identity of the library this process would use, for cache keys: its key if it is built
    (or not yet tried), None if it is off or its build failed before. Builds nothing."""
    if os.environ.get(ENV, "") == "0":
        return None
    b = current()
    if b.compiler is None or (b.failed.exists() and not b.path.exists()):
        return None
    return b.key


def describe() -> str:
    """One line for `lmcli info` and `lmcli bench`: which native path runs, or why none does."""
    lib = library()
    if lib is None:
        return f"none ({why_not()}); torch's kernels"
    return f"{lib.isa_name()} (this CPU: {', '.join(lib.supported)}), {lib.path.name}"
