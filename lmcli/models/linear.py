"""How a weight is stored and multiplied: float, or group-quantized (int4 / int8) and kept that way.

The architectures build plain `nn.Linear` / `nn.Embedding` modules; at load, `install_quantized`
swaps the ones whose checkpoint tensor is a `GroupQuantized` for `QuantLinear` / `QuantEmbedding`.
Which kernel multiplies a quantized weight is chosen by measuring the candidates on this machine
once (`kernel_plan`, cached on disk per CPU, torch version and thread count):

  int4pack     torch's group-wise int4 kernel (`_weight_int4pack_mm_for_cpu`, tinygemm on CUDA);
               codes 0..15, value = (code - 8) * scale + zero, scales and zeros in the activation dtype
  int4pair     int8 codes split into a high and a low nibble side by side, multiplied by the int4
               kernel as one matrix of twice the columns (see Int4PackKernel)
  dequantise   the weight is expanded to the activation dtype on every call, then `F.linear`
               (always available; also the path for many rows at once when it measures faster)

A candidate that is missing on this build or gives a wrong result on a probe is not used.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmcli.config import dtype_name as _dtype_name
from lmcli.errors import first_line

GROUP = 32  # values per scale when lmcli quantizes a float weight itself


# --- the stored form ---------------------------------------------------------------------------------


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (..., K) -> (..., K/2) bytes, code 2j in the low nibble and 2j+1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) bytes -> (..., K) codes 0..15."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _unpack_nibbles_numpy(packed: torch.Tensor) -> torch.Tensor:
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
            codes = np.random.default_rng(0).integers(0, 16, (3 * block, 96), dtype=np.int32)
            if np.array_equal(layout.pack(torch.from_numpy(codes.astype(np.uint8))).numpy(), packed(codes)):
                return layout
    return None


# --- kernels ---------------------------------------------------------------------------------------


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

    def rows(self, index: torch.Tensor) -> torch.Tensor | None:
        """Rows `index` (R,) -> (R, K) in the activation dtype (an embedding lookup), or None."""
        return None


class DequantiseKernel(Kernel):
    """Codes, scales and offsets as loaded (4-bit codes two to a byte); expanded on every call."""

    name = "dequantise"
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    def __init__(self, q: GroupQuantized, dtype: torch.dtype):
        n, k = q.shape
        super().__init__(n, k, dtype)
        self.bits, self.group = q.bits, q.group
        self.register_buffer("codes", q.codes.contiguous(), persistent=False)  # 4-bit: two codes a byte
        self.register_buffer("scales", q.scales.to(dtype), persistent=False)
        offsets = q.offsets.to(dtype) if q.offsets is not None else None
        self.register_buffer("offsets", offsets, persistent=False)

    def _expand(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
        if self.bits == 4:
            codes = unpack_nibbles(codes)  # (R, K)
        rows = codes.shape[0]
        grouped = codes.to(self.dtype).view(rows, -1, self.group) * scales[..., None]  # (R, G, group)
        if offsets is not None:
            grouped = grouped + offsets[..., None]
        return grouped.view(rows, self.k)

    def dequantise(self) -> torch.Tensor:
        return self._expand(self.codes, self.scales, self.offsets)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        offsets = None if self.offsets is None else self.offsets[index]
        return self._expand(self.codes[index], self.scales[index], offsets)

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
            return _unpack_nibbles_numpy(q.codes[rows])
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

    def _expand(self, codes: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Codes (R, stored columns) of rows `rows` -> values (R, K): (code - 8) * s + z per group, and
        for pairs 16 x high + low."""
        sz = self.scales_and_zeros[:, rows]  # (G, R, 2)
        scales, zeros = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # (R, G, 1)
        grouped = codes.to(self.dtype).view(len(rows), -1, self.group)
        values = ((grouped - 8) * scales + zeros).view(len(rows), self.columns)
        if self.pair:
            nibbles = values.view(len(rows), self.k, 2)
            values = 16 * nibbles[..., 0] + nibbles[..., 1]
        return values

    def rows(self, index: torch.Tensor) -> torch.Tensor | None:
        if self.layout is None:
            return None
        return self._expand(self.layout.unpack_rows(self.packed, self.n, self.columns, index), index)

    def dequantise(self) -> torch.Tensor | None:
        if self.layout is None:
            return None
        stored = torch.arange(self.n, device=self.packed.device)
        return self._expand(self.layout.unpack(self.packed, self.n, self.columns), stored)


