"""Reading safetensors checkpoints (single or sharded) and filling a model with strict accounting.

Never unpickles: only safetensors (and GGUF, in gguf.py) are read.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from lmcli.config import ModelConfig
from lmcli.errors import CheckpointError, first_line

T = TypeVar("T")


class FillableModel(Protocol):
    """What fill_model needs of a model (lmcli.models.base.BaseModel is one): io sits below the models."""

    @property
    def config(self) -> ModelConfig: ...

    def named_parameters(self, prefix: str = ..., recurse: bool = ...,
                         remove_duplicate: bool = ...) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = ..., assign: bool = ...) -> Any: ...

    def tie_weights(self) -> None: ...

# Non-parameter buffers that real checkpoints carry (RoPE tables, GPT-2's causal mask); recognised and skipped.
IGNORED_TENSORS = re.compile(r"(rotary_emb\.inv_freq|(^|\.)attn\.(bias|masked_bias))$")


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory: model.safetensors, or the shards its index names."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = [directory / name for name in dict.fromkeys(index_shard_names(index).values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file not found: {missing[0]}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    if list(directory.glob("*.bin")) or list(directory.glob("*.pt")) or list(directory.glob("*.pth")):
        raise CheckpointError(
            f"{directory}: only pickle weights (.bin/.pt) found; lmcli reads safetensors only "
            "(convert them with safetensors, or use a .gguf file)"
        )
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def index_shard_names(index: Path) -> dict[str, str]:
    """The `weight_map` of a safetensors index (tensor name -> shard file name), validated.

    Every shard must be a plain file name inside the checkpoint directory: an index is data from a
    stranger, and `../../etc/passwd` or an absolute path must never be opened.
    """
    try:
        parsed = json.loads(index.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({' '.join(str(exc).split())})") from None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' must be an object mapping tensor names to shard files")
    directory = index.parent.resolve()
    # A HuggingFace hub snapshot (models--ORG--NAME/snapshots/REV) holds symlinks into ../../blobs.
    blobs = directory.parent.parent / "blobs" if directory.parent.name == "snapshots" else None
    for tensor, shard in weight_map.items():
        # Names are quoted as JSON strings: a hostile one may hold newlines or control characters.
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index}: weight_map[{json.dumps(tensor)}] must be a shard file name, "
                                  f"got {json.dumps(shard)}")
        try:
            plain_name = Path(shard).name == shard and shard not in (".", "..")
            target = (directory / shard).resolve()
            inside = plain_name and (target.parent == directory or (blobs is not None and target.parent == blobs))
        except (OSError, ValueError):  # a NUL byte, a symlink loop
            inside = False
        if not inside:
            raise CheckpointError(f"{index}: shard {json.dumps(shard)} of tensor {json.dumps(tensor)} is outside "
                                  "the checkpoint directory")
    return weight_map


def _each_tensor(files: list[Path], take: Callable[[Any, str, Path], T]) -> tuple[dict[str, T], dict[str, Path]]:
    """`take(handle, name, path)` for every tensor of `files`, by name, and the file each came from.
    A name in two files, or a file safetensors cannot read, is a CheckpointError naming the file."""
    from safetensors import safe_open

    taken: dict[str, T] = {}
    origin: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict: keys() is its API)
                    if name in taken:
                        raise CheckpointError(f"{path}: tensor '{name}' also appears in {origin[name]}")
                    taken[name] = take(handle, name, path)
                    origin[name] = path
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt/truncated files
            raise CheckpointError(f"{path}: cannot read safetensors file ({first_line(exc)})") from None
    return taken, origin


def read_safetensors(files: list[Path], dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of `files`, cast to `dtype`, and the file each came from (for error messages)."""

    def read(handle: Any, name: str, _path: Path) -> torch.Tensor:
        tensor = handle.get_tensor(name)
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    return _each_tensor(files, read)


