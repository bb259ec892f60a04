"""Quantized weights: each kernel against F.linear on the dequantised weight, within the activation
dtype's tolerance; embedding rows against the dequantised matrix; the kernel choice and its cache."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels import matmul as kernels
from lmcli.kernels import plan as kernel_plan
from lmcli.kernels.linear import QuantEmbedding, QuantLinear
from lmcli.kernels.matmul import build_kernel

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the output's largest value
KERNELS = {4: ["int4pack", "dequantise"], 8: ["int4pair", "dequantise"]}
CASES = [(bits, name, dtype) for bits in (4, 8) for name in KERNELS[bits] for dtype in TOLERANCE]


def ids(case):
    bits, name, dtype = case
    return f"int{bits}-{name}-{str(dtype).removeprefix('torch.')}"


def random_weight(n: int, k: int, bits: int, seed: int = 0, group: int = 32) -> GroupQuantized:
    """Codes and scales drawn directly (not from a quantizer), offsets far from zero."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    offsets = torch.randn(n, k // group, generator=gen) * 0.05
    return GroupQuantized.from_codes(codes, scales, offsets, group=group, bits=bits)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    error = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert error <= TOLERANCE[dtype], error


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_kernel_matches_f_linear_on_dequantised_weight(case, rows):
    bits, name, dtype = case
    q = random_weight(192, 320, bits)
    want_weight = q.dequantise(torch.float32)  # (N, K), independent of any kernel
    x = torch.randn(rows, 320)
    kernel = build_kernel(name, q, dtype)
    close(kernel.matmul(x.to(dtype)), F.linear(x, want_weight), dtype)
    expanded = kernel.dequantise()
    assert expanded is not None and expanded.dtype == dtype
    close(expanded, want_weight, dtype)
    index = torch.tensor([191, 0, 64, 65, 7, 7])
    picked = kernel.rows(index)
    assert picked is not None
    close(picked, want_weight[index], dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_int8_pairs_take_groups_of_16_as_q6_k_stores_them(dtype):
    """int4pair runs torch's kernel over twice the columns, so a group of 16 weights is a kernel group of 32."""
    q = random_weight(128, 320, 8, group=16)
    x = torch.randn(3, 320)
    kernel = build_kernel("int4pair", q, dtype)
    close(kernel.matmul(x.to(dtype)), F.linear(x, q.dequantise(torch.float32)), dtype)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_quant_linear_both_paths_and_bias(case):
    bits, name, dtype = case
    q = random_weight(128, 64, bits, seed=1)
    bias = torch.randn(128)
    want_weight = q.dequantise(torch.float32)
    layer = QuantLinear(build_kernel(name, q, dtype), bias.to(dtype), large_rows=8)
    for shape in [(1, 1, 64), (2, 3, 64), (2, 9, 64)]:  # below and above large_rows
        x = torch.randn(shape)
        got = layer(x.to(dtype))
        assert got.shape == (*shape[:-1], 128)
        close(got, F.linear(x, want_weight, bias), dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_embedding_gathers_dequantised_rows(bits):
    q = random_weight(256, 96, bits, seed=2)
    embedding = QuantEmbedding(build_kernel(KERNELS[bits][0], q, torch.bfloat16))
    tokens = torch.tensor([[3, 255, 64], [0, 3, 128]])
    close(embedding(tokens), F.embedding(tokens, q.dequantise()), torch.bfloat16)


@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_quantization_error_is_within_half_a_step(bits):
    weight = torch.randn(64, 128) * 0.1
    q = GroupQuantized.quantize(weight, bits)
    assert q.code_values().dtype == (torch.uint8 if bits == 4 else torch.int8)
    step = q.scales.repeat_interleave(32, dim=1)  # (N, K)
    assert bool(((q.dequantise() - weight).abs() <= step / 2 + 1e-7).all())


def test_pack_layout_reads_back_what_torch_packed():
    layout = kernels.cpu_pack_layout()
    if layout is None:
        pytest.skip("torch's CPU int4 packing is not a row-block layout here (the kernels expand nothing)")
    codes = torch.randint(0, 16, (2 * layout.block, 64), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(layout.unpack(packed, *codes.shape), codes.to(torch.uint8))
    assert torch.equal(layout.pack(codes.to(torch.uint8)), packed)
    rows = torch.tensor([1, layout.block + 5, 0])
    n, k = codes.shape  # named: mypy cannot count a star-unpacked torch.Size followed by another argument
    assert torch.equal(layout.unpack_rows(packed, n, k, rows), codes[rows].to(torch.uint8))


def test_kernel_plan_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LMCLI_KERNEL", raising=False)
    monkeypatch.setattr(kernel_plan, "_PROBE_SHAPE", (128, 256))
    kernel_plan._cached_plans.cache_clear()
    choice = kernel_plan.measured_plan("int8", torch.bfloat16)
    assert choice.kernel in [*KERNELS[8], "native"] and f"{choice.kernel}@1" in choice.seconds and choice.why
    stored = json.loads((tmp_path / "kernels.json").read_text())
    (machine,) = stored.values()
    assert machine["int8|bfloat16,float32"]["bfloat16"]["kernel"] == choice.kernel
    kernel_plan._cached_plans.cache_clear()

    def must_not_measure(*args):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(kernel_plan, "measure", must_not_measure)
    assert kernel_plan.measured_plan("int8", torch.bfloat16) == choice
    kernel_plan._cached_plans.cache_clear()


def test_a_plan_measured_on_a_crowded_machine_is_measured_again_when_it_is_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LMCLI_KERNEL", raising=False)
    monkeypatch.delenv("LMCLI_REMEASURE", raising=False)
    measured: list[str] = []

    def stand_in(kind, device, dtypes):  # a plan whose kernel names the measurement it came from
        measured.append(kind)
        return {"bfloat16": kernel_plan.KernelChoice(kind, "bfloat16", f"measurement {len(measured)}", None, "", {})}

    monkeypatch.setattr(kernel_plan, "_measure_apart", lambda kind, dtypes: None)
    monkeypatch.setattr(kernel_plan, "measure", stand_in)
    for load_then, load_now, measured_again in [(3.0, 0.1, True), (3.0, 0.9, False), (0.4, 0.1, False)]:
        monkeypatch.setattr(kernel_plan, "_load_average", lambda value=load_then: value)
        kernel_plan._cached_plans.cache_clear()
        (tmp_path / "kernels.json").unlink(missing_ok=True)
        first = kernel_plan.measured_plan("int4", torch.bfloat16)
        monkeypatch.setattr(kernel_plan, "_load_average", lambda value=load_now: value)
        kernel_plan._cached_plans.cache_clear()
        second = kernel_plan.measured_plan("int4", torch.bfloat16)
        assert (second.kernel != first.kernel) == measured_again, (load_then, load_now)
    kernel_plan._cached_plans.cache_clear()


# --- --quantize on a float checkpoint, end to end ---------------------------------------------------


@pytest.fixture
def quick_plans(tmp_path, monkeypatch):
    """Kernel choices measured on a small probe into a private cache, so tests stay fast."""
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LMCLI_KERNEL", raising=False)
    monkeypatch.setattr(kernel_plan, "_PROBE_SHAPE", (128, 256))
    kernel_plan._cached_plans.cache_clear()
    yield
    kernel_plan._cached_plans.cache_clear()


@pytest.mark.parametrize("case", ["llama-mha-tied-bias", "gpt2", "mixtral"])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantize_at_load_equals_transformers_with_the_same_rounded_weights(case, kind, tmp_path, quick_plans,
                                                                            one_thread):
    """lmcli.load(quantize=...) against transformers whose weights were rounded the same way (float32)."""
    pytest.importorskip("transformers")
    from tiny import prompts, save_reference

    import lmcli

    reference = save_reference(case, tmp_path / case)
    model, _ = lmcli.load(tmp_path / case, quantize=kind, dtype="float32")
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    assert model.weight_formats().keys() - {"float32"}  # something is stored quantized
    bits = {"int4": 4, "int8": 8}[kind]
    with torch.no_grad():
        for name, module in reference.named_modules():
            for leaf, weight in module.named_parameters(recurse=False):
                router = name.endswith("mlp.gate")  # mixtral's router stays float, as lmcli keeps it
                if leaf == "bias" or weight.dim() < 2 or router or name.endswith("wpe"):
                    continue
                is_conv1d = type(module).__name__ == "Conv1D"  # GPT-2 stores (in, out)
                w = weight.t() if is_conv1d else weight  # (..., out, in): mixtral's experts (E, out, in)
                if leaf == "gate_up_proj":  # lmcli keeps gate and up as two weights: round each
                    halves = w.chunk(2, dim=1)
                    weight.copy_(torch.cat([GroupQuantized.quantize(h, bits).dequantise() for h in halves], 1))
                elif w.shape[-1] % 32 == 0:
                    rounded = GroupQuantized.quantize(w, bits).dequantise()
                    weight.copy_(rounded.t() if is_conv1d else rounded)
        (ids,) = prompts([12])
        want = reference(ids[None]).logits
    torch.testing.assert_close(model(ids[None]), want, atol=2e-4, rtol=0)