KERNELS = {"int4pack": Int4PackKernel, "int4pair": Int4PackKernel, "dequantise": DequantiseKernel}


def build_kernel(name: str, q: GroupQuantized, dtype: torch.dtype, device: torch.device | str = "cpu") -> Kernel:
    if name == "dequantise":
        return DequantiseKernel(q.to(device), dtype)
    return Int4PackKernel(q, dtype, device)


# --- modules ---------------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """nn.Linear over a quantized weight: `kernel` for few rows, dequantise + F.linear from `large_rows` on."""

    def __init__(self, kernel: Kernel, bias: torch.Tensor | None, large_rows: int | None):
        super().__init__()
        self.kernel, self.large_rows = kernel, large_rows
        self.in_features, self.out_features = kernel.k, kernel.n
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        weight = self.kernel.dequantise() if self.large_rows is not None and flat.shape[0] >= self.large_rows else None
        y = F.linear(flat, weight) if weight is not None else self.kernel.matmul(flat)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel.name}"


class QuantEmbedding(nn.Module):
    """nn.Embedding over a quantized matrix: gather the rows, dequantise only those."""

    def __init__(self, kernel: Kernel, large_rows: int | None = None):
        super().__init__()
        self.kernel, self.large_rows = kernel, large_rows  # large_rows: for a head tied to this matrix
        self.num_embeddings, self.embedding_dim = kernel.n, kernel.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.kernel.rows(ids.reshape(-1))
        assert rows is not None, "an embedding kernel must support row lookup"
        return rows.view(*ids.shape, self.embedding_dim)


# --- choosing kernels by measurement ----------------------------------------------------------------


@dataclass
class KernelChoice:
    kind: str  # weight format: int4 or int8
    dtype: str  # activation dtype
    kernel: str  # for few rows (decode)
    large_rows: int | None  # from this many rows on: dequantise the layer, then F.linear
    why: str
    seconds: dict[str, float]  # measured: "<kernel>@<rows>" -> seconds per call

    def describe(self) -> str:
        large = f", dequantise + F.linear from {self.large_rows} rows" if self.large_rows else ""
        return f"{self.kind} ({self.dtype}): {self.kernel}{large} — {self.why}"


PLAN_FORMAT = 3  # 3: measured in a child process (plans measured in-process under load were unreliable)
_PROBE_SHAPE = (1024, 1024)  # (N, K): 1M weights, big enough to time, small enough to do at load
_ROW_COUNTS = (1, 16, 64)


def _machine_key(device: torch.device) -> str:
    from lmcli.machine import cpu_model_and_flags

    cpu = cpu_model_and_flags()[0] or platform.processor() or platform.machine()
    if device.type == "cuda":
        cpu = torch.cuda.get_device_name(device)
    return (f"v{PLAN_FORMAT}|{device.type}|{cpu}|{torch.backends.cpu.get_cpu_capability()}|torch {torch.__version__}"
            f"|{torch.get_num_threads()} threads")


def _plan_file() -> Path:
    from lmcli.paths import cache_dir

    return cache_dir() / "kernels.json"


