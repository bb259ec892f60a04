"""One generate() call of an encoder-decoder: its cache and the decoder the generation loop steps.

The decoding step (lmcli.generation.step) drives any `SlotModel` (models/slots.py: `forward_slots`,
`init_cache`, `device`, `config`, `numerics`). `DecoderRun` is one: a decoder bound to one call's encoder output, so the
loop's rules (seeds, processors, EOS, hooks) apply unchanged. Its decoder rows are never padded: each starts with decoder_start_token_id.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from lmcli.kernels.numerics import Numerics
from lmcli.models.cache import KVCache

CrossKeysValues = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder block: keys, values [B, nh, S, hd]


class _Decoding(Protocol):
    config: Any

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               cross: Sequence[tuple[torch.Tensor, torch.Tensor]], encoder_mask: torch.Tensor,
               cache: Sequence[KVCache] | None = None, last_only: bool = False) -> torch.Tensor: ...

    def cross_keys_values(self, states: torch.Tensor) -> CrossKeysValues: ...


class EncoderDecoderCache:
    """The decoder's self-attention keys and values by slot (one KVCache per block), and the
    cross-attention keys and values of the encoder output with its mask [B, S], which never change."""

    def __init__(self, self_attention: list[KVCache], cross: CrossKeysValues, encoder_mask: torch.Tensor | None):
        self.layers = self_attention
        self.cross = cross
        self.encoder_mask = encoder_mask

    @classmethod
    def for_model(cls, model: _Decoding, batch_size: int, max_length: int, encoder_states: torch.Tensor | None = None,
                  encoder_mask: torch.Tensor | None = None, cross: CrossKeysValues | None = None) -> EncoderDecoderCache:
        config = model.config
        layers = [KVCache(batch_size, config.num_attention_heads, max_length, config.head_dim, model.dtype, model.device)
                  for _ in range(config.num_hidden_layers)]
        if cross is None:
            cross = model.cross_keys_values(encoder_states) if encoder_states is not None else []
        if encoder_mask is None and encoder_states is not None:
            encoder_mask = torch.ones(encoder_states.shape[:2], dtype=torch.bool, device=encoder_states.device)
        return cls(layers, cross, encoder_mask)

    def traverse(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> EncoderDecoderCache:
        for layer in self.layers:
            layer.traverse(fn)
        self.cross = [(fn(keys), fn(values)) for keys, values in self.cross]
        if self.encoder_mask is not None:
            self.encoder_mask = fn(self.encoder_mask)
        return self

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row i becomes old row rows[i] [R], in the self-attention caches, the cross keys and values and
        the encoder mask alike (beam search: generation/beams.py)."""
        for layer in self.layers:
            layer.select_rows(rows)
        self.cross = [(keys.index_select(0, rows), values.index_select(0, rows)) for keys, values in self.cross]
        if self.encoder_mask is not None:
            self.encoder_mask = self.encoder_mask.index_select(0, rows)  # (R, S)

    def nbytes(self) -> int:
        tensors = [t for layer in self.layers for t in (layer.keys, layer.values)]
        tensors += [t for pair in self.cross for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)


NO_LIMIT = (1 << 31) - 1  # T5's relative positions


class DecoderRun:
    """The decoder of one call, bound to its encoder output (cross keys and values computed once)."""

    def __init__(self, model: _Decoding, encoder_states: torch.Tensor, encoder_mask: torch.Tensor):
        self.model = model
        self.device = encoder_states.device
        self.cross = model.cross_keys_values(encoder_states)
        self.encoder_mask = encoder_mask  # (B, S) bool
        self.limit: int | None = model.config.decoder_position_limit
        # What the loop reads of a config: max_position_embeddings, here the decoder's own limit.
        self.config = dataclasses.replace(model.config, max_position_embeddings=self.limit or NO_LIMIT)
        # The decoder reads nothing of a numerics record (its kernels sit in its modules; attention is
        # plain, in the parameters' dtype): the step is handed the default one.
        self.numerics = Numerics()
        # config.json's banned tokens are -inf in the logits; beam search bans them in its log-softmax
        # scores instead, as transformers' processor does there (generation/beams.py turns this off).
        self.suppress_in_logits = True

    def fit_to_positions(self, max_new_tokens: Any) -> Any:
        """max_new_tokens, lowered (with a one-line warning) so that the start token and the new
        tokens fit in the decoder's learned positions. Anything but an int is left for the loop to refuse."""
        if self.limit is None or isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            return max_new_tokens
        if 1 + max_new_tokens > self.limit:
            sys.stderr.write(f"warning: the decoder has {self.limit} positions (max_position_embeddings); "
                             f"generation stops after {self.limit - 1} new tokens\n")
            return self.limit - 1
        return max_new_tokens

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row i of the encoder output becomes old row rows[i] [R]: beam search repeats each input's
        encoder output once per beam (the encoder ran once per input) for passes without a cache."""
        self.cross = [(keys.index_select(0, rows), values.index_select(0, rows)) for keys, values in self.cross]
        self.encoder_mask = self.encoder_mask.index_select(0, rows)  # (R, S)

    def init_cache(self, batch_size: int, max_length: int) -> EncoderDecoderCache:
        return EncoderDecoderCache.for_model(self.model, batch_size, max_length, encoder_mask=self.encoder_mask,
                                             cross=self.cross)

    def forward_slots(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                      slot_is_token: torch.Tensor, cache: EncoderDecoderCache | None = None,
                      last_only: bool = False, numerics: Numerics | None = None) -> torch.Tensor:
        """The step's forward pass: logits for decoder tokens [B, T] at `query_slots` [T]. (`slot_is_token` is
        all True: decoder rows are never padded.)"""
        if cache is None:
            logits = self.model.decode(input_ids, positions, query_slots, self.cross, self.encoder_mask, None, last_only)
        else:
            mask = cache.encoder_mask if cache.encoder_mask is not None else self.encoder_mask
            logits = self.model.decode(input_ids, positions, query_slots, cache.cross, mask, cache.layers, last_only)
        suppressed = self.model.config.suppressed_token_ids
        if suppressed and self.suppress_in_logits:
            logits[..., suppressed] = float("-inf")
        return logits
