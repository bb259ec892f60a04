"""Numerics: what a load chose for a model's arithmetic, in one frozen record.

A load measures and decides three things that change the numbers a forward pass gives, not what the
model is: the kernel plan of each quantized weight format (kernels/plan.py), whether attention
and the kernels are batch-invariant (a row's numbers the same at any row count, models/row_attention.py),
and the activation dtype of quantized weights (their matrix products, attention and cache; the residual
stream stays in the float parameters' dtype). The loader builds one `Numerics` and hands it to the model
once (`install_numerics`); the decoding step (lmcli.generation.step) reads it and passes it to every
forward call, and the schedulers above ask it (not the model) whether rows may share a batch exactly.
Nothing switches it afterwards: a model holds no other runtime setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch


@dataclass(frozen=True)
class Numerics:
    """A load's choices (see the module docstring); the default is a float model's: plain kernels,
    attention over the padded batch, activations in the parameters' dtype."""

    kernel_choices: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # format -> KernelChoice
    batch_invariant: bool = False  # attention per row and query, kernels that ignore the row count
    activation_dtype: torch.dtype | None = None  # None: the residual (float parameters') dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_choices", MappingProxyType(dict(self.kernel_choices)))


class HasNumerics:
    """A model's view of its `numerics`: read-only names for the record's fields, so a model carries no
    switch of its own (only the record a load installed)."""

    numerics: Numerics = Numerics()

    def install_numerics(self, numerics: Numerics) -> None:
        """Set by the loader, once, before the model is handed out."""
        self.numerics = numerics

    @property
    def batch_invariant(self) -> bool:
        return self.numerics.batch_invariant

    @property
    def kernel_choices(self) -> Mapping[str, Any]:
        return self.numerics.kernel_choices

    @property
    def activation_dtype(self) -> torch.dtype | None:
        return self.numerics.activation_dtype
