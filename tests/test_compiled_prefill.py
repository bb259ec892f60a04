"""Prefill in chunks through a compiled program (models/compiled_prefill.py).

What is exported, run eagerly, against eager prefill (bit for bit: the chunk's key plan as tensors
stands for the batch-invariant path); the cache's use by the prefill with a stand-in builder (a
build, a load, a damaged entry, a failing build); and, under `full`, one real build of a tiny int4
llama against eager prefill. The cache's own rules (stale, killed, concurrent, unwritable) are
tests/test_compile_cache.py's: the prefill goes through the same `compiled_cache.obtain`."""

from __future__ import annotations

import itertools

import pytest
import torch
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from tiny import (
    prompts,
    tiny_int4,  # noqa: F401 (fixture)
)

import lmcli
from lmcli.bench.synthetic import TEXT_PROMPTS
from lmcli.generation.loop import positions_from_mask
from lmcli.io import compiled_cache
from lmcli.machine import cpu_model_and_flags
from lmcli.models import compiled_prefill, compiled_step

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 16  # the tiny llama holds 64 positions: chunks of 16 and a rest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(directory))
    monkeypatch.setattr(compiled_prefill, "CHUNK", CHUNK)
    return directory


def _prefill(model, ids, capacity=60, chunk=None):
    """The last token's logits of a prefill of `ids` [1, T] into a fresh cache, through forward_slots
    (the program where one is installed; with `chunk`, one call per `chunk` tokens and one for the rest),
    and that cache's keys and values."""
    cache = model.init_cache(1, capacity)
    slot_is_token = torch.ones((1, capacity), dtype=torch.bool)
    length = ids.shape[1]
    positions = positions_from_mask(slot_is_token[:, :length])
    cuts = [*range(0, length, chunk or length), length]
    with torch.inference_mode():
        for start, end in itertools.pairwise(cuts):
            logits = model.forward_slots(ids[:, start:end], positions[:, start:end], torch.arange(start, end),
                                         slot_is_token, cache, last_only=True)
    return logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _planned(model):
    """A CachedPrefill whose 'program' is the exported module run eagerly."""
    step = compiled_step.DecodeStep(model)
    prefill = compiled_prefill.CachedPrefill(model)
    prefill.runner = lambda *args: step(*args)
    return prefill


@pytest.mark.parametrize("length", [CHUNK, 2 * CHUNK + 3, 2 * CHUNK + 7, 3 * CHUNK])
def test_the_exported_chunks_run_eagerly_are_eager_prefill_bit_for_bit(tiny_int4, length):
    """Against eager prefill in the same chunks (eager itself, a prompt in one call against the same
    prompt in chunks, differs by a float32 rounding at some lengths: 4.8e-7 at 2 * CHUNK + 3)."""
    model = tiny_int4
    (ids,) = prompts([length])
    want, want_cache = _prefill(model, ids[None], chunk=CHUNK)
    model._compiled_prefill = _planned(model)
    got, got_cache = _prefill(model, ids[None])
    assert got.shape == want.shape == (1, 1, model.config.vocab_size)
    assert torch.equal(got, want)
    for (k, v), (k_want, v_want) in zip(got_cache, want_cache, strict=True):
        assert torch.equal(k, k_want) and torch.equal(v, v_want)


def test_what_the_program_does_not_take_runs_eagerly(tiny_int4):
    model = tiny_int4
    prefill = model._compiled_prefill = compiled_prefill.CachedPrefill(model)
    prefill.runner = lambda *args: pytest.fail("the program was called")
    (short,) = prompts([CHUNK - 1])
    _prefill(model, short[None])  # shorter than a chunk
    cache = model.init_cache(2, 40)
    rows = torch.stack(prompts([CHUNK + 3, CHUNK + 3]))
    assert not prefill.takes(rows, torch.arange(CHUNK + 3), torch.ones(2, 40, dtype=torch.bool), cache)  # a batch
    padded = torch.ones(1, 40, dtype=torch.bool)
    padded[0, 0] = False
    assert not prefill.takes(rows[:1], torch.arange(CHUNK + 3), padded, model.init_cache(1, 40))  # a pad query


def test_compile_decode_installs_the_prefill_program_only_where_it_can_pay(tiny_int4, monkeypatch):
    model = tiny_int4
    monkeypatch.setattr(compiled_prefill, "pays_here", lambda: False)  # this CPU's case: no AMX
    assert model.compile_decode() and model._compiled_prefill is None
    monkeypatch.setattr(compiled_prefill, "pays_here", lambda: True)
    assert model.compile_decode()
    installed = model._compiled_prefill
    assert isinstance(installed, compiled_prefill.CachedPrefill) and installed.autotune


