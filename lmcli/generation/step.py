"""The decoding step: the one forward pass over a model's slots that every scheduler calls.

A scheduler decides which rows run and where their tokens sit (the slot layout of models/slots.py);
the step runs them and returns logits. Its two halves are gpt-fast's `prefill` / `decode_one_token`
pair (and what mlx-lm's `generate_step` does at each step): `prefill` feeds a prompt through the cache
in chunks and returns its last logits; `decode` feeds one token per row and returns the next logits;
`forward` is the general call under both (speculation reads every position of a guessed chunk). The
schedulers above it:

- loop.py: plain generate(), the whole batch in step from prefill to its last token;
- continuous.py: a job's rows entering and leaving one running batch;
- speculative.py, speculative_batch.py, speculative_draft.py: guesses checked in one pass, row by row
  or the rows together, and a draft model's own guesses.

A step carries the numerics its model's load chose (kernel plan, invariance, activation dtype:
kernels/numerics.py) and hands them to every forward pass; the schedulers ask it, not the model, whether
rows may share a batch exactly. Whether a pass runs eagerly or through a compiled program is decided
below it, in the model's forward_slots (models/compiled_step.py, models/compiled_prefill.py). Outside
the models this is the one caller of `forward_slots`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic

import torch

from lmcli.kernels.numerics import Numerics
from lmcli.models.slots import CacheT, SlotModel


@dataclass(frozen=True)
class Step(Generic[CacheT]):
    """The decoding step of `model`, computing with `numerics` (by default the model's load's: `Step.of`)."""

    model: SlotModel[CacheT]
    numerics: Numerics

    @classmethod
    def of(cls, model: SlotModel[CacheT]) -> Step[CacheT]:
        return cls(model, model.numerics)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                slot_is_token: torch.Tensor, cache: CacheT | None = None, *, last_only: bool = False) -> torch.Tensor:
        """Logits for the tokens `input_ids` [B, T] at `positions` [B, T] and `query_slots` [T], reading and
        writing `cache`: [B, T, V], or [B, 1, V] with `last_only`, in the model's dtype."""
        return self.model.forward_slots(input_ids, positions, query_slots, slot_is_token, cache,
                                        last_only=last_only, numerics=self.numerics)

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                slot_is_token: torch.Tensor, cache: CacheT | None, chunk: int | None = None) -> torch.Tensor:
        """The prompt's tokens [B, T] into `cache`, `chunk` columns a call (None: all at once, which is
        what bounds a long prompt's activations, not its numbers); the last token's logits [B, V]."""
        width = input_ids.shape[1]
        size = chunk or width
        logits: torch.Tensor | None = None
        for begin in range(0, width, size):
            end = min(width, begin + size)
            logits = self.forward(input_ids[:, begin:end], positions[:, begin:end], query_slots[begin:end],
                                  slot_is_token, cache, last_only=True)
        assert logits is not None, "prefill needs at least one token"
        return logits[:, -1]

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
               slot_is_token: torch.Tensor, cache: CacheT | None) -> torch.Tensor:
        """Each row's newest token(s) [B, T] (one, or a window recomputed without a cache) -> the next
        logits [B, V]."""
        return self.forward(input_ids, positions, query_slots, slot_is_token, cache, last_only=True)[:, -1]

