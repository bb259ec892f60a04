"""GGUF quantized blocks -> group-quantized integers, without re-quantising.

Every block type handled here stores, per group of 16 or 32 weights, small integer codes and a
float scale (and for some an offset), so each maps exactly onto `GroupQuantized`:
value = code * scale + offset, with codes 0..15 (4-bit) or int8 (5 to 8 bits).

  Q4_0  d, 32 x 4-bit q:          w = d * (q - 8)                 -> 4-bit, scale d,      offset -8d
  Q4_1  d, m, 32 x 4-bit q:       w = d * q + m                   -> 4-bit, scale d,      offset m
  Q4_K  256 = 8 sub-blocks of 32, 6-bit sub-scales sc and mins mn:
                                  w = d * sc * q - dmin * mn      -> 4-bit, scale d*sc,   offset -dmin*mn
  Q8_0  d, 32 x int8 q:           w = d * q                       -> int8,  scale d
  Q5_0  d, 32 x 5-bit q:          w = d * (q - 16)                -> int8 (q - 16), scale d
  Q5_1  d, m, 32 x 5-bit q:       w = d * q + m                   -> int8 (q - 16), scale d, offset m + 16d
  Q5_K  as Q4_K with 5-bit q                                      -> int8 (q - 16), scale d*sc, offset -dmin*mn + 16 d sc
  Q6_K  256 = 16 sub-blocks of 16, int8 sub-scales sc, 6-bit q:
                                  w = d * sc * (q - 32)           -> int8 (q - 32), group 16, scale d*sc

Scales and offsets are computed in float32 from the file's float16 values (exact for the products
above up to float32 rounding). The byte layouts are ggml's (ggml-quants.c), read with numpy straight
from the mapped file: one tensor's codes (a byte per weight) exist at a time, never a float copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lmcli.io.gguf_reader import NATIVE_BLOCKS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from lmcli.io.group_quantized import GroupQuantized


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block, as float32. (rows, nb, bytes) -> (rows, nb)."""
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-value nibble order: low nibbles are values 0..15, high nibbles 16..31. (..., 16) -> (..., 32)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of the little-endian bytes `qh` for j < count, as 0/1. (..., count // 8) -> (..., count)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d = _f16(b, 0)
    return _nibbles(b[..., 2:18]), d, -8.0 * d


def _q4_1(b: np.ndarray):
    return _nibbles(b[..., 4:20]), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray):
    return b[..., 2:34].view(np.int8), _f16(b, 0), None