def test_the_chunk_plan_masks_what_a_query_may_not_see():
    slot_is_token = torch.ones(1, 50, dtype=torch.bool)
    index, mask = compiled_prefill.chunk_plan(slot_is_token, torch.arange(30, 34), 34, torch.bfloat16)
    assert index.shape == (1, 64) and mask.shape == (1, 4, 1, 64)
    visible = mask[0, :, 0] == 0  # (T, P)
    assert index[0, :34].tolist() == list(range(34))
    assert [int(row.sum()) for row in visible] == [31, 32, 33, 34]  # each query: the keys up to its own slot
    assert not visible[:, 34:].any()  # the padding is never seen


# --- the cache, with a stand-in builder ----------------------------------------------------------------


def _fake_build(calls, content=b"program"):
    def build(model, path, autotune):
        calls.append(path)
        path.write_bytes(content)
    return build


def test_the_program_is_built_once_then_loaded_and_a_damaged_entry_is_rebuilt(tiny_int4, cache, monkeypatch, capfd):
    model = tiny_int4
    calls: list = []
    monkeypatch.setattr(compiled_prefill, "build", _fake_build(calls))
    loaded: list = []
    step = compiled_step.DecodeStep(model)

    def load(package):
        loaded.append(package.read_bytes())
        return lambda *args: step(*args)

    monkeypatch.setattr(compiled_step, "_load", load)
    monkeypatch.setattr(compiled_prefill, "pays_here", lambda: True)  # as on a CPU with AMX
    (ids,) = prompts([2 * CHUNK + 3])
    want, _ = _prefill(model, ids[None], chunk=CHUNK)
    assert model.compile_decode() and isinstance(model._compiled_prefill, compiled_prefill.CachedPrefill)
    capfd.readouterr()
    got, _ = _prefill(model, ids[None])
    assert torch.equal(got, want) and len(calls) == 1 and loaded == [b"program"]
    err = capfd.readouterr().err
    assert f"compiling the prefill of llama-32x2 in chunks of {CHUNK} tokens" in err and " done in " in err
    (entry, _), = compiled_cache.entries()
    assert f"-prefill{CHUNK}-b1-" in entry.name
    # Its key is the decode step's and what makes it a prefill program: never the decode step's entry.
    key = compiled_prefill.cache_key(model, True)
    assert key == {**compiled_cache.cache_key(model, 1), "program": "prefill", "chunk": CHUNK, "autotune": True}
    assert compiled_cache.entry_path(f"llama-32x2-prefill{CHUNK}", key) == entry
    # A later process (a new CachedPrefill): loaded, not built.
    assert model.compile_decode()
    assert torch.equal(_prefill(model, ids[None])[0], want) and len(calls) == 1 and len(loaded) == 2
    assert "compiling" not in capfd.readouterr().err
    # A damaged package: one note, built again.
    (entry / compiled_cache.PACKAGE).write_bytes(b"progran")
    assert model.compile_decode()
    assert torch.equal(_prefill(model, ids[None])[0], want) and len(calls) == 2
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "building it again" in notes[0]


def test_a_failing_build_prefills_eagerly_with_one_warning(tiny_int4, cache, monkeypatch, capfd):
    model = tiny_int4

    def failing(*args):
        raise RuntimeError("C++ compile error: no working compiler\nmore")

    monkeypatch.setattr(compiled_prefill, "build", failing)
    monkeypatch.setattr(compiled_prefill, "pays_here", lambda: True)
    (ids,) = prompts([2 * CHUNK])
    want, want_cache = _prefill(model, ids[None])
    assert model.compile_decode()
    capfd.readouterr()
    for _ in range(2):  # the second prompt does not try again
        got, got_cache = _prefill(model, ids[None])
        assert torch.equal(got, want)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(got_cache, want_cache, strict=True))
    progress, warning = capfd.readouterr().err.strip().splitlines()
    assert progress.startswith("compiling the prefill of llama-") and progress.endswith(" ... failed")
    [marker] = (cache / "compiled").glob("*.bad")
    assert warning == ("warning: compiled prefill failed (building it failed: C++ compile error: no working "
                       f"compiler; recorded in {marker}, not tried again); prefilling without it")
    assert compiled_cache.entries() == []
    # Recorded once: a later process (a new CachedPrefill) does not build it again.
    monkeypatch.setattr(compiled_prefill, "build", lambda *args: pytest.fail("a failed build was tried again"))
    assert model.compile_decode()
    capfd.readouterr()
    got, _ = _prefill(model, ids[None])
    assert torch.equal(got, want)
    [warning] = capfd.readouterr().err.strip().splitlines()
    assert "failed here before (building it failed: C++ compile error" in warning and f"delete {marker}" in warning


# --- one real build (AOTInductor on the tiny model: over 30 s) ------------------------------------------


