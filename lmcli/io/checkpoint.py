"""Reading safetensors checkpoints (single or sharded) and filling a model with strict accounting.

Never unpickles: only safetensors (and GGUF, in gguf.py) are read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from lmcli.config import ModelConfig
from lmcli.errors import CheckpointError


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


def read_safetensors(files: list[Path], dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of `files`, cast to `dtype`, and the file each came from (for error messages)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict: keys() is its API)
                    if name in tensors:
                        raise CheckpointError(f"{path}: tensor '{name}' also appears in {origin[name]}")
                    tensor = handle.get_tensor(name)
                    tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
                    origin[name] = path
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt/truncated files
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(f"{path}: cannot read safetensors file ({reason})") from None
    return tensors, origin


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
