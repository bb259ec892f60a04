"""Qwen2 / Qwen2.5: llama with q/k/v biases, and an optional window on the upper layers."""

from lmcli.config import FULL, SLIDING, ModelConfig
from lmcli.models import llama


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