def _time_interleaved(calls: dict[str, Any], rounds: int = 5, round_seconds: float = 0.004) -> dict[str, float]:
    """Best seconds per call of each function, timed in turns so that load from other processes
    falls on all of them alike; the minimum over rounds resists that noise."""
    repeats = {}
    for name, fn in calls.items():
        fn()
        start = time.perf_counter()
        fn()
        repeats[name] = max(1, min(50, int(round_seconds / max(time.perf_counter() - start, 1e-6))))
    best = dict.fromkeys(calls, float("inf"))
    spent = dict.fromkeys(calls, 0.0)
    for _ in range(rounds):
        for name, fn in calls.items():
            if spent[name] > 0.2:  # a slow candidate is slow enough to tell after a round or two
                continue
            start = time.perf_counter()
            for _ in range(repeats[name]):
                fn()
            took = time.perf_counter() - start
            spent[name] += took
            best[name] = min(best[name], took / repeats[name])
    return best


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}.get(dtype, 2e-2)


def _candidates(kind: str, device: torch.device) -> list[str]:
    has_int4 = hasattr(torch.ops.aten, "_weight_int4pack_mm" if device.type == "cuda" else "_weight_int4pack_mm_for_cpu")
    return (["int4pack" if kind == "int4" else "int4pair"] if has_int4 else []) + ["dequantise"]


MEASURED_DTYPES = (torch.bfloat16, torch.float32)  # compared against each other in one run


