"""The one encoder-decoder (T5, BART, Marian): an encoder run once per call, a decoder that attends
to its output, and generation on the same contract as the decoders.

The families differ only in config fields (`EncoderDecoderConfig`): how positions enter (T5's
relative buckets, BART's learned table, Marian's sinusoids), where the norms sit (before or after
each block), embedding and output scales, biases and `final_logits_bias`. Their thin files
(t5.py, bart.py, marian.py) read those fields from config.json and rename checkpoint tensors.

Generation (lmcli.generation.models, above) hands the shared loop a `DecoderRun`: the decoder bound to
one call's encoder output, whose cross-attention keys and values are computed once.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lmcli.kernels.linear import WeightCounting
from lmcli.kernels.numerics import HasNumerics
from lmcli.models.cache import KVCache
from lmcli.models.encoder_decoder_config import EncoderDecoderConfig
from lmcli.models.encoder_decoder_run import EncoderDecoderCache
from lmcli.models.layers import MLP, make_norm
from lmcli.models.slots import positions_from_mask


def relative_position_buckets(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                              max_distance: int) -> torch.Tensor:
    """T5's bucket of each key-minus-query distance: exact for small distances, log-spaced up to
    `max_distance`, one bucket beyond. A decoder (not bidirectional) sees only the past."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = -torch.clamp(relative, max=0)
    exact = num_buckets // 2
    log_spaced = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                          * (num_buckets - exact)).long()
    log_spaced = log_spaced.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, log_spaced)


