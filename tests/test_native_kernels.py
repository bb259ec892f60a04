"""lmcli's own C++ kernels (lmcli/native, kernels/native_kernel.py): against F.linear in float64 on the
dequantised weights (independent of the kernel), batch-invariant bit for bit, on each instruction-set
path this CPU has; the fallbacks to torch's kernels; a failed build recorded once; and on the real default
model, the distance to the float32 dequantised model no worse than torch's kernel's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmcli import native
from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels.matmul import Int4PackKernel, build_kernel, concat_kernels

LIBRARY = native.library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason=f"no native library here: {native.why_not()}")
ISAS = LIBRARY.supported if LIBRARY is not None else []
ROWS = (1, 2, 7, 8, 33, 64)
# (bits, group, offsets): int4 as Q4_0 (no offset) and Q4_1 / Q4_K (offset); int8 as Q8_0 (group 32,
# no offset) and Q6_K / Q5_* (group 16, offset).
KINDS = [(4, 32, False), (4, 32, True), (8, 32, False), (8, 16, True), (8, 32, True), (4, 16, True)]


def _quantized(bits: int, group: int, offsets: bool, n: int, k: int, seed: int = 0) -> GroupQuantized:
    """Random codes over their whole range, scales and offsets of both signs."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scales = torch.randn(n, k // group, generator=gen) * 0.01
    offs = torch.randn(n, k // group, generator=gen) * 0.05 if offsets else None
    return GroupQuantized.from_codes(codes, scales, offs, group, bits)


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    monkeypatch.setenv("LMCLI_NATIVE_ISA", request.param)
    return request.param


@pytest.mark.parametrize(("bits", "group", "offsets"), KINDS)
@pytest.mark.parametrize(("n", "k"), [(200, 320), (48, 96), (304, 544)])  # N not a multiple of 64 (or 16), K of 256
def test_matches_linear_on_dequantised_weights(isa, bits, group, offsets, n, k):
    q = _quantized(bits, group, offsets, n, k, seed=n + k + bits)
    kernel = build_kernel("native", q, torch.bfloat16)
    assert kernel.name == "native"
    weight = q.dequantise(torch.float64)  # (N, K)
    gen = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).bfloat16()  # (M, K): the kernel's input is exactly x
        got = kernel.matmul(x)  # (M, N) float32
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        want = F.linear(x.double(), weight)
        # float32 sums of exact products: a few float32 roundings of the partial sums
        scale = x.double().abs() @ weight.abs().t()  # (M, N): the size of the terms summed
        assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-30).all(), (isa, rows)


@pytest.mark.parametrize(("bits", "group", "offsets"), KINDS)
def test_each_row_equals_the_row_alone(isa, bits, group, offsets):
    """Batch invariance by construction: row i of an M-row call is bit-equal to the 1-row call."""
    q = _quantized(bits, group, offsets, 208, 320, seed=bits + group)
    kernel = build_kernel("native", q, torch.bfloat16)
    x = torch.randn(64, 320, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = torch.cat([kernel.matmul(x[i:i + 1]) for i in range(64)])  # (64, N)
    for rows in ROWS:
        assert torch.equal(kernel.matmul(x[:rows]), alone[:rows]), (isa, rows)


@pytest.mark.parametrize(("bits", "group", "offsets"), KINDS[:4])
def test_every_path_gives_the_same_bits(monkeypatch, bits, group, offsets):
    """The paths share one summation order (csrc/qmm.h), so a machine's text does not depend on which
    path its CPU takes (inputs without subnormal numbers, which vdpbf16ps flushes)."""
    q = _quantized(bits, group, offsets, 96, 256, seed=3)
    kernel = build_kernel("native", q, torch.bfloat16)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    outputs = {}
    for isa in ISAS:
        monkeypatch.setenv("LMCLI_NATIVE_ISA", isa)
        outputs[isa] = kernel.matmul(x)
    first = outputs[ISAS[0]]
    assert all(torch.equal(first, out) for out in outputs.values())


@pytest.mark.parametrize(("bits", "group", "offsets"), KINDS)
def test_rows_and_dequantise_are_the_stored_weights(bits, group, offsets):
    q = _quantized(bits, group, offsets, 40, 128, seed=5)
    kernel = build_kernel("native", q, torch.bfloat16)
    index = torch.tensor([0, 39, 17, 16, 15, 17])
    rows, whole = kernel.rows(index, torch.float32), kernel.dequantise()
    assert rows is not None and whole is not None
    assert torch.equal(rows, q.dequantise(torch.float32)[index])
    assert torch.equal(whole, q.dequantise(torch.float32).bfloat16())


def test_joined_kernels_give_the_parts_side_by_side():
    parts = [_quantized(4, 32, True, n, 128, seed=n) for n in (64, 32, 48)]
    kernels = [build_kernel("native", q, torch.bfloat16) for q in parts]
    joined = concat_kernels(kernels)
    assert joined is not None and joined.n == 144
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert torch.equal(joined.matmul(x), torch.cat([k.matmul(x) for k in kernels], dim=1))
    # A part that is not whole blocks of 16 rows cannot be joined (its padding would sit in the middle).
    assert concat_kernels([build_kernel("native", _quantized(4, 32, True, 40, 128), torch.bfloat16), kernels[0]]) is None


def test_threads_are_torchs(monkeypatch):
    """The library's OpenMP is torch's (one libgomp.so.1): torch.set_num_threads sets its thread count."""
    assert LIBRARY is not None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert LIBRARY.threads() == 1
        torch.set_num_threads(2)
        assert LIBRARY.threads() == 2
    finally:
        torch.set_num_threads(before)
    # Other wheels may bring their own renamed copy (sentencepiece.libs/libgomp-<hash>.so); the name the
    # library links against, libgomp.so.1, is mapped once: torch's.
    gomp = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if line.endswith("/libgomp.so.1")}
    assert len(gomp) == 1 and Path(torch.__file__).parent in Path(next(iter(gomp))).parents, gomp