def _q5_codes(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    return (_nibbles(qs) | (_high_bits(qh, 32) << 4)).astype(np.int8) - 16  # (..., 32) in -16..15


def _q5_0(b: np.ndarray):
    return _q5_codes(b[..., 6:22], b[..., 2:6]), _f16(b, 0), None


def _q5_1(b: np.ndarray):
    d, m = _f16(b, 0), _f16(b, 2)
    return _q5_codes(b[..., 8:24], b[..., 4:8]), d, m + 16.0 * d


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit sub-block scales and mins packed into 12 bytes (Q4_K, Q5_K). (..., 12) -> 2 x (..., 8)."""
    s = scales.astype(np.uint8)
    low_sc, low_mn, high = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([low_sc & 63, (high & 0x0F) | ((low_sc >> 6) << 4)], axis=-1)
    mn = np.concatenate([low_mn & 63, (high >> 4) | ((low_mn >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b: np.ndarray):
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]  # (rows, nb, 1)
    sc, mn = _k_scales_mins(b[..., 4:16])  # (rows, nb, 8)
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 64 values: sub-block 2j low, 2j+1 high
    codes = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # (rows, nb, 4, 2, 32)
    return codes.reshape(*b.shape[:-1], 256), d * sc, -dmin * mn


def _q5_k(b: np.ndarray):
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, mn = _k_scales_mins(b[..., 4:16])
    qh = _high_bits(b[..., 16:48].reshape(*b.shape[:-1], 32, 1), 8)  # (rows, nb, 32 values, 8 sub-blocks)
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)  # (rows, nb, sub-block, value)
    codes = low | (np.swapaxes(qh, -1, -2) << 4)
    scale = d * sc
    return codes.astype(np.int8).reshape(*b.shape[:-1], 256) - 16, scale, 16.0 * scale - dmin * mn


def _q6_k(b: np.ndarray):
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 2, 32)  # (half, ql[l] or ql[l+32], l)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)  # (half, 1, l)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # (rows, nb, 16)
    d = _f16(b, 208)[..., None]
    # Within a half of 128: values l, l+32, l+64, l+96 take ql[l] low, ql[l+32] low, ql[l] high,
    # ql[l+32] high, and qh[l]'s bit pairs 0, 2, 4, 6.
    low = np.stack([ql & 0x0F, ql >> 4], axis=-3)  # (half, nibble, which ql, l) -> order l, l+32, l+64, l+96
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(2, 2, 1)
    high = (qh[..., None, :, :] >> shifts) & 3  # (half, 2, 2, l)
    codes = (low | (high << 4)).reshape(*lead, 256).astype(np.int8) - 32
    return codes, d * sc, None


# type id -> (bits of the codes, group size, decoder of (rows, nb, type_size) blocks)
_Decoder = Callable[[np.ndarray], tuple[Any, Any, Any]]
DECODERS: dict[int, tuple[int, int, _Decoder]] = {
    Q4_0: (4, 32, _q4_0), Q4_1: (4, 32, _q4_1), Q4_K: (4, 32, _q4_k),
    Q8_0: (8, 32, _q8_0), Q5_0: (8, 32, _q5_0), Q5_1: (8, 32, _q5_1), Q5_K: (8, 32, _q5_k), Q6_K: (8, 16, _q6_k),
}

def quantized_kind(ggml_type: int) -> str | None:
    """"int4" or "int8": the form a block type is kept in; None for the types that are dequantised."""
    return f"int{DECODERS[ggml_type][0]}" if ggml_type in DECODERS else None


def decode_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> GroupQuantized:
    """Raw block bytes of a tensor (any leading shape, row length last) -> GroupQuantized of `shape`.

    `raw` may be a read-only view of the mapped file; nothing it returns refers to it. Rows are decoded
    a slab at a time into the result, so the decoders' temporaries (several bytes a weight) stay small
    even for a 168M-weight embedding.
    """
    bits, group, decode = DECODERS[ggml_type]
    block_values, block_bytes = NATIVE_BLOCKS[ggml_type]
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    row_length = shape[-1]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, row_length // block_values, block_bytes)
    groups = row_length // group
    codes = np.empty((rows, row_length // 2 if bits == 4 else row_length), dtype=np.uint8 if bits == 4 else np.int8)
    scales = np.empty((rows, groups), dtype=np.float32)
    offsets: np.ndarray | None = None
    slab = max(1, (1 << 20) // row_length)  # about 1M weights
    for start in range(0, rows, slab):
        part = slice(start, min(start + slab, rows))
        slab_codes, slab_scales, slab_offsets = decode(blocks[part])
        slab_codes = slab_codes.reshape(-1, row_length)
        if bits == 4:  # two codes a byte, as GroupQuantized keeps them
            codes[part] = slab_codes[:, 0::2].astype(np.uint8) | (slab_codes[:, 1::2].astype(np.uint8) << 4)
        else:
            codes[part] = slab_codes
        scales[part] = np.reshape(slab_scales, (-1, groups))
        if slab_offsets is not None:
            if offsets is None:
                offsets = np.empty((rows, groups), dtype=np.float32)
            offsets[part] = np.reshape(slab_offsets, (-1, groups))
    lead = shape[:-1]
    return GroupQuantized(torch.from_numpy(codes).reshape(*lead, codes.shape[-1]),
                          torch.from_numpy(scales).reshape(*lead, groups),
                          None if offsets is None else torch.from_numpy(offsets).reshape(*lead, groups),
                          group=group, bits=bits)
