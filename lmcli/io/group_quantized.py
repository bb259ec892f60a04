"""How lmcli keeps a group-quantized weight: integer codes with a scale (and offset) per group.

The low, torch-only form that readers (io/gguf.py, io/gguf_quant.py) produce and kernels/matmul.py
turns into a kernel; it knows nothing of models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

GROUP = 32  # values per scale when lmcli quantizes a float weight itself


# --- the stored form ---------------------------------------------------------------------------------


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (..., K) -> (..., K/2) bytes, code 2j in the low nibble and 2j+1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) bytes -> (..., K) codes 0..15."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def unpack_nibbles_numpy(packed: torch.Tensor) -> torch.Tensor:
    """unpack_nibbles for a (N, K/2) CPU tensor, several times faster through numpy at load."""
    if packed.device.type != "cpu":
        return unpack_nibbles(packed)
    b = packed.numpy()
    codes = np.empty((*b.shape[:-1], 2 * b.shape[-1]), dtype=np.uint8)
    codes[..., 0::2], codes[..., 1::2] = b & 15, b >> 4
    return torch.from_numpy(codes)


@dataclass
class GroupQuantized:
    """A weight (..., N, K) as integer codes with one scale (and offset) per `group` values of a row.

    value = code * scale + offset. 4-bit codes (0..15) are kept two to a byte (`pack_nibbles`), so
    `codes` is (..., N, K/2) uint8; other widths are int8 (..., N, K). Row operations (permute,
    select, split) apply to codes, scales and offsets alike (`map`).
    """

    codes: torch.Tensor  # (..., N, K/2) uint8 when bits == 4, else (..., N, K) int8
    scales: torch.Tensor  # (..., N, K // group) float32
    offsets: torch.Tensor | None  # (..., N, K // group) float32, or None for 0
    group: int
    bits: int

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group: int,
                   bits: int) -> GroupQuantized:
        """From one code per value: uint8 0..15 for 4 bits, int8 otherwise."""
        return cls(pack_nibbles(codes) if bits == 4 else codes, scales, offsets, group, bits)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.scales.shape[:-1], self.scales.shape[-1] * self.group))

    @property
    def kind(self) -> str:
        return f"int{self.bits}"

    def code_values(self) -> torch.Tensor:
        """One code per value (..., N, K): uint8 0..15 for 4 bits, int8 otherwise."""
        return unpack_nibbles(self.codes) if self.bits == 4 else self.codes

    def map(self, fn) -> GroupQuantized:
        """Apply a row operation (permute, select, move) to codes, scales and offsets alike."""
        offsets = None if self.offsets is None else fn(self.offsets)
        return GroupQuantized(fn(self.codes), fn(self.scales), offsets, self.group, self.bits)

    def unbind(self, dim: int = 0) -> list[GroupQuantized]:
        return [self.map(lambda t, i=i: t.select(dim, i).clone()) for i in range(self.codes.shape[dim])]

    def chunk(self, chunks: int, dim: int = 0) -> list[GroupQuantized]:
        assert dim == 0, "only rows can be split: groups run along a row"
        size = self.codes.shape[0] // chunks
        return [self.map(lambda t, i=i: t[i * size:(i + 1) * size]) for i in range(chunks)]

    def to(self, *args: Any, device: torch.device | str | None = None, **_: Any) -> GroupQuantized:
        """Moves to `device`; a dtype is ignored (the activation dtype is chosen when a kernel is built)."""
        device = next((a for a in args if isinstance(a, (str, torch.device))), device)
        return self if device is None else self.map(lambda t: t.to(device))

    def clone(self) -> GroupQuantized:
        return self.map(torch.clone)

    def contiguous(self) -> GroupQuantized:
        return self.map(lambda t: t.contiguous())

    def t(self) -> torch.Tensor:
        """Transposed, groups would run down the columns, which no kernel takes: the float weight (K, N)."""
        return self.dequantise().t()

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight (..., N, K) in `dtype` (computed in float32)."""
        *lead, k = self.shape
        grouped = self.code_values().float().reshape(*lead, k // self.group, self.group)  # (..., N, G, group)
        values = grouped * self.scales[..., None]
        if self.offsets is not None:
            values = values + self.offsets[..., None]
        return values.reshape(*lead, k).to(dtype)

    @staticmethod
    def quantize(weight: torch.Tensor, bits: int, group: int = GROUP) -> GroupQuantized:
        """Round-to-nearest, group-wise: int4 asymmetric (min/max per group), int8 symmetric (absmax).

        Rows a slab at a time, so the float temporaries stay small: quantizing Gemma 3's 168M-weight
        embedding whole passed through several float32 copies of it (peak 2.9 GB for a 270M model)."""
        *lead, k = weight.shape
        rows = weight.reshape(-1, k)
        n, groups = rows.shape[0], k // group
        codes = torch.empty(n, k // 2 if bits == 4 else k, dtype=torch.uint8 if bits == 4 else torch.int8)
        scales = torch.empty(n, groups)
        offsets = torch.empty(n, groups) if bits == 4 else None
        slab = max(1, (1 << 20) // k)  # about 1M weights
        for start in range(0, n, slab):
            part = slice(start, min(start + slab, n))
            w = rows[part].float().reshape(-1, groups, group)  # (R, G, group)
            if offsets is not None:
                low, high = w.amin(-1), w.amax(-1)
                step = ((high - low) / 15).clamp(min=1e-12)
                nibbles = torch.round((w - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
                codes[part], scales[part], offsets[part] = pack_nibbles(nibbles.reshape(-1, k)), step, low
            else:
                step = (w.abs().amax(-1) / 127).clamp(min=1e-12)
                codes[part] = torch.round(w / step[..., None]).clamp(-127, 127).to(torch.int8).reshape(-1, k)
                scales[part] = step
        return GroupQuantized(codes.reshape(*lead, codes.shape[-1]), scales.reshape(*lead, groups),
                              None if offsets is None else offsets.reshape(*lead, groups), group, bits)
