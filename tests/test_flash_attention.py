"""The native attention kernel (csrc/attention.cpp via lmcli.models.native_attention).

Against an independent reference: each query's softmax over its own visible keys in float64, built
from the layout with plain masks (causal, window, pad columns), the query heads sharing a kv head
repeated. Invariance bit for bit: a 300-token prompt prefilled whole == in chunks of 1, 7 and 64 (also
through a rolling window cache); rows of different lengths in one call == each row alone; one thread
== two. Each instruction-set build this CPU runs is forced and checked; the torch fallback is forced
(and a build that fails is recorded once, never retried).
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from lmcli.models import native_attention as na
from lmcli.models.cache import RollingKVCache

pytestmark = pytest.mark.skipif(na.isa() is None, reason="no native attention build on this machine (no g++?)")


def _reference(q, k, v, key_slots, query_slots, is_token, window, scale, softcap=None):
    """(B, T, nh * hd) float64: each real query on its visible keys; pad queries 0."""
    B, nh, T, hd = q.shape
    rep = nh // k.shape[1]
    kk = k.double().repeat_interleave(rep, 1)  # (B, nh, S, hd)
    vv = v.double().repeat_interleave(rep, 1)
    scores = (q.double() @ kk.transpose(-1, -2)) * scale  # (B, nh, T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    ks, qs = key_slots[None, :], query_slots[:, None]  # (1, S), (T, 1)
    visible = (ks >= 0) & (ks <= qs)  # (T, S)
    if window is not None:
        visible &= ks > qs - window
    visible = visible[None] & is_token[:, key_slots.clamp(min=0)][:, None, :]  # (B, T, S)
    real = is_token[:, query_slots]  # (B, T)
    visible |= ~real[:, :, None]  # a pad query: anything, zeroed below
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = (scores.softmax(-1) @ vv).transpose(1, 2)  # (B, T, nh, hd)
    out = out * real[:, :, None, None]
    return out.reshape(B, T, nh * hd)


def _inputs(B, nh, nkv, S, hd, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, nh, S, hd, generator=g) * 2).to(dtype)
    k = (torch.randn(B, nkv, S, hd, generator=g) * 2).to(dtype)
    v = torch.randn(B, nkv, S, hd, generator=g).to(dtype)
    return q, k, v


def _attend(q, k, v, key_slots, query_slots, is_token, window, scale, softcap=None):
    plan = na.plan(key_slots, query_slots, is_token, window)
    out = na.attend(q, k, v, plan, scale, softcap)
    assert out is not None
    return out


SHAPES = [  # nh, nkv, hd: the default model's heads (GQA 3), Gemma 3 270M's (4 on 1, head size 256), MHA
    (9, 3, 64),
    (4, 1, 256),
    (2, 2, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("shape", SHAPES)
def test_each_query_matches_a_float64_softmax_over_its_own_keys(shape, window, dtype):
    nh, nkv, hd = shape
    B, S = 3, 150
    q, k, v = _inputs(B, nh, nkv, S, hd, dtype, seed=hd + (window or 0))
    is_token = torch.ones(B, S, dtype=torch.bool)
    is_token[1, :40] = False  # a left-padded row
    is_token[2, 60:90:3] = False  # holes
    is_token[2, S - 1] = False  # its last query a pad
    slots = torch.arange(S)
    got = _attend(q, k, v, slots, slots, is_token, window, hd**-0.5)
    want = _reference(q, k, v, slots, slots, is_token, window, hd**-0.5)
    assert got.dtype == dtype and got.shape == (B, S, nh * hd)
    tolerance = 3e-5 if dtype == torch.float32 else 8e-3  # bfloat16: the output's own rounding
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)
    assert torch.equal(got[2, S - 1], torch.zeros(nh * hd, dtype=dtype))  # a pad query reads nothing


def test_softcapped_scores_match_float64():
    q, k, v = _inputs(2, 4, 2, 80, 64, torch.float32, seed=3)
    q = q * 4  # scores large enough for the cap to matter
    is_token = torch.ones(2, 80, dtype=torch.bool)
    slots = torch.arange(80)
    got = _attend(q, k, v, slots, slots, is_token, None, 0.125, softcap=5.0)
    want = _reference(q, k, v, slots, slots, is_token, None, 0.125, softcap=5.0)
    torch.testing.assert_close(got.double(), want, atol=3e-5, rtol=3e-5)


def _chunked(q, k, v, is_token, window, chunk):
    """Prefill in chunks: chunk c's queries on the keys up to its end, as a full cache returns them."""
    S = q.shape[2]
    parts = []
    for begin in range(0, S, chunk):
        end = min(S, begin + chunk)
        parts.append(_attend(q[:, :, begin:end], k[:, :, :end], v[:, :, :end], torch.arange(end),
                             torch.arange(begin, end), is_token, window, 0.125))
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
def test_a_prompt_prefilled_whole_or_in_chunks_gives_each_query_the_same_bits(window, dtype):
    q, k, v = _inputs(2, 9, 3, 300, 64, dtype, seed=7)
    is_token = torch.ones(2, 300, dtype=torch.bool)
    is_token[1, :33] = False
    whole = _attend(q, k, v, torch.arange(300), torch.arange(300), is_token, window, 0.125)
    for chunk in (1, 7, 64):
        assert torch.equal(_chunked(q, k, v, is_token, window, chunk), whole), chunk


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_a_rolling_window_cache_in_chunks_gives_the_whole_prompts_bits(chunk):
    """Gemma's and Mistral's sliding layers: the ring returns ring + chunk, in its own order."""
    window, S, nh, nkv, hd = 24, 150, 4, 1, 256
    q, k, v = _inputs(1, nh, nkv, S, hd, torch.bfloat16, seed=chunk)
    is_token = torch.ones(1, S, dtype=torch.bool)
    whole = _attend(q, k, v, torch.arange(S), torch.arange(S), is_token, window, hd**-0.5)
    cache = RollingKVCache(1, nkv, window, hd, torch.bfloat16, torch.device("cpu"))
    parts = []
    for begin in range(0, S, chunk):
        slots = torch.arange(begin, min(S, begin + chunk))
        keys, values, key_slots = cache.update(k[:, :, slots], v[:, :, slots], slots)
        parts.append(_attend(q[:, :, slots], keys, values, key_slots, slots, is_token, window, hd**-0.5))
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_rows_of_different_lengths_in_one_call_each_get_their_alone_bits():
    S = 200
    q, k, v = _inputs(4, 9, 3, S, 64, torch.bfloat16, seed=11)
    is_token = torch.zeros(4, S, dtype=torch.bool)
    for row, start in enumerate((0, 50, 170, 199)):
        is_token[row, start:] = True
    is_token[0, 10:30] = False
    slots = torch.arange(S)
    for queries in (torch.arange(S - 5, S), torch.tensor([S - 1])):  # a verify pass / a decode step
        together = _attend(q[:, :, queries], k, v, slots, queries, is_token, None, 0.125)
        for row in range(4):
            start = int(is_token[row].float().argmax())  # the row alone: its own tokens only
            own = is_token[row:row + 1, start:]
            mine = queries >= start  # the row's queries (before it starts: pads, 0 in the call)
            alone = _attend(q[row:row + 1, :, queries[mine]], k[row:row + 1, :, start:], v[row:row + 1, :, start:],
                            torch.arange(S - start), queries[mine] - start, own, None, 0.125)
            assert torch.equal(together[row:row + 1, mine], alone), row
            assert not together[row, ~mine].any()
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            assert torch.equal(_attend(q[:, :, queries], k, v, slots, queries, is_token, None, 0.125), together)
        finally:
            torch.set_num_threads(threads)


