"""BART on the shared encoder-decoder (models/encoder_decoder.py).

Learned positions read at position + 2 (BART's offset), a layer norm on the embeddings, layer norms
after each sublayer's residual, biases everywhere, embeddings optionally scaled by sqrt(d_model)
(`scale_embedding`), and `final_logits_bias` added to the logits. Marian (marian.py) shares the
names and most of the shape.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from lmcli.config import require
from lmcli.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from lmcli.models.encoder_decoder import EncoderDecoderModel
    from lmcli.models.encoder_decoder_config import EncoderDecoderConfig

HF_MODEL_TYPES = ("bart",)
GGUF_ARCHITECTURES: tuple[str, ...] = ()
FLAGSHIP_PRESETS = {"bart": "bart-base"}


def bart_like_fields(hf: dict[str, Any], default_activation: str) -> dict[str, Any]:
    """The fields BART and Marian read alike from their config.json."""
    from lmcli.models.encoder_decoder_config import head_size

    if hf.get("normalize_before"):
        raise ConfigError("config.json: normalize_before (norms before each sublayer, as in mBART) is not supported")
    d_model = int(require(hf, "d_model"))
    encoder_heads, decoder_heads = int(require(hf, "encoder_attention_heads")), int(require(hf, "decoder_attention_heads"))
    return dict(
        vocab_size=int(require(hf, "vocab_size")), hidden_size=d_model,
        intermediate_size=int(require(hf, "decoder_ffn_dim")),
        num_hidden_layers=int(require(hf, "decoder_layers")),
        num_attention_heads=decoder_heads, num_key_value_heads=decoder_heads,
        head_dim=head_size(d_model, decoder_heads, "decoder_attention_heads"),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 1024),
        norm_type="layernorm", norm_eps=1e-5, attention_bias=True, mlp_bias=True, gated_mlp=False,
        hidden_act=str(hf.get("activation_function") or default_activation),
        tie_word_embeddings=hf.get("tie_word_embeddings", True) is not False,
        encoder_layers=int(require(hf, "encoder_layers")), encoder_attention_heads=encoder_heads,
        encoder_head_dim=head_size(d_model, encoder_heads, "encoder_attention_heads"),
        encoder_ffn_dim=int(require(hf, "encoder_ffn_dim")),
        embed_scale=d_model**0.5 if hf.get("scale_embedding") else 1.0,
        norm_first=False, final_logits_bias=True,
    )


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> EncoderDecoderConfig:
    from lmcli.models.encoder_decoder_config import make_config

    fields = dict(model_type="bart", architecture="bart", position_embedding="learned", position_offset=2,
                  embedding_norm=True, **bart_like_fields(hf, "gelu"))
    fields.update(overrides)
    return make_config(hf, **fields)


def build_model(config: EncoderDecoderConfig, cls: type[EncoderDecoderModel] | None = None) -> EncoderDecoderModel:
    """The model of `config`, of class `cls` (loading's, which generates) or the bare EncoderDecoderModel."""
    from lmcli.models.encoder_decoder import EncoderDecoderModel

    return (cls or EncoderDecoderModel)(config)


_RENAMES = {"out_proj": "o_proj", "self_attn_layer_norm": "self_attn_norm", "encoder_attn": "cross_attn",
            "encoder_attn_layer_norm": "cross_attn_norm", "fc1": "mlp.up_proj", "fc2": "mlp.down_proj",
            "final_layer_norm": "mlp_norm"}
_LAYER = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.(.+)")
EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
SHARED_TARGETS = frozenset({"model.embed_tokens.weight"})  # what EMBEDDINGS become: copies must agree (loading.py)


def convert_checkpoint(tensors: dict[str, torch.Tensor], config: EncoderDecoderConfig) -> dict[str, torch.Tensor]:
    """BART / Marian names -> the shared encoder-decoder's; unknown names pass through for the strict check."""
    out = {}
    for name, tensor in tensors.items():
        short = name.removeprefix("model.")
        if short in EMBEDDINGS:
            out["model.embed_tokens.weight"] = tensor  # one table for both stacks (and a tied head)
            continue
        if short.endswith("embed_positions.weight") and config.position_embedding == "sinusoidal":
            continue  # Marian's sinusoids, saved by older versions: computed, not read
        short = short.replace("layernorm_embedding", "embedding_norm")
        match = _LAYER.fullmatch(short)
        if match:
            stack, layer, rest = match.groups()
            parts = rest.split(".")
            module = ".".join(_RENAMES.get(part, part) for part in parts[:-1])
            short = f"{stack}.layers.{layer}.{module}.{parts[-1]}"
        out[name if name in ("lm_head.weight", "final_logits_bias") else f"model.{short}"] = tensor
    return out
