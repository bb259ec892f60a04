"""Llama (and SmolLM2, Llama 3.x): the reference shape of the shared decoder.

RMSNorm, RoPE (default / linear / llama3 scaling), SwiGLU, grouped-query attention,
optional attention and MLP biases, optional tied embeddings.
"""

from lmcli.config import ModelConfig, common_decoder_fields, rope_from_hf


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    fields = dict(
        architecture="llama",
        rope=rope_from_hf(hf),
        hidden_act=hf.get("hidden_act", "silu"),
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )
    fields.update(overrides)
    return ModelConfig(**common_decoder_fields(hf), **fields)
