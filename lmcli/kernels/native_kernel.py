"""The `native` kernel: lmcli's own C++ products for group-quantized weights (lmcli/native/csrc/qmm*.cpp).

One kernel covers every block kind lmcli loads: int4 codes (Q4_0, Q4_1, Q4_K) and int8 codes (Q8_0,
Q5_*, Q6_K), any group size that is a multiple of 4, with or without offsets. Weights are multiplied
as stored, w = code * scale + offset with float32 scales and offsets (torch's int4 kernel rounds them
to bfloat16), against bfloat16 activations; each output is summed in float32 in one fixed order that
does not depend on the number of rows, the threads or the instruction set (see csrc/qmm.h), and comes
out in float32.

Layout (what csrc/qmm.h reads): rows in blocks of 16, padded with zero rows; per block, 32-byte chunks
along K (int4: 4 columns, two codes a byte; int8: 2 columns); scales and offsets (blocks, groups, 16).
"""

from __future__ import annotations

import os

import torch

from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels.base import GroupKernel

BLOCK = 16  # output rows per block


def supports(q: GroupQuantized, dtype: torch.dtype) -> bool:
    """Whether this kernel can hold `q` multiplied in `dtype` (bfloat16 activations only: the
    kernel reads bfloat16, and a float32 model must not have its activations rounded)."""
    k = q.shape[-1]
    return (dtype == torch.bfloat16 and q.bits in (4, 8) and q.group % (4 if q.bits == 4 else 2) == 0
            and k % q.group == 0 and q.codes.device.type == "cpu" and len(q.shape) == 2)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


class NativeKernel(GroupKernel):
    """Codes, scales and offsets in the layout of csrc/qmm.h, multiplied by lmcli's C++ library."""

    name = "native"

    def __init__(self, q: GroupQuantized, dtype: torch.dtype):
        super().__init__(q, dtype)
        n, k = self.n, self.k
        blocks = -(-n // BLOCK)
        per_chunk = 4 if self.bits == 4 else 2  # columns in 32 bytes
        codes = torch.empty(blocks, k // per_chunk * 32, dtype=torch.uint8)  # (NB, bytes per block)
        slab = max(1, (1 << 20) // k // BLOCK)  # blocks at a time: about 1M codes of temporaries
        for b0 in range(0, blocks, slab):
            b1 = min(blocks, b0 + slab)
            rows = _pad_rows(q.codes[b0 * BLOCK:b1 * BLOCK], (b1 - b0) * BLOCK)
            codes[b0:b1] = self._pack(rows, b1 - b0)
        self._hold(codes, self._blocked(q.scales, blocks), None if q.offsets is None else self._blocked(q.offsets, blocks))

    def _pack(self, stored: torch.Tensor, blocks: int) -> torch.Tensor:
        """Stored codes of whole blocks (NB*16, K/2 or K) -> (NB, bytes per block) in csrc/qmm.h's layout."""
        k = self.k
        if self.bits == 4:
            from lmcli.io.group_quantized import unpack_nibbles_numpy

            c = unpack_nibbles_numpy(stored).view(blocks, BLOCK, k // 4, 2, 2)  # (NB, j, q, h, t): k = 4q + 2h + t
            c = c.permute(0, 2, 1, 4, 3)  # (NB, q, j, t, h)
            packed = c[..., 0] | (c[..., 1] << 4)  # (NB, q, j, t): byte 2j + t of chunk q
        else:
            packed = stored.view(torch.uint8).view(blocks, BLOCK, k // 2, 2).permute(0, 2, 1, 3)  # (NB, p, j, t)
        return packed.reshape(blocks, -1)

    def _blocked(self, t: torch.Tensor, blocks: int) -> torch.Tensor:
        """(N, G) -> (NB, G, 16) float32, zero for padding rows."""
        return _pad_rows(t.float(), blocks * BLOCK).view(blocks, BLOCK, -1).transpose(1, 2).contiguous()

    def _codes_of(self, index: torch.Tensor) -> torch.Tensor:
        """Codes of rows `index` (R,) -> (R, K) as float32."""
        block, j = index // BLOCK, index % BLOCK
        r = index.shape[0]
        if self.bits == 4:
            chunks = self.codes.view(-1, self.k // 4, BLOCK, 2)[block, :, j]  # (R, q, t)
            nibbles = torch.stack((chunks & 15, chunks >> 4), dim=2)  # (R, q, h, t)
            return nibbles.reshape(r, self.k).float()
        pairs = self.codes.view(-1, self.k // 2, BLOCK, 2)[block, :, j]  # (R, p, t)
        return pairs.reshape(r, self.k).view(torch.int8).float()

    def rows(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        block, j = index // BLOCK, index % BLOCK
        r = index.shape[0]
        values = self._codes_of(index).view(r, -1, self.group) * self.scales[block, :, j][..., None]  # (R, G, group)
        if self.offsets is not None:
            values = values + self.offsets[block, :, j][..., None]
        return values.view(r, self.k).to(dtype or self.dtype)

    def dequantise(self) -> torch.Tensor:
        return self.rows(torch.arange(self.n))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, N) float32."""
        qmm, isa = _entry()
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            x = x.to(torch.bfloat16).contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        buffers = self._buffers  # not nn.Module's attribute lookup: this runs about 120 times a step
        codes, scales, offsets = buffers["codes"], buffers["scales"], buffers["offsets"]
        assert codes is not None and scales is not None
        status = qmm(isa, x.data_ptr(), m, self.k, codes.data_ptr(), scales.data_ptr(),
                     None if offsets is None else offsets.data_ptr(), self.n, self.group, self.bits,
                     y.data_ptr(), self.n)
        if status != 0:
            raise RuntimeError(f"native kernel: status {status} for ({m}, {self.k}) x ({self.n}, {self.k})")
        return y


_entry_for: tuple[str | None, object, int] | None = None


def _entry() -> tuple:
    """The library's product function and the path to run (LMCLI_NATIVE_ISA, read at each call for
    tests); the library itself is looked up once: a decode step makes about 120 calls."""
    global _entry_for
    forced = os.environ.get("LMCLI_NATIVE_ISA")
    if _entry_for is None or _entry_for[0] != forced:
        from lmcli import native

        lib = native.library()
        if lib is None:
            raise RuntimeError(f"lmcli's native kernels are not available ({native.why_not()})")
        _entry_for = (forced, lib.qmm, lib.isa())
    return _entry_for[1], _entry_for[2]


def concat(parts: list[NativeKernel]) -> NativeKernel | None:
    """One kernel with the rows of `parts` one after another; None unless each holds whole blocks."""
    first = parts[0]
    if any(p.n % BLOCK or p.bits != first.bits or p.group != first.group for p in parts):
        return None
    from lmcli.kernels.base import _with_rows

    offsets = None
    if any(p.offsets is not None for p in parts):  # a missing offset is 0
        offsets = torch.cat([torch.zeros_like(p.scales) if p.offsets is None else p.offsets for p in parts])
    joined = _with_rows(first, sum(p.n for p in parts), codes=torch.cat([p.codes for p in parts]),
                        scales=torch.cat([p.scales for p in parts]), offsets=offsets)
    assert isinstance(joined, NativeKernel)
    return joined