def test_fallbacks_to_torch(monkeypatch):
    from lmcli.kernels.plan import kernel_plan

    q = _quantized(4, 32, True, 64, 128)
    assert isinstance(build_kernel("native", q, torch.float32), Int4PackKernel)  # float32 activations: not native
    monkeypatch.setenv("LMCLI_KERNEL", "int4pack")
    assert kernel_plan("int4", torch.bfloat16).kernel == "int4pack"
    monkeypatch.setenv("LMCLI_KERNEL", "native")
    assert kernel_plan("int8", torch.bfloat16).kernel == "native"
    assert kernel_plan("int4", torch.float32).kernel == "int4pack"  # cannot run: torch's, and says why
    monkeypatch.setenv(native.ENV, "0")
    assert native.library() is None and "LMCLI_NATIVE=0" in native.why_not()
    assert isinstance(build_kernel("native", q, torch.bfloat16), Int4PackKernel)
    assert kernel_plan("int4", torch.bfloat16).kernel == "int4pack"


def test_the_fixed_choice_takes_native_kernels_where_they_build():
    from lmcli.kernels.plan import NATIVE_DEFAULT, fixed_choice

    for kind in ("int4", "int8"):
        chosen = fixed_choice(kind, torch.bfloat16, torch.device("cpu")).kernel
        assert (chosen == "native") == (kind in NATIVE_DEFAULT), (kind, chosen)


def _child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_a_failed_build_is_recorded_once(tmp_path):
    """A compiler that fails: lmcli falls back to torch's kernels, and later starts do not run it again."""
    calls = tmp_path / "calls"
    compiler = tmp_path / "broken-c++"
    compiler.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'error: this compiler is broken' >&2\nexit 1\n")
    compiler.chmod(0o755)
    env = {"CXX": str(compiler), "LMCLI_CACHE_DIR": str(tmp_path / "cache"), "LMCLI_KERNEL": ""}
    code = ("import torch\nfrom lmcli import native\nfrom lmcli.kernels.plan import kernel_plan\n"
            "print(native.library() is None, native.why_not())\n"
            "print(kernel_plan('int4', torch.bfloat16).kernel)")
    for _ in range(2):
        out = _child(code, env)
        assert out.returncode == 0, out.stderr
        first, plan = out.stdout.splitlines()
        assert first.startswith("True") and "this compiler is broken" in first
        assert plan == "int4pack"
    assert calls.read_text().count("x") == 1  # one attempt, in the first process
    out = _child(code, {**env, "CXX": "/nonexistent/c++"})  # no compiler at all
    assert out.returncode == 0 and "no C++ compiler" in out.stdout


@pytest.mark.full  # three loads of the real model and a float32 reference decoded through expanded weights: minutes
def test_real_default_model_is_as_close_to_float32_as_torchs_kernel(smollm2_gguf, monkeypatch):
    """Teacher-forced along the float32 dequantised model's greedy text: the native path's mean KL from
    it is no worse than torch's int4 kernel's (it keeps float32 scales and sums), and its top-1 tokens
    agree as often."""
    import lmcli
    from lmcli.bench.measure import mean_kl_divergence

    monkeypatch.setenv("LMCLI_KERNEL", "dequantise")  # float32 activations times the float32 dequantised weights
    reference, tokenizer = lmcli.load(smollm2_gguf, dtype="float32", device="cpu")
    assert set(reference.weight_formats()) <= {"dequantise", "float32"}
    prompt = torch.tensor([tokenizer.encode("The three most important inventions of the last century are")])
    text = reference.generate(prompt, 48, False)  # (1, T)

    def logprobs(model) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(text)[0].float(), -1)[prompt.shape[1] - 1:-1]  # (48, V)

    want = logprobs(reference)
    del reference
    results = {}
    for forced in ("native", "int4pack"):
        monkeypatch.setenv("LMCLI_KERNEL", forced)
        model, _ = lmcli.load(smollm2_gguf, device="cpu")
        assert forced in model.weight_formats() or forced == "int4pack"
        got = logprobs(model)
        results[forced] = (mean_kl_divergence(want, got), (got.argmax(-1) == want.argmax(-1)).float().mean().item())
        del model
    print(results)
    assert results["native"][0] <= max(results["int4pack"][0], 1e-4)
    assert results["native"][1] >= results["int4pack"][1]


from real_models import smollm2_gguf  # noqa: E402, F401  (fixture)


def test_compile_on_a_model_with_native_kernels_decodes_eagerly_in_one_line(tmp_path, capsys):
    """`--compile` cannot export a ctypes call, and torch.compile would break its graph at each one: a
    model holding native kernels says so in one line and decodes eagerly, with eager's tokens."""
    from tiny import prompts, save_reference

    import lmcli

    save_reference("llama", tmp_path / "llama")
    model, _ = lmcli.load(tmp_path / "llama", quantize="int8")
    assert any(getattr(getattr(m, "kernel", None), "name", "") == "native" for m in model.modules())
    ids = prompts([7])[0][None]
    eager = model.generate(ids, 5, False)
    capsys.readouterr()  # what saving the checkpoint printed
    assert model.compile_decode(builds=True) is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "native kernels" in err and "decoding eagerly" in err
    assert getattr(model, "_compiled_decode", None) is None
    assert torch.equal(model.generate(ids, 5, False), eager)
