"""Kernels: how a group-quantized (N, K) weight is kept for multiplying, and multiplies (M, K) -> (M, N).

  int4pack     torch's group-wise int4 kernel (`_weight_int4pack_mm_for_cpu`, tinygemm on CUDA);
               codes 0..15, value = (code - 8) * scale + zero, scales and zeros in the activation dtype
  int4pair     int8 codes split into a high and a low nibble side by side, multiplied by the int4
               kernel as one matrix of twice the columns (see Int4PackKernel)
  dequantise   the weight is expanded to the activation dtype on every call, then `F.linear`
               (always available)
  native       lmcli's own C++ products (kernels/native_kernel.py, lmcli/native/csrc): int4 and int8
               codes as stored, float32 scales, float32 sums in an order fixed for any row count;
               bfloat16 activations; where the library builds and the CPU has AVX2 or AVX-512

Which one a model uses is decided in kernels/plan.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lmcli.io.group_quantized import GroupQuantized, unpack_nibbles, unpack_nibbles_numpy
from lmcli.kernels.base import GroupKernel, Kernel, _with_rows

# --- torch's packed int4 layout on the CPU ------------------------------------------------------------


@dataclass(frozen=True)
class PackLayout:
    """Where `_convert_weight_to_int4pack_for_cpu` puts each code: rows in blocks of `block` rows,
    each block stored (K, block) with the rows in the order `rows` (a nibble position -> row)."""

    block: int
    rows: tuple[int, ...]

    @functools.cached_property
    def position(self) -> torch.Tensor:  # row within a block -> its nibble position
        return torch.argsort(torch.tensor(self.rows))

    def fits(self, n: int) -> bool:
        return n % self.block == 0

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """(N, K) codes 0..15 -> (N, K/2) bytes in this layout: what torch's packing makes, in
        cheap byte operations (numpy) rather than through int32."""
        n, k = codes.shape
        c = codes.numpy().reshape(n // self.block, self.block, k)[:, list(self.rows)]  # (NB, pos, K)
        c = c.transpose(0, 2, 1)  # (NB, K, pos)
        packed = c[..., 0::2] | (c[..., 1::2] << 4)  # (NB, K, block/2), low nibble first
        return torch.from_numpy(np.ascontiguousarray(packed).reshape(n, k // 2))

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """(N, K/2) packed bytes -> (N, K) codes."""
        b = packed.view(n // self.block, k, self.block // 2)  # (NB, K, block/2)
        nibbles = torch.stack((b & 15, b >> 4), dim=-1).view(n // self.block, k, self.block)  # (NB, K, pos)
        return nibbles.transpose(1, 2)[:, self.position].reshape(n, k)  # (NB, row, K) -> (N, K)

    def unpack_rows(self, packed: torch.Tensor, n: int, k: int, rows: torch.Tensor) -> torch.Tensor:
        """Codes of the given rows only: (R,) -> (R, K)."""
        b = packed.view(n // self.block, k, self.block // 2)
        pos = self.position.to(rows.device)[rows % self.block]  # (R,)
        picked = b[(rows // self.block)[:, None], torch.arange(k, device=rows.device)[None, :], (pos // 2)[:, None]]
        return (picked >> ((pos % 2) * 4)[:, None]) & 15  # (R, K)


@functools.cache
def cpu_pack_layout() -> PackLayout | None:
    """Find the layout by packing probes, then check it on random codes; None if it is not one of blocks.

    Only the packing itself is torch's; the rest is numpy, whose kernels a load runs anyway: each torch
    kernel first run maps in its share of libtorch's code, which stays resident (this probe written
    with torch ops cost 9 MB of it)."""
    pack = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if pack is None:
        return None

    def packed(codes: np.ndarray) -> np.ndarray:  # (n, k) int32 codes -> torch's (n, k/2) bytes
        return pack(torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int32)), 1).numpy()

    n, k = 128, 32
    row = np.broadcast_to(np.arange(n, dtype=np.int32)[:, None], (n, k))
    try:
        low, high = packed(row % 16).reshape(-1), packed(row // 16).reshape(-1)
    except RuntimeError:
        return None
    # The row each nibble holds, in storage order (low nibble first).
    held = (np.stack((low & 15, low >> 4), -1) + 16 * np.stack((high & 15, high >> 4), -1)).reshape(-1)
    for block in (64, 32, 16):
        per_block = held.reshape(n // block, k, block)
        first = per_block[0, 0] % block
        expected = first[None, None] + block * np.arange(n // block)[:, None, None]
        if np.array_equal(per_block, np.broadcast_to(expected, per_block.shape)) and sorted(first.tolist()) == list(range(block)):
            layout = PackLayout(block, tuple(first.tolist()))
            # Irregular codes from a multiplicative hash (numpy.random costs a megabyte or two to import).
            codes = ((np.arange(3 * block * 96, dtype=np.int64) * 2654435761 >> 13) % 16).reshape(3 * block, 96)
            if np.array_equal(layout.pack(torch.from_numpy(codes.astype(np.uint8))).numpy(), packed(codes)):
                return layout
    return None


# --- kernels ---------------------------------------------------------------------------------------


class DequantiseKernel(GroupKernel):
    """Codes, scales and offsets as loaded (4-bit codes two to a byte); expanded on every call."""

    name = "dequantise"

    def __init__(self, q: GroupQuantized, dtype: torch.dtype):
        super().__init__(q, dtype)
        self._hold(q.codes.contiguous(),  # 4-bit: two codes a byte
                   q.scales.to(dtype), q.offsets.to(dtype) if q.offsets is not None else None)

    def _expand(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.bits == 4:
            codes = unpack_nibbles(codes)  # (R, K)
        rows = codes.shape[0]
        grouped = codes.to(dtype).view(rows, -1, self.group) * scales.to(dtype)[..., None]  # (R, G, group)
        if offsets is not None:
            grouped = grouped + offsets.to(dtype)[..., None]
        return grouped.view(rows, self.k)

    def dequantise(self) -> torch.Tensor:
        return self._expand(self.codes, self.scales, self.offsets)

    def rows(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        offsets = None if self.offsets is None else self.offsets[index]
        return self._expand(self.codes[index], self.scales[index], offsets, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantise())


def _scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, G) float32 scales and zeros -> torch's (G, N, 2) in `dtype`, written in place, so no float32
    copy of the whole (a stack, then a transpose) is ever made."""
    out = torch.empty(scales.shape[1], scales.shape[0], 2, dtype=dtype)
    out[..., 0] = scales.t()
    out[..., 1] = zeros.t()
    return out


