"""What every kernel is: one stored form of a (N, K) weight and how it multiplies (M, K) -> (M, N).

Below kernels/matmul.py (which builds kernels by name) and kernels/native_kernel.py (lmcli's own), so
neither imports the other to share this.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lmcli.io.group_quantized import GroupQuantized


class Kernel(nn.Module):
    """One stored form of a (N, K) weight and how it multiplies activations (M, K) -> (M, N)."""

    name = "?"

    def __init__(self, n: int, k: int, dtype: torch.dtype):
        super().__init__()
        self.n, self.k, self.dtype = n, k, dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantise(self) -> torch.Tensor | None:
        """(N, K) in the activation dtype, or None if this form cannot be expanded cheaply."""
        return None

    def rows(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Rows `index` (R,) -> (R, K) in the activation dtype or `dtype` (an embedding lookup, or the
        head's float32 logits: linear.QuantHead), or None."""
        return None


class GroupKernel(Kernel):
    """A kernel that keeps a group-quantized weight's codes, scales and offsets (in a layout of its own)
    as buffers: the dequantising kernel and lmcli's native one."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    def __init__(self, q: GroupQuantized, dtype: torch.dtype):
        n, k = q.shape
        super().__init__(n, k, dtype)
        self.bits, self.group = q.bits, q.group

    def _hold(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> None:
        """Keep the stored form as buffers, which `.to()` moves and packed models map, but not in a state dict."""
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)


def _with_rows(template: Kernel, n: int, **buffers: torch.Tensor | None) -> Kernel:
    """A kernel of `template`'s kind, dtype and layout holding `n` rows in `buffers`."""
    joined = copy.copy(template)  # the stored form's settings (group, layout, pair, ...), as they are
    joined._buffers = dict(template._buffers)  # its own buffers, not the template's
    joined._parameters, joined._modules = dict(template._parameters), dict(template._modules)
    joined.n = n
    for name, tensor in buffers.items():
        setattr(joined, name, tensor)
    return joined
