"""The head's logits near each row's top are float32 (linear.QuantHead): against F.linear in float64 on
the dequantised weights, where the bfloat16 kernel alone is off by its output's rounding; elsewhere they
are the kernel's own. Scales and offsets are bfloat16 numbers here, so the kernel's weights (it keeps
them in bfloat16) are exactly the dequantised ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels.linear import QuantHead, QuantLinear
from lmcli.kernels.matmul import build_kernel


@pytest.mark.parametrize(("name", "bits"), [("int4pack", 4), ("dequantise", 8)])
def test_head_logits_near_the_top_are_float32(name, bits):
    gen = torch.Generator().manual_seed(bits)
    weight = torch.randn(1024, 256, generator=gen) * 0.05
    weight[:64] = weight[0] + 0.001 * torch.randn(64, 256, generator=gen)  # near-ties: logits close together
    q = GroupQuantized.quantize(weight, bits)
    q = dataclasses.replace(q, scales=q.scales.bfloat16().float(),
                            offsets=None if q.offsets is None else q.offsets.bfloat16().float())
    kernel = build_kernel(name, q, torch.bfloat16)
    if kernel.rows(torch.zeros(1, dtype=torch.long)) is None:
        pytest.skip("no row lookup for this kernel on this torch build")  # a CPU layout lmcli cannot read
    x = (weight[0] * 200 + torch.randn(4, 256, generator=gen)).bfloat16().float()  # (M, K): bfloat16 numbers, so the
    # kernel's rounded input is x itself and only its output's rounding is left
    want = F.linear(x.double(), q.dequantise(torch.float32).double())  # (M, N)
    got, rough = QuantHead(kernel, None, None, torch.float32)(x), QuantLinear(kernel, None, None, torch.float32)(x)
    top = want.max(dim=-1, keepdim=True).values
    near = want >= top - QuantHead.TOP_MARGIN * top.abs() / 2  # surely within the head's margin
    assert near.sum() > 4  # several tokens per row, so the check means something
    assert got.dtype == torch.float32
    assert ((got.double() - want)[near].abs().max() / top.abs().max()) < 1e-6
    assert ((rough.double() - want)[near].abs().max() / top.abs().max()) > 1e-4  # the kernel alone rounds
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    far = want < top - 2 * QuantHead.TOP_MARGIN * top.abs()
    assert torch.equal(got[far], rough[far])  # the rest of the vocabulary: the kernel's own logits
