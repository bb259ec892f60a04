"""Marian (opus-mt translation models) on the shared encoder-decoder (models/encoder_decoder.py).

BART's names and post-sublayer layer norms (bart.py), with sinusoidal positions (sines then
cosines, computed, never read from the file), no embedding norm, embeddings scaled by
sqrt(d_model) when `scale_embedding` says so, and `final_logits_bias`. The encoder and decoder
share one vocabulary: a separate decoder vocabulary is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcli.errors import ConfigError
from lmcli.models.bart import bart_like_fields, build_model, convert_checkpoint

if TYPE_CHECKING:
    from lmcli.models.encoder_decoder_config import EncoderDecoderConfig

HF_MODEL_TYPES = ("marian",)
GGUF_ARCHITECTURES: tuple[str, ...] = ()
FLAGSHIP_PRESETS = {"marian": "opus-mt-en-de"}
__all__ = ["build_model", "config_from_hf", "convert_checkpoint"]


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> EncoderDecoderConfig:
    from lmcli.models.encoder_decoder_config import make_config

    fields = bart_like_fields(hf, "swish")
    decoder_vocab = hf.get("decoder_vocab_size")
    if hf.get("share_encoder_decoder_embeddings") is False or (decoder_vocab not in (None, fields["vocab_size"])):
        raise ConfigError(f"config.json: decoder_vocab_size ({decoder_vocab}) differs from vocab_size "
                          f"({fields['vocab_size']}) or the embeddings are not shared; only a shared vocabulary "
                          "is supported")
    fields.update(model_type="marian", architecture="marian", position_embedding="sinusoidal")
    fields.update(overrides)
    return make_config(hf, **fields)