@torch.inference_mode()
def measure(kind: str, device: torch.device, dtypes=MEASURED_DTYPES) -> dict[str, KernelChoice]:
    """Time each candidate kernel for `kind` weights with each activation dtype, all in one interleaved
    run (so the dtypes are compared under the same load); drop any candidate that fails or is wrong.
    Returns a choice per dtype name."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(_PROBE_SHAPE, generator=gen) * 0.05
    q = GroupQuantized.quantize(weight, 4 if kind == "int4" else 8)
    reference_weight = q.dequantise(torch.float32)
    rejected: dict[tuple, str] = {}
    kernels: dict[tuple, Kernel] = {}  # (dtype, kernel name) -> kernel
    for dtype in dtypes:
        for name in _candidates(kind, device):
            try:
                kernel = build_kernel(name, q, dtype, device)
                x = torch.randn(4, _PROBE_SHAPE[1], generator=gen)
                got = kernel.matmul(x.to(device, dtype)).float().cpu()
                want = F.linear(x, reference_weight)
                error = ((got - want).abs().max() / want.abs().max()).item()
                if not error <= _tolerance(dtype):
                    rejected[dtype, name] = f"off by {error:.1e}"
                    continue
            except (RuntimeError, NotImplementedError, AttributeError) as exc:
                rejected[dtype, name] = first_line(exc)[:80]
                continue
            kernels[dtype, name] = kernel
    inputs = {(dtype, rows): torch.randn(rows, _PROBE_SHAPE[1], generator=gen).to(device, dtype)
              for dtype in dtypes for rows in _ROW_COUNTS}
    calls = {}
    for (dtype, name), kernel in kernels.items():
        for rows in _ROW_COUNTS:
            x = inputs[dtype, rows]
            calls[f"{_dtype_name(dtype)}:{name}@{rows}"] = lambda k=kernel, x=x: k.matmul(x)
            if rows > 1 and name != "dequantise" and kernel.dequantise() is not None:
                calls[f"{_dtype_name(dtype)}:{name}+expand@{rows}"] = lambda k=kernel, x=x: F.linear(x, k.dequantise())
    seconds = _time_interleaved(calls)
    fastest_decode = min((seconds[f"{_dtype_name(d)}:{n}@1"], _dtype_name(d)) for d, n in kernels)
    choices = {}
    for dtype in dtypes:
        label = _dtype_name(dtype)
        mine = {key.split(":", 1)[1]: value for key, value in seconds.items() if key.startswith(f"{label}:")}
        names = [name for d, name in kernels if d == dtype]
        if not names:
            continue
        best = min(names, key=lambda name: mine[f"{name}@1"])
        others = [f"{name} {mine[f'{best}@1'] / mine[f'{name}@1']:.2f}x" for name in names if name != best]
        why = f"fastest at 1 row ({', '.join(others) or 'only candidate'} its speed)"
        if label != fastest_decode[1]:
            why += f"; {fastest_decode[1]} activations decode {mine[f'{best}@1'] / fastest_decode[0]:.1f}x faster"
        gone = [f"{name} ({reason})" for (d, name), reason in rejected.items() if d == dtype]
        if gone:
            why += "; not used: " + ", ".join(gone)
        large_rows = None
        for rows in _ROW_COUNTS[1:]:
            if mine.get(f"{best}+expand@{rows}", float("inf")) < mine[f"{best}@{rows}"]:
                large_rows = rows
                why += f"; from {rows} rows dequantise + F.linear is faster"
                break
        choices[label] = KernelChoice(kind, label, best, large_rows, why, mine)
    return choices


def kernel_plan(kind: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> KernelChoice:
    """The measured choice for `kind` weights and `dtype` activations on this machine (cached on disk).

    LMCLI_KERNEL=<name> forces a kernel (for tests and comparisons); LMCLI_REMEASURE=1 measures again.
    """
    device = torch.device(device)
    forced = os.environ.get("LMCLI_KERNEL")
    if forced:
        if forced not in ("int4pack", "int4pair", "dequantise"):
            from lmcli.errors import UsageError

            raise UsageError(f"LMCLI_KERNEL={forced}: unknown kernel (use int4pack, int4pair or dequantise)")
        if forced != "dequantise":
            forced = "int4pack" if kind == "int4" else "int4pair"
        return KernelChoice(kind, _dtype_name(dtype), forced, None, "forced by LMCLI_KERNEL", {})
    dtypes = MEASURED_DTYPES if dtype in MEASURED_DTYPES else (dtype,)
    return _cached_plans(kind, dtypes, device)[_dtype_name(dtype)]


@functools.cache
def _cached_plans(kind: str, dtypes: tuple[torch.dtype, ...], device: torch.device) -> dict[str, KernelChoice]:
    path, machine = _plan_file(), _machine_key(device)
    entry = f"{kind}|{','.join(map(_dtype_name, dtypes))}"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    if not isinstance(stored, dict):
        stored = {}
    known = stored.get(machine, {}).get(entry)
    if isinstance(known, dict) and not os.environ.get("LMCLI_REMEASURE") and not _worth_measuring_again(known):
        try:
            return {label: KernelChoice(**fields) for label, fields in known.items() if label != _LOAD_KEY}
        except TypeError:
            pass
    choices = (_measure_apart(kind, dtypes) if device.type == "cpu" else None) or measure(kind, device, dtypes)
    stored.setdefault(machine, {})[entry] = {**{label: asdict(choice) for label, choice in choices.items()},
                                             _LOAD_KEY: _load_average()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        from lmcli.io.atomic import write_atomically

        write_atomically(path, json.dumps(stored, indent=1) + "\n")
    except OSError:
        pass  # a read-only cache only means measuring again next time
    return choices


_LOAD_KEY = "load_average"  # of the machine when a plan was measured


def _load_average() -> float:
    """Runnable processes per CPU over the last minute (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def _worth_measuring_again(known: dict[str, Any]) -> bool:
    """A plan measured while other work crowded the CPUs (more runnable processes than CPUs) is
    measured again once the machine is quiet: timings under contention can rank kernels wrongly, as a
    plan measured at a load of about 5 per CPU here once picked float32 activations for int8 weights,
    25x slower than bfloat16."""
    then = known.get(_LOAD_KEY, 0.0)
    return isinstance(then, (int, float)) and then > 1.0 and _load_average() < 0.5


def _measure_apart(kind: str, dtypes: tuple[torch.dtype, ...]) -> dict[str, KernelChoice] | None:
    """`measure` in a child process with this one's thread count; None if that fails (the caller then
    measures here). Its probe matrices and timing loops peak at about 80 MB, which a loading
    process would otherwise keep as resident memory it never uses again."""
    import subprocess
    import sys

    import lmcli

    code = "from lmcli.models.linear import _measure_for_parent; _measure_for_parent()"
    package_root = str(Path(lmcli.__file__).resolve().parents[1])  # the same lmcli as this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    args = [sys.executable, "-c", code, kind, str(torch.get_num_threads()), *map(str, _PROBE_SHAPE),
            *map(_dtype_name, dtypes)]
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
        fields = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None
        return {label: KernelChoice(**value) for label, value in fields.items()} if fields else None
    except (OSError, subprocess.SubprocessError, ValueError, TypeError, IndexError, AttributeError):
        return None


