"""GGUF blocks kept quantized: each block type's codes, scales and offsets against gguf's own dequantisation.

Blocks come from gguf's quantizer where it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); the K-quants, which
it only dequantises, are random bytes with sane float16 scale fields, so every bit pattern of the
packed sub-scales and high bits is exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from lmcli.io.gguf_quant import BLOCK_BYTES, DECODERS, decode_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANTS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of the float16 fields


def random_k_blocks(ggml_type, rows: int, cols: int, seed: int) -> np.ndarray:
    values, size = BLOCK_BYTES[int(ggml_type)]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    for start in K_QUANTS[ggml_type]:
        scale = rng.uniform(-0.02, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[..., start:start + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def blocks_for(ggml_type, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    if ggml_type in K_QUANTS:
        return random_k_blocks(ggml_type, rows, cols, seed)
    weights = np.random.default_rng(seed).normal(0, 0.05, size=(rows, cols)).astype(np.float32)
    weights[0, :32] += 0.3  # an offset group: Q4_1/Q5_1 minimums far from zero
    return gguf.quants.quantize(weights, ggml_type)


@pytest.mark.parametrize("ggml_type", QUANTIZABLE + list(K_QUANTS), ids=lambda t: t.name)
def test_block_codes_equal_ggufs_dequantisation(ggml_type):
    rows, cols = 6, 512
    raw = blocks_for(ggml_type, rows, cols)
    want = gguf.quants.dequantize(raw, ggml_type)  # (rows, cols) float32
    q = decode_blocks(raw, int(ggml_type), (rows, cols))
    bits, group, _ = DECODERS[int(ggml_type)]
    assert q.bits == bits and q.group == group and q.shape == (rows, cols)
    codes = q.code_values()
    assert codes.shape == (rows, cols)
    if bits == 4:
        assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    else:
        assert codes.dtype == torch.int8
    # float32 arithmetic in both; only the order of the multiply-add differs
    torch.testing.assert_close(q.dequantise(), torch.from_numpy(want), rtol=1e-6, atol=1e-6)


def test_stacked_tensors_and_row_operations_keep_values():
    """(experts, out, in) blocks decode per expert; permuting rows of the codes permutes the values."""
    raw = blocks_for(Q.Q4_1, 3 * 8, 64).reshape(3, 8, -1)
    want = gguf.quants.dequantize(raw, Q.Q4_1)  # (3, 8, 64)
    q = decode_blocks(raw, int(Q.Q4_1), (3, 8, 64))
    experts = q.unbind(0)
    torch.testing.assert_close(experts[2].dequantise(), torch.from_numpy(want[2]))
    order = torch.randperm(8)
    torch.testing.assert_close(experts[1].map(lambda t: t[order]).dequantise(), torch.from_numpy(want[1])[order])
