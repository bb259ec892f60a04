"""Resolve (checkpoint, model name) to a config, weights and a tokenizer, and build the model.

Accepted checkpoints: an HF directory (config.json + safetensors, single or sharded), a single
.safetensors file with a preset/architecture name supplying the config (or a config.json beside it),
a .gguf file, or None for the embedded default model.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmcli.errors import CheckpointError, ConfigError, UsageError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


# What `--model` may say when no checkpoint is given: the embedded default is a SmolLM2 (llama).
DEFAULT_MODEL_NAMES = ("llama", "smollm2-135m")


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use --device cpu)")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, config_dtype: str | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        # float32 on CPUs (half precision measured slower there); on GPUs the checkpoint's own
        # half-precision dtype, else bfloat16.
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if config_dtype == "float16" else torch.bfloat16
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: unknown dtype (use auto, float32, bfloat16 or float16)")
    return DTYPES[dtype]


def _read_config_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read config ({exc})") from None


@contextmanager
def _uninitialised_parameters():
    """Build modules without random initialisation: every parameter is about to be replaced by the
    checkpoint's tensor, and `torch.empty` memory that is never written costs nothing. (Building on
    the meta device does the same but spends seconds importing torch's meta kernels.)"""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding, nn.LayerNorm)}
    for cls in saved:
        cls.reset_parameters = lambda self: None  # type: ignore[method-assign]  # undone below
    try:
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset  # type: ignore[method-assign]


QUANTIZE_CHOICES = ("none", "int4", "int8")


def _quantizable_names(model: nn.Module) -> set[str]:
    """The weights `--quantize` applies to: every linear layer and the token embedding, but not a
    mixture-of-experts router (small, and its choice of expert is sensitive to rounding)."""
    names = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    return {n for n in names if not n.endswith("block_sparse_moe.gate.weight")} | {"model.embed_tokens.weight"}


def load(checkpoint: str | Path | None = None, model: str | None = None, dtype=None, device=None,
         quantize: str | None = None):
    """Load a model and its tokenizer. Returns (BaseModel, Tokenizer | None).

    quantize: None keeps a GGUF file's own quantization (Q4_0/Q4_1/Q4_K -> int4, Q8_0/Q5_x/Q6_K -> int8)
    and loads other checkpoints as they are; "none" dequantises everything to `dtype`; "int4" / "int8"
    quantizes the float weights at load (group-wise, round to nearest). `dtype` is the activation
    dtype; None or "auto" picks the fastest measured one for quantized weights on this device.
    """
    from lmcli import registry
    from lmcli.io.checkpoint import fill_model, read_safetensors, safetensors_files
    from lmcli.models.base import BaseModel
    from lmcli.models.linear import GroupQuantized, install_quantized, preferred_dtype, quantize_weights

    if quantize not in (None, *QUANTIZE_CHOICES):
        raise UsageError(f"--quantize {quantize}: unknown (use {', '.join(QUANTIZE_CHOICES)})")
    device = resolve_device(device)
    tokenizer = None
    origin: dict[str, Path] = {}
    if checkpoint is None:
        from lmcli.default_model import default_checkpoint_path

        if model is not None and registry.known_model_type(model) and model not in DEFAULT_MODEL_NAMES:
            raise UsageError(f"--model {model} needs --checkpoint with its weights (without one, lmcli runs "
                             "the embedded SmolLM2-135M-Instruct)")

        checkpoint = default_checkpoint_path()
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    # Quantized weights stay quantized (a GGUF file's own, or --quantize's); the activation dtype
    # is then chosen after reading, from what the weights' kernels measure fastest with.
    quantized_load = quantize in ("int4", "int8") or (quantize is None and path.suffix == ".gguf")

    if path.suffix == ".gguf":
        from lmcli.default_model import load_gguf_cached
        from lmcli.io.tokenizer import tokenizer_from_gguf

        if quantized_load:  # read as float32 / quantized blocks; cast once the activation dtype is known
            from lmcli.io.gguf import read_gguf

            gguf = read_gguf(path, torch.float32, keep_quantized=quantize is None)
        else:  # GGUF weights are quantised or float: `auto` is decided by the device alone.
            gguf = load_gguf_cached(path, resolve_dtype(dtype, device))
        config = registry.config_from_hf(gguf.hf_config, model)
        tensors = gguf.tensors
        tokenizer = tokenizer_from_gguf(gguf.metadata)
        source = str(path)
    else:
        if path.is_dir():
            config_path = path / "config.json"
            preset = registry.preset_config(model) if model is not None else None
            if config_path.is_file():
                hf_config = _read_config_json(config_path)
            elif preset is not None:
                hf_config = preset
            else:
                raise CheckpointError(f"{path}: no config.json (pass --model with a preset name to supply one)")
            files = safetensors_files(path)
            tokenizer_dir = path
        elif path.suffix == ".safetensors":
            beside = path.parent / "config.json"
            if model is not None:
                preset = registry.preset_config(model)
                if preset is None:
                    raise ConfigError(
                        f"unknown model '{model}' (presets: {', '.join(registry.list_presets())})"
                    )
                hf_config = preset
            elif beside.is_file():
                hf_config = _read_config_json(beside)
            else:
                raise UsageError(f"{path}: a single .safetensors file needs --model NAME (a preset) to supply its config")
            files = [path]
            tokenizer_dir = path.parent
        else:
            raise CheckpointError(f"{path}: not a checkpoint (expected an HF directory, a .safetensors or a .gguf file)")
        config = registry.config_from_hf(hf_config, model)
        target_dtype = torch.float32 if quantized_load else resolve_dtype(dtype, device, config.torch_dtype)
        tensors, origin = read_safetensors(files, target_dtype)
        source = str(files[0]) if len(files) == 1 else str(path)
        from lmcli.io.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)

    module = registry.architecture_module(config.model_type)
    if hasattr(module, "convert_checkpoint"):
        tensors = module.convert_checkpoint(tensors, config)
    with _uninitialised_parameters():
        built = BaseModel(config)
    if quantized_load:
        if quantize in ("int4", "int8"):
            tensors = quantize_weights(tensors, quantize, _quantizable_names(built))
        quantized = {name: t for name, t in tensors.items() if isinstance(t, GroupQuantized)}
        kinds = [q.kind for q in quantized.values()]
        if dtype is None or str(dtype) == "auto":
            activation = preferred_dtype(max(set(kinds), key=kinds.count), device) if kinds else resolve_dtype(None, device)
        else:
            activation = resolve_dtype(dtype, device)
        for name in quantized:
            del tensors[name]
        built.kernel_choices = install_quantized(built, quantized, activation, device)
        del quantized
        tensors = {name: t.to(activation) if t.is_floating_point() else t for name, t in tensors.items()}
    tensors = {name: t.to(device=device) for name, t in tensors.items()}
    fill_model(built, tensors, source, origin)
    built.use_fast_layout()
    built.eval()
    return built, tokenizer