def _measure_for_parent() -> None:
    """The child's side of `_measure_apart`: arguments kind, threads, probe rows and columns, dtypes."""
    import sys

    global _PROBE_SHAPE
    kind, threads, rows, columns, *dtypes = sys.argv[1:]
    torch.set_num_threads(int(threads))
    _PROBE_SHAPE = (int(rows), int(columns))
    choices = measure(kind, torch.device("cpu"), tuple(getattr(torch, name) for name in dtypes))
    print(json.dumps({label: asdict(choice) for label, choice in choices.items()}))


def preferred_dtype(kind: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The activation dtype whose best kernel for `kind` weights is fastest at one row (decode)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    timings = {}
    for dtype in MEASURED_DTYPES:
        choice = kernel_plan(kind, dtype, device)
        timings[dtype] = choice.seconds.get(f"{choice.kernel}@1", float("inf"))
    if all(t == float("inf") for t in timings.values()):  # forced kernels: nothing measured
        return torch.bfloat16 if kind == "int4" else torch.float32
    return min(timings, key=lambda d: timings[d])


# --- installing into a model ------------------------------------------------------------------------


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    owner, _, leaf = path.rpartition(".")
    return (model.get_submodule(owner) if owner else model), leaf


class QuantizedInstaller:
    """Swaps the nn.Linear / nn.Embedding owning `<module>.weight` for its quantized counterpart, one
    weight at a time, so a loader can read, install and free each weight before the next.

    `choices` collects the kernel choice per weight format, for reports. A tied head (`lm_head` with
    no weight of its own) later shares the embedding's kernel (`tie_quantized_head`).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, source: str = "checkpoint"):
        self.model, self.dtype, self.device, self.source = model, dtype, device, source
        self.choices: dict[str, KernelChoice] = {}

    def install(self, name: str, q: GroupQuantized) -> None:
        from lmcli.errors import CheckpointError

        module_path = name.removesuffix(".weight")
        old = None
        if name.endswith(".weight"):
            with contextlib.suppress(AttributeError):
                old = self.model.get_submodule(module_path)
        if not isinstance(old, (nn.Linear, nn.Embedding)):
            raise CheckpointError(f"{self.source}: unexpected quantized tensor '{name}' {list(q.shape)} "
                                  "(not the weight of a linear or embedding layer of this model)")
        if tuple(q.shape) != tuple(old.weight.shape):
            raise CheckpointError(f"{self.source}: tensor '{name}' has shape {list(q.shape)} but the model "
                                  f"expects {list(old.weight.shape)}")
        choice = self.choices.get(q.kind) or kernel_plan(q.kind, self.dtype, self.device)
        self.choices[q.kind] = choice
        kernel_name = choice.kernel
        kernel_group = 2 * q.group if q.bits == 8 else q.group  # int4pair doubles the columns
        if kernel_group % 32 and kernel_name != "dequantise":  # torch's int4 kernel groups 32+ values
            kernel_name = "dequantise"
        try:
            kernel = build_kernel(kernel_name, q, self.dtype, self.device)
        except RuntimeError:  # a shape torch's packing refuses (rows not a multiple of its block, ...)
            kernel_name = "dequantise"
            kernel = build_kernel(kernel_name, q, self.dtype, self.device)
        large_rows = choice.large_rows if kernel_name == choice.kernel else None
        parent, leaf = _parent(self.model, module_path)
        if isinstance(old, nn.Embedding):
            if kernel.rows(torch.zeros(1, dtype=torch.long, device=self.device)) is None:
                kernel = build_kernel("dequantise", q, self.dtype, self.device)
            setattr(parent, leaf, QuantEmbedding(kernel, large_rows))
        else:
            bias = None if old.bias is None else torch.empty(old.out_features, dtype=self.dtype, device=self.device)
            setattr(parent, leaf, QuantLinear(kernel, bias, large_rows))  # the bias is filled by name later


def tie_quantized_head(model: nn.Module) -> bool:
    """If the embedding is quantized, make the head a QuantLinear over the same kernel. True if done."""
    embedding: Any = model.get_submodule("model.embed_tokens")
    if not isinstance(embedding, QuantEmbedding):
        return False
    model.lm_head = QuantLinear(embedding.kernel, None, embedding.large_rows)
    return True


def weight_formats(model: nn.Module) -> dict[str, int]:
    """How many weights of each stored form: {"int4pack": n, "float32": n, ...}."""
    counts: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)) and id(module.kernel) not in seen:
            seen.add(id(module.kernel))
            counts[module.kernel.name] = counts.get(module.kernel.name, 0) + module.kernel.n * module.kernel.k
    for parameter in {id(p): p for p in model.parameters()}.values():
        key = str(parameter.dtype).removeprefix("torch.")
        counts[key] = counts.get(key, 0) + parameter.numel()
    return counts


# --- fused projections: one matrix call where a layer had several -----------------------------------


def _with_rows(template: Kernel, n: int, **buffers: torch.Tensor | None) -> Kernel:
    """A kernel of `template`'s kind, dtype and layout holding `n` rows in `buffers`."""
    import copy

    joined = copy.copy(template)  # the stored form's settings (group, layout, pair, ...), as they are
    joined._buffers = dict(template._buffers)  # its own buffers, not the template's
    joined._parameters, joined._modules = dict(template._parameters), dict(template._modules)
    joined.n = n
    for name, tensor in buffers.items():
        setattr(joined, name, tensor)
    return joined


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
    if type(first) is DequantiseKernel:
        if any(k.bits != first.bits or k.group != first.group for k in parts):
            return None
        offsets = None
        if any(k.offsets is not None for k in parts):  # a missing offset is 0
            offsets = torch.cat([torch.zeros_like(k.scales) if k.offsets is None else k.offsets for k in parts])
        return _with_rows(first, n, codes=torch.cat([k.codes for k in parts]),
                          scales=torch.cat([k.scales for k in parts]), offsets=offsets)
    return None


def _joined_bias(parts: list[Any]) -> torch.Tensor | None:
    """The parts' biases side by side (a missing one is 0), or None if none has one."""
    present = next((p.bias for p in parts if p.bias is not None), None)
    if present is None:
        return None
    return torch.cat([torch.zeros(p.out_features, dtype=present.dtype, device=present.device) if p.bias is None
                      else p.bias.detach() for p in parts])


def fuse_linears(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One linear layer computing what `parts` (same input size) compute, their outputs side by side:
    the weights (and biases) joined by rows. nn.Linear parts give an nn.Linear, QuantLinear parts a
    QuantLinear over `concat_kernels`. None where they cannot be joined (mixed forms, dtypes, devices;
    quantized kernels that do not concatenate); the caller then keeps the parts."""
    modules: list[Any] = list(parts)
    if len({m.in_features for m in modules}) != 1:
        return None
    bias = _joined_bias(modules)
    if all(type(m) is nn.Linear for m in modules):
        weights = [m.weight for m in modules]
        if len({(w.dtype, w.device) for w in weights}) != 1:
            return None
        # nn.Linear's own __init__ would allocate and initialise a weight only to drop it.
        fused = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features = modules[0].in_features, sum(m.out_features for m in modules)
        requires_grad = weights[0].requires_grad
        fused.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=requires_grad)  # (N, K)
        fused.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=requires_grad))
        return fused
    if all(type(m) is QuantLinear for m in modules) and len({m.large_rows for m in modules}) == 1:
        kernel = concat_kernels([m.kernel for m in modules])
        return None if kernel is None else QuantLinear(kernel, bias, modules[0].large_rows)
    return None
