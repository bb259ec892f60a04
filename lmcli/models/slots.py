"""The slot contract between the models and the decoding step above them.

Slots are the columns of a batch's left-padded token sequence; `slot_is_token` [B, S] marks which hold
real tokens, and each token's position is counted within its own row, so a padded row computes exactly
what it computes alone. A model that takes tokens at slots (`SlotModel`: BaseModel, an encoder-decoder's
DecoderRun) is all the step (lmcli.generation.step) knows of a model; it lives here, below the step, so
that the models never import the generation layer for it.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from lmcli.config import ModelConfig
from lmcli.kernels.numerics import Numerics

CacheT = TypeVar("CacheT")


class ModelShape(Protocol):
    """A model's config and device: what code below the models (the caches) sizes things by."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def device(self) -> torch.device: ...


class SlotModel(ModelShape, Protocol[CacheT]):
    """What the step needs of a model (lmcli.models.base.BaseModel is one): a cache is whatever its
    init_cache returns, and `numerics` what its load chose for the arithmetic."""

    @property
    def numerics(self) -> Numerics: ...

    def init_cache(self, batch_size: int, max_length: int) -> CacheT: ...

    def forward_slots(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                      slot_is_token: torch.Tensor, cache: CacheT | None = None, last_only: bool = False,
                      numerics: Numerics | None = None) -> torch.Tensor: ...


def positions_from_mask(slot_is_token: torch.Tensor) -> torch.Tensor:
    """Each token's position in its own row: pads on the left do not count. [B, S] -> [B, S] long."""
    return (slot_is_token.long().cumsum(-1) - 1).clamp(min=0)
