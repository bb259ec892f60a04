"""The Gemma family: gemma, gemma2 and gemma3_text.

gemma:       RMSNorm applied as (1 + w), embeddings scaled by sqrt(hidden_size), GeGLU (tanh GELU).
gemma2:      + alternating sliding/global layers, norms after attention and around the MLP,
               attention and final-logit soft-capping, attention scale query_pre_attn_scalar ** -0.5.
gemma3_text: + RMSNorm on q and k, `layer_types`, its own RoPE base for local layers, no soft-capping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcli.config import FULL, SLIDING, ModelConfig, common_decoder_fields, rope_from_hf

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from lmcli.io.gguf import GGUFFile


def _default_period(model_type: str) -> int:
    """Every period-th layer is global when the config does not say: gemma2 alternates, gemma3 has 5 local : 1 global."""
    return 2 if model_type == "gemma2" else 6


def _alternating(num_layers: int, period: int) -> list[str]:
    """Every `period`-th layer is global, the rest sliding."""
    return [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    model_type = hf.get("model_type", "gemma")
    fields = common_decoder_fields(hf)
    fields["head_dim"] = int(hf.get("head_dim") or 256)
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    traits: dict[str, Any] = dict(
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
        default_period = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern") or _default_period(model_type))
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


# --- GGUF

_MODEL_TYPES = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text"}  # GGUF architecture -> HF model_type
_HF_CLASSES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# gemma2/3 put a norm on each side of attention and of the MLP.
_SANDWICH_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}


def config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    config = gguf.decoder_fields()
    config["tie_word_embeddings"] = True  # gemma's head is its embedding, always
    model_type = _MODEL_TYPES[gguf.arch]
    config = {"model_type": model_type, "hidden_activation": "gelu_pytorch_tanh", **config}
    if model_type != "gemma":
        layers = config["num_hidden_layers"]
        # llama.cpp does not store the attention scale: it is head_dim except on the 27B models,
        # which use hidden / heads (told apart by layer count: 46 for gemma2, 62 for gemma3).
        scale = gguf.get("attention.scale")
        if scale:
            query_pre_attn_scalar = gguf.fitted(1 / scale ** 2)
        elif layers == {"gemma2": 46, "gemma3_text": 62}[model_type]:
            query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
        else:
            query_pre_attn_scalar = config["head_dim"]
        pattern = gguf.get("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # newer files: one flag per layer, true where the window applies
            layer_types = [SLIDING if swa else FULL for swa in pattern]
        else:
            layer_types = _alternating(layers, int(pattern or _default_period(model_type)))
        config.update(
            query_pre_attn_scalar=query_pre_attn_scalar,
            sliding_window=gguf.integer("attention.sliding_window"),
            layer_types=layer_types,
            attn_logit_softcapping=gguf.get("attn_logit_softcapping"),
            final_logit_softcapping=gguf.get("final_logit_softcapping"),
        )
    if model_type == "gemma3_text":
        # llama.cpp fixes the local layers' RoPE base at 10000 unless the file says otherwise.
        config["rope_local_base_freq"] = gguf.get("rope.freq_base_swa", 10000.0)
    config["architectures"] = [_HF_CLASSES[model_type]]
    return config


def tensors_from_gguf(gguf: GGUFFile, name: str, tensor: torch.Tensor,
                      config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    if name.endswith("norm.weight"):
        tensor = tensor - 1.0  # llama.cpp stores gemma's RMSNorm weights as (1 + w)
    if config["model_type"] == "gemma":
        return gguf.decoder_tensors(name, tensor, config)
    from lmcli.io.gguf import DECODER_BLOCK

    return gguf.decoder_tensors(name, tensor, config, block_names={**DECODER_BLOCK, **_SANDWICH_NAMES})