def test_strided_cache_views_and_unread_columns_are_taken_as_they_are():
    """A KVCache returns a view of its (B, nkv, L, hd) buffer; columns no query reads may hold NaN."""
    q, k, v = _inputs(2, 9, 3, 64, 64, torch.bfloat16, seed=5)
    big_k = torch.full((2, 3, 100, 64), float("nan"), dtype=torch.bfloat16)
    big_v = big_k.clone()
    big_k[:, :, :64], big_v[:, :, :64] = k, v
    is_token = torch.ones(2, 64, dtype=torch.bool)
    is_token[0, :5] = False
    k[0, :, :5] = float("nan")
    v[0, :, :5] = float("nan")
    big_k[0, :, :5] = float("nan")
    big_v[0, :, :5] = float("nan")
    slots = torch.arange(64)
    want = _attend(q, k.contiguous(), v.contiguous(), slots, slots, is_token, None, 0.125)
    got = _attend(q, big_k[:, :, :64], big_v[:, :, :64], slots, slots, is_token, None, 0.125)
    assert torch.equal(got, want)
    assert not torch.isnan(got).any()


@pytest.mark.parametrize("isa", na.supported_isas())
def test_each_instruction_set_build_this_cpu_runs(isa, monkeypatch):
    monkeypatch.setenv("LMCLI_ATTENTION_ISA", isa)
    assert na.isa() == isa
    q, k, v = _inputs(1, 4, 1, 130, 256, torch.bfloat16, seed=2)
    is_token = torch.ones(1, 130, dtype=torch.bool)
    slots = torch.arange(130)
    whole = _attend(q, k, v, slots, slots, is_token, 30, 0.0625)
    torch.testing.assert_close(whole.double(), _reference(q, k, v, slots, slots, is_token, 30, 0.0625),
                               atol=8e-3, rtol=8e-3)
    assert torch.equal(_chunked(q, k, v, is_token, 30, 7).to(whole.dtype), _chunked(q, k, v, is_token, 30, 130))


def test_the_torch_path_when_forced(monkeypatch):
    monkeypatch.setenv("LMCLI_ATTENTION", "torch")
    assert na.isa() is None
    assert na.describe() == "torch (row calls)"
    q, k, v = _inputs(1, 2, 1, 8, 64, torch.float32, seed=1)
    plan = na.plan(torch.arange(8), torch.arange(8), torch.ones(1, 8, dtype=torch.bool), None)
    assert na.attend(q, k, v, plan, 0.125, None) is None  # the caller's torch path runs