@pytest.mark.full
@pytest.mark.parametrize("autotune", [False, True])
def test_the_compiled_prefill_agrees_with_eager_and_generates_the_same_greedy_tokens(tiny_int4, cache, capfd, autotune):
    """Built as here and (autotune) as on a CPU with AMX. The program's logits within 2^-6 of the largest
    eager logit (the decode step's tolerance: inductor fuses the norms and rotary, rounding where eager
    does with emulate_precision_casts), the same cache within bfloat16 rounding, and the same greedy tokens."""
    model = tiny_int4
    (ids,) = prompts([2 * CHUNK + 5])
    want, want_cache = _prefill(model, ids[None])
    eager_tokens = model.generate(ids[None], 8, False)
    model._compiled_prefill = compiled_prefill.CachedPrefill(model, autotune)  # the decode steps stay eager
    capfd.readouterr()
    got, got_cache = _prefill(model, ids[None])
    assert " done in " in capfd.readouterr().err
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2**-6 * float(want.abs().max()))
    # Autotuned (AMX GEMM templates) the projections round otherwise: measured 0.035 against 0.027 allowed
    # at 2^-7 in 2 of 960 keys on this AMX machine; within the logits' 2^-6.
    tolerance = 2**-6 if autotune else 2**-7
    for (k, v), (k_want, v_want) in zip(got_cache, want_cache, strict=True):
        torch.testing.assert_close(k.float(), k_want.float(), rtol=tolerance, atol=tolerance * float(k_want.abs().max()))
        torch.testing.assert_close(v.float(), v_want.float(), rtol=tolerance, atol=tolerance * float(v_want.abs().max()))
    assert torch.equal(model.generate(ids[None], 8, False), eager_tokens)
    assert model._compiled_prefill.runner is not None and not model._compiled_prefill.failed


def test_the_bench_section_reports_the_ratio_of_the_medians():
    from rich.console import Console

    from lmcli.bench import prefill as bench_prefill
    from lmcli.bench.sections import SECTIONS

    assert SECTIONS["prefill"] == "lmcli.bench.prefill"
    console = Console(record=True, width=200)
    result = {"build_s": 61.0, "used": True, "autotune": False, "eager_s": [2.0, 4.0, 3.0],
              "compiled_s": [1.0, 2.0, 9.0], "eager_chunked_s": [4.0, 4.0, 4.0],
              "max_difference": 0.1, "largest_logit": 10.0, "same_token": True, "threads": 2, "tokens": 256,
              "rounds": 3, "load_average": 1.0, "cpus": 2}
    bench_prefill.report(result, console)
    text = console.export_text()
    assert "85.3 tok/s" in text and "128.0 tok/s" in text and "1.50x" in text and "61.0 s" in text  # 256/3, 256/2
    assert "64.0 tok/s" in text and "2.00x" in text  # eager in chunks: 256/4, and 128/64
    bench_prefill.report({"error": "no compiler", "tokens": 256, "rounds": 1, "load_average": 1.0, "cpus": 2}, console)
    assert "no compiler" in console.export_text()


@pytest.mark.full  # a build of the default model: about 2 minutes
# On a CPU with AMX (inductor's bf16 GEMMs) the program's own check refuses it: KL 1.5e-3 against its 1e-3
# on the check's random text, largest difference 0.005 of the largest logit (measured 2026-12-05), so
# --compile prefills eagerly there. Strict: the day it is accepted, this says so.
@pytest.mark.xfail("amx_bf16" in cpu_model_and_flags()[1], reason="on AMX the compiled prefill fails its own check (KL 1.5e-3 > 1e-3)", strict=True)
def test_the_default_model_prefills_compiled_as_eager_within_the_stated_tolerance(smollm2_gguf, tmp_path,
                                                                                  monkeypatch):
    """The five real-model prompts as one text of more than two chunks of 64 (a prompt alone is shorter
    than a chunk), prefilled into a fresh cache: the same next token, the last logits within 2^-5 of
    the largest eager logit and a KL divergence under 5e-3 nats. Measured: 0.41 of 15.9 (2.6%), KL
    1.1e-3 at these 144 tokens; 0.17 of 18.3, KL 1.0e-4 at 216. The greedy text after it is not asserted:
    from the program's cache it parted from eager's within 16 tokens at 144 (a near tie, as for the
    decode step), not at 216."""
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LMCLI_KERNEL", "int4pack")  # compiled programs run torch's kernels (lmcli's are not exported)
    model, tokenizer = lmcli.load(smollm2_gguf)
    ids = torch.tensor([tokenizer.encode(" ".join(TEXT_PROMPTS * 4))])
    assert ids.shape[1] > 2 * compiled_prefill.CHUNK
    want, _ = _prefill(model, ids, capacity=ids.shape[1])
    model._compiled_prefill = compiled_prefill.CachedPrefill(model)
    got, _ = _prefill(model, ids, capacity=ids.shape[1])
    assert model._compiled_prefill.runner is not None and not model._compiled_prefill.failed
    got, want = got.float()[0, -1], want.float()[0, -1]
    assert int(got.argmax()) == int(want.argmax())
    torch.testing.assert_close(got, want, rtol=0, atol=2**-5 * float(want.abs().max()))
    kl = torch.sum(torch.softmax(want, -1) * (torch.log_softmax(want, -1) - torch.log_softmax(got, -1)))
    assert float(kl) < 5e-3