# --- lazy tensors: a tensor-parallel rank reads only its part -------------------------------------


@dataclass(frozen=True)
class LazyTensor:
    """A safetensors tensor not read yet, viewed through the renames an architecture's
    `convert_checkpoint` applies (a transpose, chunks along dim 0), so a rank can read only its part.

    The view is `source.t()[offset:offset + rows]` when transposed, else `source[offset:offset + rows]`.
    """

    path: Path
    name: str
    source_shape: tuple[int, ...]
    transposed: bool = False
    offset: int = 0
    rows: int | None = None

    @property
    def shape(self) -> torch.Size:
        dims = tuple(reversed(self.source_shape)) if self.transposed else self.source_shape
        if not dims:
            return torch.Size(dims)
        return torch.Size((self.rows if self.rows is not None else dims[0], *dims[1:]))

    def t(self) -> LazyTensor:
        assert self.rows is None and len(self.source_shape) == 2, "transpose a whole 2-D tensor only"
        return dataclasses.replace(self, transposed=not self.transposed)

    def chunk(self, chunks: int, dim: int = 0) -> list[LazyTensor]:
        assert dim == 0 and self.shape[0] % chunks == 0, "equal chunks along dim 0 only"
        size = self.shape[0] // chunks
        return [dataclasses.replace(self, offset=self.offset + i * size, rows=size) for i in range(chunks)]

    def read(self, rows: slice | None = None, columns: slice | None = None) -> torch.Tensor:
        """The view's [rows, columns] part (whole dims when None), reading only that from the file."""
        from safetensors import safe_open

        shape = self.shape
        rows = rows or slice(0, shape[0] if shape else 0)
        first = slice(self.offset + rows.start, self.offset + rows.stop)
        try:
            # Opened per tensor, so the pages a rank touches are unmapped again right after.
            with safe_open(str(self.path), framework="pt") as handle:
                source = handle.get_slice(self.name)
                if len(shape) == 0:
                    return source[:]
                if len(shape) == 1:
                    return source[first]
                columns = columns or slice(0, shape[1])
                if self.transposed:
                    return source[columns, first].t()
                return source[first, columns]
        except Exception as exc:  # safetensors raises its own error types for corrupt/truncated files
            raise CheckpointError(f"{self.path}: cannot read tensor '{self.name}' ({first_line(exc)})") from None


def lazy_safetensors(files: list[Path]) -> tuple[dict[str, LazyTensor], dict[str, Path]]:
    """Every tensor of `files` as a LazyTensor (only the headers are read), and the file of each."""
    return _each_tensor(files, lambda handle, name, path: LazyTensor(path, name, tuple(handle.get_slice(name).get_shape())))


def fill_model(model: FillableModel, tensors: dict[str, torch.Tensor], source: str,
               origin: dict[str, Path] | None = None) -> None:
    """Assign checkpoint tensors to the model's parameters by name, accounting for every one.

    Every parameter must be filled and every tensor used, with equal shapes; else a CheckpointError
    naming the file, the tensor and both shapes.
    """
    origin = origin or {}
    expected = dict(model.named_parameters(remove_duplicate=False))
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    for name, tensor in tensors.items():
        where = origin.get(name, source)
        if name in tied:
            continue  # a tied head saved explicitly: the embedding is the same tensor
        if name not in expected:
            if IGNORED_TENSORS.search(name):
                continue
            raise CheckpointError(f"{where}: unexpected tensor '{name}' {list(tensor.shape)} (not a parameter of this model)")
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise CheckpointError(
                f"{where}: tensor '{name}' has shape {list(tensor.shape)} but the model expects {list(want)}"
            )
    missing = [n for n in expected if n not in tensors and n not in tied]
    if missing:
        raise CheckpointError(
            f"{source}: missing tensor '{missing[0]}' {list(expected[missing[0]].shape)}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    state = {name: tensors[name].contiguous() for name in expected if name in tensors}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
