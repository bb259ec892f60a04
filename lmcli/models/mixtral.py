"""Mixtral: mistral with a sparse mixture-of-experts block in place of the MLP."""

from lmcli.config import ModelConfig, require
from lmcli.models import mistral

# What the registry reads from this module: the HF model_types it builds, the GGUF
# `general.architecture` values it translates, and the preset a bare name stands for.
HF_MODEL_TYPES = ("mixtral",)
GGUF_ARCHITECTURES = ()  # read by the llama module
FLAGSHIP_PRESETS = {"mixtral": "mixtral-8x7b-v0.1"}
STORED_AS = ("llama",)  # GGUF files store its weights under "llama": naming mixtral for one is no conflict


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    fields = dict(
        architecture="mixtral",
        num_local_experts=int(require(hf, "num_local_experts")),
        num_experts_per_tok=int(require(hf, "num_experts_per_tok")),
    )
    fields.update(overrides)
    return mistral.config_from_hf(hf, **fields)
