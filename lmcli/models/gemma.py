"""The Gemma family: gemma, gemma2 and gemma3_text.

gemma:       RMSNorm applied as (1 + w), embeddings scaled by sqrt(hidden_size), GeGLU (tanh GELU).
gemma2:      + alternating sliding/global layers, norms after attention and around the MLP,
               attention and final-logit soft-capping, attention scale query_pre_attn_scalar ** -0.5.
gemma3_text: + RMSNorm on q and k, `layer_types`, its own RoPE base for local layers, no soft-capping.
"""

from lmcli.config import FULL, SLIDING, ModelConfig, common_decoder_fields, rope_from_hf


def _alternating(num_layers: int, period: int) -> list[str]:
    """Every `period`-th layer is global, the rest sliding (gemma2: 2, gemma3: 6)."""
    return [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    model_type = hf.get("model_type", "gemma")
    fields = common_decoder_fields(hf)
    fields["head_dim"] = int(hf.get("head_dim") or 256)
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    traits = dict(
        architecture="gemma",
        norm_unit_offset=True,
        scale_embeddings=True,
        hidden_act=hf.get("hidden_activation") or "gelu_pytorch_tanh",
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=bool(hf.get("attention_bias", False)),
        rope=rope_from_hf(hf, FULL),
    )
    if model_type in ("gemma2", "gemma3_text", "gemma3"):
        layers = fields["num_hidden_layers"]
        default_period = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
        traits.update(
            sandwich_norms=True,
            attention_scale=float(hf.get("query_pre_attn_scalar") or 256) ** -0.5,
            sliding_window=hf.get("sliding_window"),
            layer_types=hf.get("layer_types") or _alternating(layers, default_period),
            attn_logit_softcapping=hf.get("attn_logit_softcapping", 50.0 if model_type == "gemma2" else None),
            final_logit_softcapping=hf.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None),
        )
    if model_type in ("gemma3_text", "gemma3"):
        local = rope_from_hf(hf, SLIDING, default_theta=10000.0)
        if "rope_local_base_freq" in hf:
            local.theta = float(hf["rope_local_base_freq"])
            local.rope_type, local.factor = "default", 1.0  # rope_scaling only applies to global layers
        traits.update(qk_norm=True, rope=rope_from_hf(hf, FULL, default_theta=1_000_000.0), rope_local=local)
    traits.update(overrides)
    return ModelConfig(**fields, **traits)
