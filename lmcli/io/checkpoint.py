"""Reading safetensors checkpoints (single or sharded) and filling a model with strict accounting.

Never unpickles: only safetensors (and GGUF, in gguf.py) are read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmcli.errors import CheckpointError

if TYPE_CHECKING:
    from lmcli.models.base import BaseModel

# Non-parameter buffers that real checkpoints carry (RoPE tables, GPT-2's causal mask); recognised and skipped.
IGNORED_TENSORS = re.compile(r"(rotary_emb\.inv_freq|(^|\.)attn\.(bias|masked_bias))$")


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory: model.safetensors, or the shards its index names."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
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


def fill_model(model: BaseModel, tensors: dict[str, torch.Tensor], source: str,
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
