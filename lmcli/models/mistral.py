"""Mistral: llama whose every layer attends to the last `sliding_window` keys only."""

from lmcli.config import FULL, SLIDING, ModelConfig
from lmcli.models import llama


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    window = hf.get("sliding_window")
    layer_types = [SLIDING if window else FULL] * int(hf["num_hidden_layers"])
    fields = dict(architecture="mistral", sliding_window=window, layer_types=layer_types)
    fields.update(overrides)
    return llama.config_from_hf(hf, **fields)