def _int4_zeros(scales: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """torch's int4 kernel computes (code - 8) * scale + zero; for value = code * s + o, zero = 8 s + o."""
    return 8 * scales if offsets is None else offsets + 8 * scales


class Int4PackKernel(Kernel):
    """torch's group-wise int4 matrix product (CPU: `_weight_int4pack_mm_for_cpu`; CUDA: tinygemm).

    4-bit weights are packed as they are. 8-bit ones (`pair`) are stored as one nibble matrix with twice
    the columns, each code's high and low nibble side by side, (N, 2K), and multiplied by activations
    whose columns are doubled the same way, the first of each pair times 16. With u = code + 128 =
    16 hi + lo, a value s * code + o is then summed as 16 x ((hi - 8) s + z) + x ((lo - 8) s + z) with
    z = (8 s + o) / 17: both nibbles of a group share one scale and zero, so a group of `group` weights
    costs one (scale, zero) pair, as in the file, over 2 x group stored columns.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, q: GroupQuantized, dtype: torch.dtype, device: torch.device | str = "cpu"):
        n, k = q.shape
        super().__init__(n, k, dtype)
        self.pair = q.bits == 8
        self.name = "int4pair" if self.pair else "int4pack"
        self.group = 2 * q.group if self.pair else q.group  # over stored columns
        self.columns = 2 * k if self.pair else k  # stored columns
        self.on_cuda = torch.device(device).type == "cuda"
        zeros = _int4_zeros(q.scales, q.offsets)
        sz = _scales_and_zeros(q.scales, zeros / 17 if self.pair else zeros, dtype)
        self.layout = None if self.on_cuda else cpu_pack_layout()
        if self.layout is not None and not self.layout.fits(n):
            self.layout = None
        if self.layout is not None:  # packed a slab of rows at a time: the byte-per-code copy stays small
            packed = torch.empty(n, self.columns // 2, dtype=torch.uint8)
            slab = max(1, (1 << 20) // self.columns // self.layout.block) * self.layout.block  # about 1M codes
            for start in range(0, n, slab):
                rows = slice(start, min(start + slab, n))
                packed[rows] = self.layout.pack(self._codes(q, rows))
        elif self.on_cuda:  # tinygemm takes two codes per byte, the even one high
            codes = self._codes(q, slice(0, n)).to(device)
            packed = torch.ops.aten._convert_weight_to_int4pack((codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
        else:
            codes = self._codes(q, slice(0, n))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", sz.to(device), persistent=False)

    def _codes(self, q: GroupQuantized, rows: slice) -> torch.Tensor:
        """Codes 0..15, one a byte, of weight rows `rows`: (R, stored columns)."""
        if not self.pair:
            return unpack_nibbles_numpy(q.codes[rows])
        unsigned = q.codes[rows].view(torch.uint8) ^ 0x80  # (R, K) code + 128, 0..255
        return torch.stack((unsigned >> 4, unsigned & 15), dim=-1).view(unsigned.shape[0], self.columns)

    def _activations(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, stored columns): for pairs each column twice, the first times 16 (exact)."""
        return torch.stack((16 * x, x), dim=-1).view(x.shape[0], self.columns) if self.pair else x

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = self._activations(x)
        if self.on_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)  # (M, N)

    def _expand(self, codes: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Codes (R, stored columns) of rows `rows` -> values (R, K) in the activation dtype or `dtype`:
        (code - 8) * s + z per group, and for pairs 16 x high + low."""
        dtype = dtype or self.dtype
        sz = self.scales_and_zeros[:, rows].to(dtype)  # (G, R, 2)
        scales, zeros = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # (R, G, 1)
        r = rows.shape[0]  # not len(): a symbolic size stays symbolic when the step is exported
        grouped = codes.to(dtype).view(r, -1, self.group)
        values = ((grouped - 8) * scales + zeros).view(r, self.columns)
        if self.pair:
            nibbles = values.view(r, self.k, 2)
            values = 16 * nibbles[..., 0] + nibbles[..., 1]
        return values

    def rows(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        if self.layout is None:
            return None
        return self._expand(self.layout.unpack_rows(self.packed, self.n, self.columns, index), index, dtype)

    def dequantise(self) -> torch.Tensor | None:
        if self.layout is None:
            return None
        stored = torch.arange(self.n, device=self.packed.device)
        return self._expand(self.layout.unpack(self.packed, self.n, self.columns), stored)


def build_kernel(name: str, q: GroupQuantized, dtype: torch.dtype, device: torch.device | str = "cpu") -> Kernel:
    """`name`'s kernel for `q`; "native" falls back to torch's int4 kernel where it cannot hold `q`
    (a float32 model, a group size it does not take, no library)."""
    if name == "dequantise":
        return DequantiseKernel(q.to(device), dtype)
    if name == "native":
        from lmcli import native
        from lmcli.kernels.native_kernel import NativeKernel, supports

        if torch.device(device).type == "cpu" and supports(q, dtype) and native.library() is not None:
            return NativeKernel(q, dtype)
    return Int4PackKernel(q, dtype, device)


# --- joined kernels: one matrix call where a layer had several ----------------------------------


def concat_kernels(kernels: Sequence[Kernel]) -> Kernel | None:
    """One kernel whose rows are those of `kernels`, one after another: (N1 + N2 + ..., K). None where
    they cannot be joined: different stored forms, dtypes, groups or K; torch's packing done by torch
    itself (CUDA's tinygemm layout, or a CPU layout lmcli could not read), whose rows are not known
    to be block-local."""
    parts: list[Any] = list(kernels)  # one kind, checked first
    first = parts[0]
    if any(type(k) is not type(first) or k.name != first.name or k.k != first.k or k.dtype != first.dtype
           for k in parts):
        return None
    n = sum(k.n for k in parts)
    if type(first) is Int4PackKernel:
        if any(k.on_cuda or k.layout is None or k.layout != first.layout or k.group != first.group for k in parts):
            return None
        # The CPU layout keeps each block of `layout.block` rows to itself, and a kernel with a layout
        # holds whole blocks, so row blocks concatenate (int4pair's two nibbles of a weight share a row).
        packed = torch.cat([k.packed for k in parts])  # (N, stored columns / 2)
        scales_and_zeros = torch.cat([k.scales_and_zeros for k in parts], dim=1)  # (G, N, 2)
        return _with_rows(first, n, packed=packed, scales_and_zeros=scales_and_zeros)
    if first.name == "native":
        from lmcli.kernels.native_kernel import concat

        return concat(parts)
    if type(first) is DequantiseKernel:
        if any(k.bits != first.bits or k.group != first.group for k in parts):
            return None
        offsets = None
        if any(k.offsets is not None for k in parts):  # a missing offset is 0
            offsets = torch.cat([torch.zeros_like(k.scales) if k.offsets is None else k.offsets for k in parts])
        return _with_rows(first, n, codes=torch.cat([k.codes for k in parts]),
                          scales=torch.cat([k.scales for k in parts]), offsets=offsets)
    return None