def sinusoidal_table(positions: int, dim: int, device: torch.device) -> torch.Tensor:
    """Marian's [positions, dim] table: sines in the first half, cosines in the second (not interleaved)."""
    half = -(-dim // 2)
    frequencies = 10000.0 ** (-2 * torch.arange(half, dtype=torch.float64) / dim)  # (half,)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * frequencies  # (P, half)
    return torch.cat([angles.sin(), angles.cos()[:, : dim - half]], dim=1).float().to(device)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask -> 0 where allowed, -inf elsewhere, in `dtype`."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class EncDecAttention(nn.Module):
    """Multi-head attention over its own input (self) or over given keys and values (cross)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, bias: bool, scale: float):
        super().__init__()
        self.heads, self.head_dim, self.scale = heads, head_dim, scale
        inner = heads * head_dim
        self.q_proj = nn.Linear(hidden, inner, bias=bias)
        self.k_proj = nn.Linear(hidden, inner, bias=bias)
        self.v_proj = nn.Linear(hidden, inner, bias=bias)
        self.o_proj = nn.Linear(inner, hidden, bias=bias)

    def split(self, projected: torch.Tensor) -> torch.Tensor:
        B, T, _ = projected.shape
        return projected.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)

    def keys_values(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k_proj(states)), self.split(self.v_proj(states))  # (B, nh, S, hd) each

    def forward(self, x: torch.Tensor, mask: torch.Tensor, keys_values: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: KVCache | None = None, slots: torch.Tensor | None = None, slot_end: int | None = None) -> torch.Tensor:
        q = self.split(self.q_proj(x))  # (B, nh, T, hd)
        if keys_values is None:
            k, v = self.keys_values(x)
            if cache is not None and slots is not None:
                k, v, _ = cache.update(k, v, slots, slot_end)  # (B, nh, S, hd)
        else:
            k, v = keys_values
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # (B, nh, T, hd)
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class Block(nn.Module):
    """Self-attention, cross-attention (decoder only) and the feed-forward, each with its norm."""

    def __init__(self, config: EncoderDecoderConfig, is_decoder: bool):
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads if is_decoder else config.encoder_attention_heads
        head_dim = config.head_dim if is_decoder else config.encoder_head_dim
        scale = config.attention_scale or head_dim**-0.5
        self.norm_first = config.norm_first
        self.self_attn = EncDecAttention(hidden, heads, head_dim, config.attention_bias, scale)
        self.self_attn_norm = make_norm(config)
        self.cross_attn: EncDecAttention | None = None
        if is_decoder:
            self.cross_attn = EncDecAttention(hidden, heads, head_dim, config.attention_bias, scale)
            self.cross_attn_norm = make_norm(config)
        self.mlp = MLP(config, hidden, config.intermediate_size if is_decoder else config.encoder_ffn_dim)
        self.mlp_norm = make_norm(config)

    def _sublayer(self, x: torch.Tensor, norm: nn.Module, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.norm_first:
            return x + sublayer(norm(x))
        return norm(x + sublayer(x))

    def forward(self, x: torch.Tensor, self_mask: torch.Tensor, cross: tuple[torch.Tensor, torch.Tensor] | None = None,
                cross_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, slot_end: int | None = None) -> torch.Tensor:
        x = self._sublayer(x, self.self_attn_norm, lambda h: self.self_attn(h, self_mask, None, cache, slots, slot_end))
        if self.cross_attn is not None and cross is not None and cross_mask is not None:
            attention = self.cross_attn
            x = self._sublayer(x, self.cross_attn_norm, lambda h: attention(h, cross_mask, cross))
        return self._sublayer(x, self.mlp_norm, self.mlp)


class Stack(nn.Module):
    """The encoder or the decoder: blocks and whatever their positions and norms need."""

    def __init__(self, config: EncoderDecoderConfig, is_decoder: bool):
        super().__init__()
        self.config, self.is_decoder = config, is_decoder
        count = config.num_hidden_layers if is_decoder else config.encoder_layers
        heads = config.num_attention_heads if is_decoder else config.encoder_attention_heads
        self.layers = nn.ModuleList(Block(config, is_decoder) for _ in range(count))
        if config.position_embedding == "relative":
            self.relative_bias = nn.Embedding(config.relative_attention_num_buckets, heads)
        elif config.position_embedding == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings + config.position_offset,
                                                config.hidden_size)
        if config.embedding_norm:
            self.embedding_norm = make_norm(config)
        if config.stack_final_norm:
            self.final_norm = make_norm(config)
        self._sinusoids: dict[str, torch.Tensor] = {}

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, hidden] (already looked up) plus positions [B, T], then the embedding norm."""
        config = self.config
        x = tokens * config.embed_scale if config.embed_scale != 1.0 else tokens
        if config.position_embedding == "learned":
            x = x + self.embed_positions(positions + config.position_offset)
        elif config.position_embedding == "sinusoidal":
            x = x + self._sinusoid_table(x.device)[positions].to(x.dtype)
        if config.embedding_norm:
            x = self.embedding_norm(x)
        return x

    def _sinusoid_table(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._sinusoids:
            self._sinusoids[key] = sinusoidal_table(self.config.max_position_embeddings, self.config.hidden_size, device)
        return self._sinusoids[key]

    def position_bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor | None:
        """T5's additive bias [1, nh, T, S] from the key-minus-query distances; None for the others."""
        if self.config.position_embedding != "relative":
            return None
        buckets = relative_position_buckets(
            key_positions[None, :] - query_positions[:, None], not self.is_decoder,
            self.config.relative_attention_num_buckets, self.config.relative_attention_max_distance,
        )  # (T, S)
        return self.relative_bias(buckets).permute(2, 0, 1)[None].to(dtype)  # (1, nh, T, S)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_norm(x) if self.config.stack_final_norm else x


class EncoderDecoderStacks(nn.Module):
    def __init__(self, config: EncoderDecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # shared by both stacks
        self.encoder = Stack(config, is_decoder=False)
        self.decoder = Stack(config, is_decoder=True)


def encoder_mask(x: Any, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The encoder input's mask as booleans [B, S], after checking both. Pads may sit on either side."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.long, torch.int, torch.int32):
        raise ValueError("x must be an integer tensor of encoder token ids shaped [batch, input_len]")
    if x.shape[1] == 0:
        raise ValueError("x has no tokens; every row needs at least one")
    if attention_mask is None:
        return torch.ones_like(x, dtype=torch.bool)
    if attention_mask.shape != x.shape:
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)} but x has {list(x.shape)}")
    mask = attention_mask.bool().to(x.device)
    if not mask.any(dim=1).all():
        raise ValueError("attention_mask has a row with no tokens")
    return mask


class EncoderDecoderModel(HasNumerics, WeightCounting, nn.Module):
    """`model(input_ids, attention_mask, decoder_input_ids)` returns decoder logits [B, T_dec, vocab];
    `generate` (lmcli.generation.models) takes the encoder input and returns decoder ids, as transformers' does."""

    def __init__(self, config: EncoderDecoderConfig):
        super().__init__()
        self.config = config
        self.model = EncoderDecoderStacks(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.final_logits_bias:
            self.final_logits_bias = nn.Parameter(torch.zeros(1, config.vocab_size), requires_grad=False)
        self.tie_weights()
        self.eval()

    def tie_weights(self) -> None:
        from lmcli.kernels.linear import tie_quantized_head

        if self.config.tie_word_embeddings and not tie_quantized_head(self):
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self, after_each_layer: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Join each gated feed-forward's gate and up projections (as the decoders do); attention stays as loaded."""
        for stack in (self.model.encoder, self.model.decoder):
            for block in cast(Sequence[Block], stack.layers):
                parts = [block.mlp.gate_proj, getattr(block.mlp, "up_proj", None)]
                weights = [part.weight for part in parts if isinstance(part, nn.Linear)]
                block.mlp.fuse_projections()
                if after_each_layer is not None:
                    after_each_layer(weights)
                del weights, parts

    def use_fast_layout(self) -> None:
        """The head column-major on CPU, as `BaseModel.use_fast_layout` explains."""
        if self.device.type == "cpu" and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight.data = self.lm_head.weight.data.t().contiguous().t()

    def compile_decode(self, builds: bool = True) -> bool:
        """As `BaseModel.compile_decode`'s signature: no program exists for these models, so they decode
        eagerly; only an explicit --compile (`builds`) is told so, the default says nothing."""
        if builds:
            sys.stderr.write("warning: --compile is not supported for encoder-decoder models; decoding without it\n")
        return False

    # --- forward ----------------------------------------------------------------------------------

    def encode(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Encoder states [B, S, hidden] for input ids [B, S] whose real tokens `mask` [B, S] marks."""
        encoder = self.model.encoder
        positions = positions_from_mask(mask)  # (B, S): a row's positions do not depend on its padding
        x = encoder.embed(self.model.embed_tokens(input_ids), positions)
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)
        attend = additive(mask[:, None, None, :], x.dtype)  # (B, 1, 1, S)
        bias = encoder.position_bias(columns, columns, x.dtype)  # distances between real tokens: padding-free
        self_mask = attend if bias is None else attend + bias
        for block in encoder.layers:
            x = block(x, self_mask)
        return encoder.finish(x)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               cross: Sequence[tuple[torch.Tensor, torch.Tensor]], encoder_mask: torch.Tensor,
               cache: Sequence[KVCache] | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, vocab] for decoder tokens [B, T] at `slots` [T], given every block's cross
        keys and values and the encoder's mask [B, S]; self-attention keys are written to `cache`."""
        decoder = self.model.decoder
        x = decoder.embed(self.model.embed_tokens(input_ids), positions)
        cross_mask = additive(encoder_mask[:, None, None, :], x.dtype)  # (B, 1, 1, S)
        slot_end = int(slots[-1]) + 1  # one host sync per call
        key_slots = torch.arange(slot_end, device=slots.device) if cache is not None else slots
        causal = additive(key_slots[None, :] <= slots[:, None], x.dtype)[None, None]  # (1, 1, T, S)
        bias = decoder.position_bias(slots, key_slots, x.dtype)
        self_mask = causal if bias is None else causal + bias
        for index, block in enumerate(decoder.layers):
            layer_cache = None if cache is None else cache[index]
            x = block(x, self_mask, cross[index], cross_mask, layer_cache, slots, slot_end)
        x = decoder.finish(x[:, -1:] if last_only else x)
        if self.config.decoder_output_scale != 1.0:
            x = x * self.config.decoder_output_scale
        logits = self.lm_head(x)  # (B, T, vocab)
        if self.config.final_logits_bias:
            logits = logits + self.final_logits_bias.to(logits.dtype)
        return logits

    def cross_keys_values(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every decoder block's cross-attention keys and values [B, nh, S, hd], computed once per call."""
        return [cast(EncDecAttention, block.cross_attn).keys_values(states) for block in self.model.decoder.layers]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder logits [B, T_dec, vocab] without a cache (decoder_input_ids default: the start token)."""
        mask = encoder_mask(input_ids, attention_mask)
        if decoder_input_ids is None:
            decoder_input_ids = self.decoder_start(input_ids.shape[0], input_ids.device)
        states = self.encode(input_ids, mask)
        slots = torch.arange(decoder_input_ids.shape[1], device=input_ids.device)
        positions = slots[None].expand(decoder_input_ids.shape[0], -1)
        return self.decode(decoder_input_ids, positions, slots, self.cross_keys_values(states), mask)

    def decoder_start(self, batch: int, device: torch.device) -> torch.Tensor:
        return torch.full((batch, 1), self.config.decoder_start_token_id, dtype=torch.long, device=device)

    # --- cache and generation ---------------------------------------------------------------------

    def init_cache(self, batch_size: int, max_length: int, encoder_states: torch.Tensor | None = None,
                   encoder_mask: torch.Tensor | None = None) -> EncoderDecoderCache:
        """Self-attention caches for `batch_size` rows of `max_length` decoder tokens, and, given the
        encoder's states [B, S, hidden] and mask [B, S], every block's cross-attention keys and values."""
        return EncoderDecoderCache.for_model(self, batch_size, max_length, encoder_states, encoder_mask)

    def traverse_cache(self, cache: EncoderDecoderCache, fn: Callable[[torch.Tensor], torch.Tensor]) -> EncoderDecoderCache:
        return cache.traverse(fn)

    @property
    def device(self) -> torch.device:
        return self._a_norm().weight.device  # norms are never quantized

    @property
    def dtype(self) -> torch.dtype:
        return self._a_norm().weight.dtype

    def _a_norm(self) -> nn.LayerNorm:
        return cast(nn.LayerNorm, cast(Block, self.model.decoder.layers[0]).mlp_norm)  # or an RMSNorm: both have .weight

