"""Qwen2 / Qwen2.5: llama with q/k/v biases, and an optional window on the upper layers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcli.config import FULL, SLIDING, ModelConfig
from lmcli.models import llama

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from lmcli.io.gguf import GGUFFile


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    layer_types = hf.get("layer_types") or [
        SLIDING if window is not None and i >= hf.get("max_window_layers", 28) else FULL
        for i in range(int(hf["num_hidden_layers"]))
    ]
    fields = dict(
        architecture="qwen2",
        attention_bias=True,
        attention_out_bias=False,
        mlp_bias=False,
        sliding_window=window,
        layer_types=layer_types,
    )
    fields.update(overrides)
    return llama.config_from_hf(hf, **fields)


def config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    config = gguf.decoder_fields()
    return {"model_type": "qwen2", "hidden_act": "silu", **config, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": config["num_hidden_layers"],
            "architectures": ["Qwen2ForCausalLM"]}


def tensors_from_gguf(gguf: GGUFFile, name: str, tensor: torch.Tensor,
                      config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    return gguf.decoder_tensors(name, tensor, config)  # qwen2's q/k rows are stored as HF has them
