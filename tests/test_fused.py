"""Fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj, joined at load): the fused model
against transformers and against the same checkpoint loaded unfused; a fused quantized kernel against
F.linear on the dequantised, concatenated weights of its parts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from tiny import CASES, prompts, random_reference, save_reference

import lmcli
from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels import matmul as kernels
from lmcli.kernels.linear import QuantLinear, fuse_linears
from lmcli.kernels.matmul import build_kernel, concat_kernels
from lmcli.models.base import BaseModel
from lmcli.models.layers import MLP, Attention

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the output's largest value


def _assert_fused(model: BaseModel) -> None:
    layer: Any
    for layer in model.model.layers:
        attention: Attention = layer.self_attn
        assert attention.qkv_proj is not None and not hasattr(attention, "q_proj")
        mlp = layer.feed_forward
        if isinstance(mlp, MLP) and model.config.gated_mlp:
            assert mlp.gate_up_proj is not None and mlp.gate_proj is None
        elif not isinstance(mlp, MLP):  # mixtral: the experts keep their own weights
            assert all(hasattr(expert, "w1") and hasattr(expert, "w3") for expert in mlp.experts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_logits_equal_unfused_and_transformers(case, tmp_path, monkeypatch):
    reference = save_reference(case, tmp_path)
    fused, _ = lmcli.load(tmp_path)
    _assert_fused(fused)
    monkeypatch.setattr(BaseModel, "fuse_projections", lambda self, after_each_layer=None: None)
    unfused, _ = lmcli.load(tmp_path)
    assert unfused.model.layers[0].self_attn.qkv_proj is None
    (ids,) = prompts([12])
    with torch.no_grad():
        want = reference(ids[None]).logits
    got = fused(ids[None])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(got, unfused(ids[None]), atol=1e-5, rtol=0)


def random_weight(n: int, k: int, bits: int, seed: int) -> GroupQuantized:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    offsets = torch.randn(n, k // 32, generator=gen) * 0.05
    return GroupQuantized.from_codes(codes, scales, offsets, group=32, bits=bits)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    error = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert error <= TOLERANCE[dtype], error


KERNEL_CASES = [(bits, name, dtype) for bits, names in ((4, ("int4pack", "dequantise")), (8, ("int4pair", "dequantise")))
                for name in names for dtype in TOLERANCE]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"int{c[0]}-{c[1]}-{str(c[2]).removeprefix('torch.')}")
def test_fused_quantized_linear_equals_f_linear_on_the_concatenated_weights(case):
    bits, name, dtype = case
    layout = kernels.cpu_pack_layout()
    if name != "dequantise" and layout is None:
        pytest.skip("torch's CPU int4 packing has no block layout here: its kernels are never fused")
    block = layout.block if layout is not None else 64
    sizes, k = [2 * block, block, block], 128  # q, k, v-like: whole blocks of rows
    parts = [random_weight(n, k, bits, seed) for seed, n in enumerate(sizes)]
    biases: list[torch.Tensor | None] = [torch.randn(n) * 0.1 for n in sizes]
    biases[1] = None  # a missing bias counts as 0
    modules = [QuantLinear(build_kernel(name, q, dtype), None if b is None else b.to(dtype), None)
               for q, b in zip(parts, biases)]
    fused = fuse_linears(modules)
    assert isinstance(fused, QuantLinear) and fused.kernel.name == modules[0].kernel.name
    weight = torch.cat([q.dequantise(torch.float32) for q in parts])  # (sum N, K): independent of any kernel
    bias = torch.cat([torch.zeros(n) if b is None else b.to(dtype).float() for n, b in zip(sizes, biases)])
    for rows in (1, 5):
        x = torch.randn(rows, k)
        close(fused(x.to(dtype)), F.linear(x, weight, bias), dtype)
    expanded = fused.kernel.dequantise()  # the many-rows path expands the fused weight
    assert expanded is not None
    close(expanded, weight, dtype)
    many_rows = QuantLinear(fused.kernel, fused.bias, large_rows=1)
    x = torch.randn(70, k)
    close(many_rows(x.to(dtype)), F.linear(x, weight, bias), dtype)


def test_kernels_that_cannot_join_stay_apart():
    int4, int8 = random_weight(64, 64, 4, 0), random_weight(64, 64, 8, 1)
    mixed = [build_kernel("int4pack", int4, torch.float32), build_kernel("int4pair", int8, torch.float32)]
    assert concat_kernels(mixed) is None
    other_dtype = [build_kernel("dequantise", int4, torch.float32), build_kernel("dequantise", int4, torch.bfloat16)]
    assert concat_kernels(other_dtype) is None
    # 48 rows are not whole blocks of torch's CPU packing: torch packs them itself, in a layout not known here.
    odd = [build_kernel("int4pack", random_weight(48, 64, 4, 2), torch.float32)] * 2
    assert concat_kernels(odd) is None
    float_and_quantized = [torch.nn.Linear(64, 64), QuantLinear(mixed[0], None, None)]
    assert fuse_linears(float_and_quantized) is None


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_model_with_fused_projections_equals_transformers_with_rounded_weights(kind, tmp_path, monkeypatch):
    """Shapes whose projections are whole blocks of the int4 packing, so the quantized kernels fuse."""
    monkeypatch.setenv("LMCLI_KERNEL", "int4pack")
    fields = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False, attention_bias=True)
    reference = random_reference("llama", fields)
    reference.save_pretrained(tmp_path)
    model, _ = lmcli.load(tmp_path, quantize=kind, dtype="float32")
    _assert_fused(model)
    if kernels.cpu_pack_layout() is not None:
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    bits = {"int4": 4, "int8": 8}[kind]
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith(".weight") and parameter.dim() == 2:
                parameter.copy_(GroupQuantized.quantize(parameter, bits).dequantise())
        (ids,) = prompts([12])
        want = reference(ids[None]).logits
    torch.testing.assert_close(model(ids[None]), want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"int{c[0]}-{c[1]}-{str(c[2]).removeprefix('torch.')}")
def test_a_part_without_offsets_fuses_with_parts_that_have_them(case):
    """Q4_0-like parts (no offsets) beside Q4_1-like ones (offsets): the fused kernel equals F.linear on
    the dequantised, concatenated weights, where a missing offset is exactly 0."""
    bits, name, dtype = case
    layout = kernels.cpu_pack_layout()
    if name != "dequantise" and layout is None:
        pytest.skip("torch's CPU int4 packing has no block layout here: its kernels are never fused")
    block = layout.block if layout is not None else 64
    sizes, k = [block, 2 * block, block], 128
    parts = [random_weight(n, k, bits, seed) for seed, n in enumerate(sizes)]
    parts[1] = GroupQuantized(parts[1].codes, parts[1].scales, None, parts[1].group, parts[1].bits)  # no offsets
    modules = [QuantLinear(build_kernel(name, q, dtype), None, None) for q in parts]
    fused = fuse_linears(modules)
    assert isinstance(fused, QuantLinear)
    weight = torch.cat([q.dequantise(torch.float32) for q in parts])
    for rows in (1, 3):
        x = torch.randn(rows, k)
        close(fused(x.to(dtype)), F.linear(x, weight), dtype)


def test_the_default_model_gets_the_fixed_kernel_for_each_weight_kind(smollm2_gguf):
    """Which kernel the installer chose, per weight kind, against the file's own tensor types (read by the
    gguf package): Q4_x weights run on torch's int4 kernel, 8-bit ones on lmcli's native kernel (torch's
    int4-pair form where it does not build)."""
    import gguf

    reader = gguf.GGUFReader(str(smollm2_gguf))
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    model, _ = lmcli.load(smollm2_gguf)
    has_int4 = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    chosen = {kind: choice.kernel for kind, choice in model.kernel_choices.items()}
    if any(k.startswith("Q4") for k in kinds):
        assert chosen["int4"] == ("int4pack" if has_int4 else "dequantise")
    if any(k in ("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K") for k in kinds):
        from lmcli import native

        # lmcli's own kernel where it builds here (kernel_plan.NATIVE_DEFAULT), else torch's int4-pair form
        torchs = "int4pair" if has_int4 else "dequantise"
        assert chosen["int8"] == ("native" if native.library() is not None else torchs)
    formats = model.weight_formats()
    q4 = sum(int(t.n_elements) for t in reader.tensors if len(t.shape) == 2 and t.tensor_type.name.startswith("Q4"))
    assert formats.get(chosen["int4"], 0) >= q4 > 0  # every Q4 weight is held by that kernel
