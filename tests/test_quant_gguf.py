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

from lmcli.io.gguf_quant import DECODERS, decode_blocks  # noqa: E402
from lmcli.io.gguf_reader import NATIVE_BLOCKS  # noqa: E402

Q = gguf.GGMLQuantizationType
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANTS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of the float16 fields


def random_k_blocks(ggml_type, rows: int, cols: int, seed: int) -> np.ndarray:
    values, size = NATIVE_BLOCKS[int(ggml_type)]
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


# --- the real models, run from their quantized blocks ------------------------------------------------

from real_models import TEXT_PROMPTS, encoded_text_prompts, gemma_gguf, model_reference, smollm2_gguf  # noqa: E402,F401


# Gemma 3 (Q4_K_M) under `make test-full`: its block types are checked against gguf above, and the real Gemma
# against transformers in test_real_models.py.
@pytest.mark.parametrize("name", ["smollm2", pytest.param("gemma", marks=pytest.mark.full)])
def test_native_quantized_real_model_agrees_with_transformers_float32(name, request):
    """Teacher-forced on transformers' own float32 greedy continuations of the five real prompts: the
    quantized model's top-1 token agrees at most positions. (Measured: see the report / README.)"""
    pytest.importorskip("transformers")
    import lmcli
    from lmcli.kernels.linear import QuantEmbedding, QuantLinear

    path = request.getfixturevalue(f"{name}_gguf")
    model, _ = lmcli.load(path, device="cpu")
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.kernel is model.model.embed_tokens.kernel  # the tied matrix is stored once
    reference = model_reference(name, path)
    agree = total = 0
    with torch.no_grad():
        for ids, expected in zip(encoded_text_prompts(path), reference["greedy"]):
            tokens = torch.tensor([ids + expected])
            predicted = model(tokens)[0, len(ids) - 1:-1].argmax(-1)  # (len(expected),)
            agree += int((predicted == torch.tensor(expected)).sum())
            total += len(expected)
    print(f"{name}: native quantized top-1 agreement with float32 greedy: {agree}/{total} = {agree / total:.1%}")
    assert agree / total >= 0.8