def test_a_failed_build_is_recorded_once_and_the_torch_path_taken(monkeypatch, tmp_path):
    broken = tmp_path / "attention.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(na, "SOURCE", broken)
    monkeypatch.setattr(na, "_loaded", {})
    assert na.isa() is None
    failed = list((tmp_path / "cache" / "native").glob("*.failed"))
    assert len(failed) == 1 and failed[0].read_text()
    runs = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: runs.append(a))
    monkeypatch.setattr(na, "_loaded", {})  # a later process: the record, not the compiler
    assert na.isa() is None
    assert runs == []


def test_a_damaged_build_is_recorded_once(monkeypatch, tmp_path):
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(na, "_loaded", {})
    name = na.supported_isas()[0]
    monkeypatch.setenv("LMCLI_ATTENTION_ISA", name)
    target, failed = na.build_paths(name)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\x7fELF damaged")  # as a disk error or another program might leave it
    assert na.isa() is None
    assert failed.exists()
    monkeypatch.setattr(na, "_loaded", {})
    assert na.isa() is None  # the record: not loaded again


def _prefill_logits(model, prompt: torch.Tensor, chunk: int) -> torch.Tensor:
    """Logits [T, vocab] of a prompt prefilled through a cache in chunks of `chunk` tokens."""
    from lmcli.models.cache import ModelCache

    T = len(prompt)
    cache = ModelCache.for_model(model, 1, T)
    is_token = torch.ones(1, T, dtype=torch.bool)
    parts = []
    with torch.no_grad():
        for begin in range(0, T, chunk):
            slots = torch.arange(begin, min(T, begin + chunk))
            parts.append(model.forward_slots(prompt[None, slots], slots[None], slots, is_token, cache)[0])
    return torch.cat(parts)


@pytest.mark.parametrize("case", ["llama", "qwen2-window", "gemma2"])
def test_a_tiny_quantized_model_near_the_torch_path_and_chunk_invariant(case, tmp_path, monkeypatch):
    """Through the model (GQA, sliding windows in rolling caches, softcapping): the kernel's logits near
    the torch row calls' (SDPA), and each layer's attention output at each position the same bits
    whether the prompt is prefilled whole or in chunks of 7 or 16. (The attention's outputs, not the
    logits: the matrix kernels after it are not all bit-invariant to the call's row count; measured on
    qwen2-window, chunks of 7 moved one position's logits by 2e-7 with every attention output equal.)"""
    from tiny import prompts, save_reference

    import lmcli

    save_reference(case, tmp_path / case)
    model, _ = lmcli.load(tmp_path / case, quantize="int8")
    assert model.batch_invariant
    prompt = prompts([40], seed=4)[0]
    seen: list[torch.Tensor] = []
    attend = na.attend

    def spy(*args, **kwargs):
        out = attend(*args, **kwargs)
        assert out is not None
        seen.append(out)
        return out

    monkeypatch.setattr(na, "attend", spy)
    layers = len(model.model.layers)
    whole = _prefill_logits(model, prompt, 40)
    by_layer = seen[:layers]  # (1, 40, nh * hd) each
    for chunk in (7, 16):
        seen.clear()
        _prefill_logits(model, prompt, chunk)
        assert len(seen) == layers * -(-40 // chunk)
        for layer in range(layers):
            joined = torch.cat(seen[layer::layers], dim=1)
            assert torch.equal(joined, by_layer[layer]), (chunk, layer)
    monkeypatch.setenv("LMCLI_ATTENTION", "torch")
    seen.clear()
    torch.testing.assert_close(_prefill_logits(model, prompt, 40), whole, atol=0.15, rtol=0.05)  # bfloat16 logits
    assert not seen  # the torch path ran


def test_the_compiled_programs_attention_op_gives_the_eager_paths_bits():
    """torch.ops.lmcli.attend_rows (what the compiled decode step and prefill chunks call back) runs the
    kernel on its gather plan: a decode step's and a chunk's numbers are then eager's."""
    from lmcli.models.compiled_prefill import chunk_plan
    from lmcli.models.compiled_step import decode_plan
    from lmcli.models.row_attention import attend_rows

    S = 120
    q, k, v = _inputs(3, 9, 3, S, 64, torch.bfloat16, seed=9)
    is_token = torch.ones(3, S, dtype=torch.bool)
    is_token[1, :50] = False
    is_token[2, :7] = False
    slots = torch.arange(S)
    step = torch.tensor([S - 1])
    eager = _attend(q[:, :, step], k, v, slots, step, is_token, None, 0.125)
    index, mask = decode_plan(is_token, S, torch.bfloat16)
    assert torch.equal(attend_rows(q[:, :, step], k, v, index, mask, 0.125), eager)
    chunk = torch.arange(S - 9, S)
    eager = _attend(q[:, :, chunk], k, v, slots, chunk, is_token, None, 0.125)
    index, mask = chunk_plan(is_token, chunk, S, torch.bfloat16)
    assert torch.equal(attend_rows(q[:, :, chunk], k, v, index, mask, 0.125), eager)
