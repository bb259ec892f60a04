"""A checkpoint's fingerprint: the one content identity lmcli records for a model (job rows, chat
transcripts, the dequantised-GGUF cache, bench's cache), so the same model has the same fingerprint
everywhere. Reads only the checkpoint's own files."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SAMPLED_CHUNKS = 16  # pieces of each weights file hashed, spread evenly over it
CHUNK_BYTES = 1 << 20
# Files of an HF directory that decide what it generates (weights are sampled, the rest hashed whole).
DECIDING_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                  "tokenizer_config.json", "special_tokens_map.json")


def checkpoint_fingerprint(path: str | Path, tokenizer_path: str | Path | None = None,
                           preset: dict | None = None) -> str:
    """A short content fingerprint of a checkpoint, stable across copies and renames, cheap on large files.

    Small files (configs, tokenizers) are hashed whole; each weights file (.safetensors, .gguf) by its
    size, its first MiB (the header: names, dtypes, shapes) and 16 one-MiB pieces spread over it, which
    any fine-tune or requantisation changes. `preset` is the config a lone .safetensors file is loaded with.
    """
    import hashlib

    path = Path(path)
    digest = hashlib.sha256()

    def add(label: str, file: Path) -> None:
        digest.update(label.encode() + b"\0")
        size = file.stat().st_size
        digest.update(str(size).encode() + b"\0")
        with open(file, "rb") as handle:
            if file.suffix not in (".safetensors", ".gguf") or size <= (SAMPLED_CHUNKS + 1) * CHUNK_BYTES:
                digest.update(handle.read())
                return
            for offset in [0] + [size * i // SAMPLED_CHUNKS for i in range(1, SAMPLED_CHUNKS)] + [size - CHUNK_BYTES]:
                handle.seek(offset)
                digest.update(handle.read(CHUNK_BYTES))

    if path.is_dir():
        for name in DECIDING_FILES:
            if (path / name).is_file():
                add(name, path / name)
        for weights in sorted(path.glob("*.safetensors")):
            add(weights.name, weights)
    else:
        add(path.suffix, path)
        if path.suffix == ".safetensors":  # its config (unless a preset gives it) and tokenizer lie beside it
            for name in DECIDING_FILES:
                if (path.parent / name).is_file() and not (name == "config.json" and preset is not None):
                    add(name, path.parent / name)
    if preset is not None:
        digest.update(json.dumps(preset, sort_keys=True).encode())
    if tokenizer_path is not None:
        tokenizer_path = Path(tokenizer_path)
        if tokenizer_path.is_dir():
            files = [tokenizer_path / name for name in DECIDING_FILES if name != "config.json"]
        else:
            files = [tokenizer_path, tokenizer_path.parent / "tokenizer_config.json"]
        for file in files:
            if file.is_file():
                add("tokenizer:" + file.name, file)
    return "sha256:" + digest.hexdigest()[:24]


def source_digest(patterns: Iterable[str]) -> str:
    """A digest of lmcli's own source files matching `patterns` (globs relative to the package, e.g.
    "models/*.py"), names and contents: a cache entry built by other code is stale."""
    import hashlib

    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for source in sorted({path for pattern in patterns for path in package.glob(pattern)}):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:20]
