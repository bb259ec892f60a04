"""Quantized layers where the earlier tests did not look (found by the planted-bug audit, docs/testing.md):
the parameter count of a model whose quantized embedding is tied to its head (against transformers'
count), fusing a biased part with an unbiased one of another width (against the parts' own outputs side
by side), and the documented default activation dtype of quantized weights (bfloat16).
"""

from __future__ import annotations

import pytest
import torch
from tiny import save_reference
from torch import nn

import lmcli
from lmcli.kernels.linear import QuantLinear, fuse_linears

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    reference = save_reference("qwen2", directory)  # tie_word_embeddings=True
    assert reference.config.tie_word_embeddings
    return directory, reference


def test_a_tied_quantized_head_is_counted_once(tied):
    directory, reference = tied
    model, _ = lmcli.load(directory, quantize="int8")
    assert model.weight_formats().keys() - {"float32", "bfloat16"}  # something is stored quantized
    assert model.num_parameters() == reference.num_parameters()


def test_quantized_weights_run_with_bfloat16_activations_by_default(tied, monkeypatch):
    monkeypatch.delenv("LMCLI_FAST_KERNELS", raising=False)
    monkeypatch.delenv("LMCLI_KERNEL", raising=False)
    model, _ = lmcli.load(tied[0], quantize="int4")
    dtypes = {m.kernel.dtype for m in model.modules() if isinstance(m, QuantLinear)}
    assert dtypes == {torch.bfloat16}


@pytest.mark.parametrize("biased", [(True, False), (False, True), (True, False, True)])
def test_fused_parts_with_and_without_biases_equal_the_parts(biased):
    torch.manual_seed(0)
    widths = [24, 8, 16][: len(biased)]
    parts = [nn.Linear(32, width, bias=bias) for width, bias in zip(widths, biased)]
    x = torch.randn(3, 32)
    fused = fuse_linears(parts)
    assert fused is not None
    with torch.no_grad():
        torch.testing.assert_close(fused(x), torch.cat([part(x) for part in parts], dim=-1))
