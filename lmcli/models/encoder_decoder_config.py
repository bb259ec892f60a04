"""EncoderDecoderConfig: the encoder-decoders' config fields, read and checked from config.json.

ModelConfig's own fields describe the decoder; these add the encoder's sizes and the traits the
families differ by. Light (no torch of its own), like lmcli.config, so the family files can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmcli.config import _COUNT, _SIZE, _TOKENS, ModelConfig, _check_fields, _Field, token_and_source_fields
from lmcli.errors import ConfigError


@dataclass
class EncoderDecoderConfig(ModelConfig):
    """ModelConfig's fields describe the decoder (num_hidden_layers, num_attention_heads,
    intermediate_size, head_dim); these add the encoder's and what the families do differently."""

    is_encoder_decoder: bool = True
    decoder_start_token_id: int = 0
    encoder_layers: int = 1
    encoder_attention_heads: int = 1
    encoder_head_dim: int = 1
    encoder_ffn_dim: int = 1
    # positions: "relative" (T5 buckets, no limit), "learned" (a table, read at position + offset), "sinusoidal"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    position_offset: int = 0
    embed_scale: float = 1.0  # token embeddings are multiplied by this (BART's scale_embedding: sqrt(d_model))
    norm_first: bool = True  # T5: norm, sublayer, residual; BART/Marian: sublayer, residual, norm
    embedding_norm: bool = False  # BART: a layer norm right after the embeddings
    stack_final_norm: bool = False  # T5: a norm after each stack's last block
    decoder_output_scale: float = 1.0  # T5 with a tied head: d_model ** -0.5 before the head
    final_logits_bias: bool = False  # BART/Marian: a stored bias added to the logits
    # config.json's single-token bad_words_ids (opus-mt: its pad token), never generated, as transformers' generate does
    suppressed_token_ids: list[int] = field(default_factory=list)

    @property
    def decoder_position_limit(self) -> int | None:
        """The most decoder positions there are (None: no limit)."""
        return None if self.position_embedding == "relative" else self.max_position_embeddings

    def stack_facts(self) -> list[tuple[str, str]]:
        """`lmcli info`'s lines for the two stacks."""
        def describe(layers: int, heads: int, head_dim: int, ffn: int) -> str:
            return f"{layers} layers, {heads} heads of {head_dim}, feed-forward {ffn}"

        return [("encoder", describe(self.encoder_layers, self.encoder_attention_heads, self.encoder_head_dim,
                                     self.encoder_ffn_dim)),
                ("decoder", describe(self.num_hidden_layers, self.num_attention_heads, self.head_dim,
                                     self.intermediate_size)),
                ("decoder start", f"token {self.decoder_start_token_id}")]


# config.json fields the families read beyond the decoders' (lmcli.config.HF_FIELDS), checked the same way.
FIELDS = {
    "d_model": _Field("int", 1, _SIZE, nullable=False),
    "d_kv": _Field("int", 1, _SIZE, nullable=False),
    "d_ff": _Field("int", 1, _SIZE, nullable=False),
    "num_layers": _Field("int", 1, _COUNT, nullable=False),
    "num_decoder_layers": _Field("int", 1, _COUNT),
    "num_heads": _Field("int", 1, _COUNT, nullable=False),
    "relative_attention_num_buckets": _Field("int", 2, 1 << 12, nullable=False),
    "relative_attention_max_distance": _Field("int", 2, _TOKENS, nullable=False),
    "feed_forward_proj": _Field("str", nullable=False),
    "scale_decoder_outputs": _Field("bool", nullable=False),
    "decoder_start_token_id": _Field("token_ids"),
    "encoder_layers": _Field("int", 1, _COUNT, nullable=False),
    "decoder_layers": _Field("int", 1, _COUNT, nullable=False),
    "encoder_attention_heads": _Field("int", 1, _COUNT, nullable=False),
    "decoder_attention_heads": _Field("int", 1, _COUNT, nullable=False),
    "encoder_ffn_dim": _Field("int", 1, _SIZE, nullable=False),
    "decoder_ffn_dim": _Field("int", 1, _SIZE, nullable=False),
    "scale_embedding": _Field("bool", nullable=False),
    "normalize_before": _Field("bool", nullable=False),
    "decoder_vocab_size": _Field("int", 1, _TOKENS),
    "share_encoder_decoder_embeddings": _Field("bool", nullable=False),
}


def make_config(hf: dict[str, Any], **fields: Any) -> EncoderDecoderConfig:
    """An EncoderDecoderConfig from a family's `fields` and config.json's special tokens, after
    checking what every encoder-decoder needs. Errors say "config.json:"; the registry names the file."""
    _check_fields(hf, FIELDS, "config.json")
    start = hf.get("decoder_start_token_id")
    if isinstance(start, list):
        start = start[0] if len(start) == 1 else None
    if start is None:
        raise ConfigError("config.json: missing field 'decoder_start_token_id' (the token an encoder-decoder's "
                          "decoder starts from)")
    if start >= fields["vocab_size"]:
        raise ConfigError(f"config.json: decoder_start_token_id {start} is outside the vocabulary "
                          f"({fields['vocab_size']} tokens)")
    return EncoderDecoderConfig(decoder_start_token_id=start, suppressed_token_ids=_suppressed(hf, fields["vocab_size"]),
                                **fields, **token_and_source_fields(hf))


def _suppressed(hf: dict[str, Any], vocab_size: int) -> list[int]:
    """The single-token entries of bad_words_ids (longer sequences are not applied)."""
    bad = hf.get("bad_words_ids")
    if bad is None:
        return []
    if not (isinstance(bad, list) and all(isinstance(words, list) for words in bad)
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for w in bad for i in w)):
        raise ConfigError(f"config.json: field 'bad_words_ids' must be a list of lists of token ids below {vocab_size}")
    return sorted({words[0] for words in bad if len(words) == 1})


def head_size(hidden: int, heads: int, name: str) -> int:
    """hidden // heads, or a ConfigError naming the heads field when they do not divide."""
    if hidden % heads:
        raise ConfigError(f"config.json: d_model ({hidden}) is not a multiple of {name} ({heads})")
    return hidden // heads
