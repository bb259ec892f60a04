"""Mixtral: mistral with a sparse mixture-of-experts block in place of the MLP."""

from lmcli.config import ModelConfig, require
from lmcli.models import mistral


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    fields = dict(
        architecture="mixtral",
        num_local_experts=int(require(hf, "num_local_experts")),
        num_experts_per_tok=int(require(hf, "num_experts_per_tok")),
    )
    fields.update(overrides)
    return mistral.config_from_hf(hf, **fields)
