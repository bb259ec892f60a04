"""Mistral: llama whose every layer attends to the last `sliding_window` keys only."""

from lmcli.config import FULL, SLIDING, ModelConfig
from lmcli.models import llama

# What the registry reads from this module: the HF model_types it builds, the GGUF
# `general.architecture` values it translates, and the preset a bare name stands for.
HF_MODEL_TYPES = ("mistral",)
GGUF_ARCHITECTURES = ()  # read by the llama module
FLAGSHIP_PRESETS = {"mistral": "mistral-7b-v0.1"}
STORED_AS = ("llama",)  # GGUF files store its weights under "llama": naming mistral for one is no conflict


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    window = hf.get("sliding_window")
    layer_types = [SLIDING if window else FULL] * int(hf["num_hidden_layers"])
    fields = dict(architecture="mistral", sliding_window=window, layer_types=layer_types)
    fields.update(overrides)
    return llama.config_from_hf(hf, **fields)
