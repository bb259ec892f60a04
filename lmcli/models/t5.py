"""T5, T5 v1.1 and Flan-T5 on the shared encoder-decoder (models/encoder_decoder.py).

Relative position buckets (one table per stack, in its first block), RMS norms without bias before
each sublayer, unscaled attention, no biases; `feed_forward_proj` relu (T5) or gated-gelu (v1.1,
Flan-T5). A tied head scales the decoder's output by d_model ** -0.5 first; untied heads do not.
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

HF_MODEL_TYPES = ("t5",)
GGUF_ARCHITECTURES: tuple[str, ...] = ()
FLAGSHIP_PRESETS = {"t5": "flan-t5-small"}


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> EncoderDecoderConfig:
    from lmcli.models.encoder_decoder_config import make_config

    d_model, d_kv, d_ff = (int(require(hf, name)) for name in ("d_model", "d_kv", "d_ff"))
    layers, heads = int(require(hf, "num_layers")), int(require(hf, "num_heads"))
    projection = str(hf.get("feed_forward_proj", "relu"))
    parts = projection.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ConfigError(f"config.json: feed_forward_proj '{projection}' is neither ACT nor gated-ACT")
    activation = "gelu_new" if projection == "gated-gelu" else parts[-1]  # as T5's own code reads it
    tied = hf.get("tie_word_embeddings", True) is not False
    scaled = bool(hf.get("scale_decoder_outputs", tied))
    fields = dict(
        model_type="t5", architecture="t5", vocab_size=int(require(hf, "vocab_size")),
        hidden_size=d_model, intermediate_size=d_ff,
        num_hidden_layers=int(hf.get("num_decoder_layers") or layers),
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=d_kv,
        max_position_embeddings=int(hf.get("n_positions") or 512),  # the trained length; the decoder has no limit
        norm_type="rmsnorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
        attention_scale=1.0, position_embedding="relative",
        hidden_act=activation, gated_mlp=len(parts) == 2, mlp_bias=False, tie_word_embeddings=tied,
        encoder_layers=layers, encoder_attention_heads=heads, encoder_head_dim=d_kv, encoder_ffn_dim=d_ff,
        relative_attention_num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(hf.get("relative_attention_max_distance", 128)),
        norm_first=True, stack_final_norm=True, decoder_output_scale=d_model**-0.5 if scaled else 1.0,
    )
    fields.update(overrides)
    return make_config(hf, **fields)


def build_model(config: EncoderDecoderConfig, cls: type[EncoderDecoderModel] | None = None) -> EncoderDecoderModel:
    """The model of `config`, of class `cls` (loading's, which generates) or the bare EncoderDecoderModel."""
    from lmcli.models.encoder_decoder import EncoderDecoderModel

    return (cls or EncoderDecoderModel)(config)


_SUBLAYERS = {  # (stack, sublayer index) -> our name
    ("encoder", "0"): "self_attn", ("encoder", "1"): "mlp",
    ("decoder", "0"): "self_attn", ("decoder", "1"): "cross_attn", ("decoder", "2"): "mlp",
}
_LEAVES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
           "wi": "up_proj", "wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}
_BLOCK = re.compile(r"(encoder|decoder)\.block\.(\d+)\.layer\.(\d+)\.(.+)")


def convert_checkpoint(tensors: dict[str, torch.Tensor], config: EncoderDecoderConfig) -> dict[str, torch.Tensor]:
    """T5 names -> the shared encoder-decoder's; unknown names pass through for the strict check to report."""
    out = {}
    for name, tensor in tensors.items():
        if name in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            out["model.embed_tokens.weight"] = tensor  # one table: T5 ties all three
            continue
        if name in ("encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight"):
            out[f"model.{name.split('.')[0]}.final_norm.weight"] = tensor
            continue
        match = _BLOCK.fullmatch(name)
        if not match:
            out[name] = tensor  # lm_head.weight
            continue
        stack, block, sublayer, rest = match.groups()
        ours = _SUBLAYERS.get((stack, sublayer))
        if ours is None:
            out[name] = tensor
            continue
        if rest.endswith("relative_attention_bias.weight"):
            if ours == "self_attn" and block == "0":
                out[f"model.{stack}.relative_bias.weight"] = tensor
            elif ours != "cross_attn":  # cross-attention never has one; some files carry an unused copy
                out[name] = tensor
            continue
        if rest == "layer_norm.weight":
            out[f"model.{stack}.layers.{block}.{ours}_norm.weight"] = tensor
            continue
        module, _, leaf = rest.rpartition(".")
        projection = module.split(".")[-1]
        out[f"model.{stack}.layers.{block}.{ours}.{_LEAVES.get(projection, projection)}.{leaf}"] = tensor
    return out
