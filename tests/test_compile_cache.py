"""The cache of compiled decode steps (io/compiled_cache.py, models/compiled_step.py).

The program itself against eager decoding on a tiny int4 llama (one build, the only slow case here),
and the cache's rules with a stand-in builder that writes a file: stale, damaged, a build killed
midway, two builders at once, an unwritable cache and a failing build."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from tiny import (
    left_pad,
    prompts,
    save_reference,
    tiny_int4,  # noqa: F401 (fixture)
)

import lmcli
from lmcli.bench.synthetic import TEXT_PROMPTS
from lmcli.io import compiled_cache
from lmcli.models import compiled_step

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = {"format": 1, "model": "m", "batch": 1}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(directory))
    return directory


def _writer(content: bytes = b"program"):
    calls = []

    def build(path: Path) -> None:
        calls.append(path)
        path.write_bytes(content)
    return build, calls


# --- the program against eager decoding --------------------------------------------------------


def _eager_and_step_logits(model, ids, mask, n, forced=None):
    """Greedy tokens of eager decoding, and each one-token step's logits eager and compiled on the same inputs
    (`forced`: the tokens to take instead of the greedy ones, a fixed text: [B, n])."""
    runner, pairs = model._compiled_decode, []

    def both(*args):
        input_ids, positions, query_slots, slot_is_token, cache, slot_end, last_only = args
        saved = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        got = runner(*args)
        for layer, (k, v) in zip(cache.layers, saved):  # the eager step writes the same keys again
            layer.keys.copy_(k)
            layer.values.copy_(v)
        want = model._forward_slots(input_ids, positions, query_slots, slot_is_token, cache, slot_end, last_only)
        pairs.append((got[:, -1].float(), want[:, -1].float()))
        return want

    def force(input_ids, logits):  # the next token of the fixed text, whatever the logits say
        step = input_ids.shape[1] - ids.shape[1]
        chosen = torch.full_like(logits, float("-inf"))
        return chosen.scatter_(-1, forced[:, step:step + 1], 0.0)

    model._compiled_decode = both
    tokens = model.generate(ids, n, False, attention_mask=mask, logits_processors=None if forced is None else [force])
    model._compiled_decode = runner
    return tokens, pairs


def _mean_kl(pairs) -> float:
    """Mean KL(eager || compiled) of the next-token distributions over the steps (and rows) of `pairs`."""
    from lmcli.bench.measure import mean_kl_divergence

    got = torch.cat([g for g, _ in pairs]).log_softmax(-1)
    want = torch.cat([w for _, w in pairs]).log_softmax(-1)
    return mean_kl_divergence(want, got)


KL_TOLERANCE = 1e-3  # nats, mean over a fixed text: the compiled step's stated tolerance (README)


@pytest.mark.full  # an AOTInductor build of the tiny model: 30 s with warm inductor caches, 70-95 s cold
def test_the_compiled_step_decodes_as_eager_and_a_later_process_loads_it(tiny_int4, cache, capfd):
    model = tiny_int4
    assert model.batch_invariant and model.dtype == torch.bfloat16
    (ids,) = prompts([9])
    ids = ids[None]
    model._compiled_decode = None
    eager = model.generate(ids, 10, False)
    assert model.compile_decode() and isinstance(model._compiled_decode, compiled_step.CachedDecode)
    capfd.readouterr()
    assert torch.equal(model.generate(ids, 10, False), eager)
    err = capfd.readouterr().err
    assert "compiling the decode step of llama-" in err and "for batch 1" in err and " done in " in err
    assert len(compiled_cache.entries()) == 1
    # Each step's logits, compiled against eager on the same cache: within a bfloat16 rounding of the
    # largest logit (inductor fuses the norms and rotary differently), and the same greedy token.
    tokens, pairs = _eager_and_step_logits(model, ids, None, 14)  # a longer run: other history lengths
    assert torch.equal(tokens[:, :eager.shape[1]], eager) and len(pairs) == 13
    for got, want in pairs:
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * float(want.abs().max()))
    # A new model object, as in a later process: the entry is loaded, nothing is built.
    model._compiled_decode = None
    assert model.compile_decode()
    assert torch.equal(model.generate(ids, 10, False), eager)
    assert "compiling" not in capfd.readouterr().err
    # A left-padded batch of 2 runs its own program: each row's logits as eager's, within the same tolerance
    # (a program reading its inputs with the wrong strides gave row 1 another row's tokens: error 2.6).
    batch, mask = left_pad(prompts([3, 9]))
    tokens, pairs = _eager_and_step_logits(model, batch, mask, 8)
    assert "for batch 2" in capfd.readouterr().err and len(compiled_cache.entries()) == 2 and len(pairs) == 7
    for got, want in pairs:
        for row in range(2):
            torch.testing.assert_close(got[row], want[row], rtol=0, atol=2**-6 * float(want[row].abs().max()))
    # Over a fixed text (tokens forced, not chosen), the next-token distributions: mean KL within tolerance.
    text = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    _, pairs = _eager_and_step_logits(model, ids, None, 40, forced=text)
    assert len(pairs) == 39 and _mean_kl(pairs) <= KL_TOLERANCE
    print(f"tiny int4 llama: mean KL over 39 forced tokens {_mean_kl(pairs):.2e}")
    # The program runs on the model's own tensors, not a copy: changed in place, its logits follow.
    head = model.model.norm.weight
    with torch.no_grad():
        head.mul_(-2.0)
    _, pairs = _eager_and_step_logits(model, ids, None, 4)
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * float(want.abs().max()))
    with torch.no_grad():
        head.div_(-2.0)


def test_the_exported_step_run_eagerly_is_eager_decoding_bit_for_bit(tiny_int4):
    """What is exported (the host's key plan as two tensors, one attention call per row on them) against
    the batch-invariant path it stands for, on a left-padded batch: the same logits, bit for bit."""
    model = tiny_int4
    step = compiled_step.DecodeStep(model)

    def planned(input_ids, positions, query_slots, slot_is_token, cache, slot_end, last_only):
        return step(*compiled_step.step_inputs(model, input_ids, positions, query_slots, slot_is_token, cache,
                                               slot_end))

    ids, mask = left_pad(prompts([3, 9, 40]))  # 40: the plan's padding past one KEY_BLOCK
    model._compiled_decode = planned
    _, pairs = _eager_and_step_logits(model, ids, mask, 8)
    assert len(pairs) == 7
    for got, want in pairs:
        assert torch.equal(got, want)


def test_the_exported_steps_attention_runs_on_one_thread_at_any_count(tiny_int4, monkeypatch):
    """The exported step's attention is one op (`row_attention.attend_rows`, which the program calls back):
    at 2 threads its per-row calls run on one, as eager's do, and the count is 2 again after it."""
    from lmcli.models import row_attention

    # The torch row calls, whose thread rule this is: the native kernel (the default where it builds) runs
    # each query on one thread by construction (tests/test_flash_attention.py).
    monkeypatch.setenv("LMCLI_ATTENTION", "torch")
    model, seen, attend = tiny_int4, [], row_attention.attend_gathered

    def spy(*args):
        seen.append(torch.get_num_threads())
        return attend(*args)

    monkeypatch.setattr(row_attention, "attend_gathered", spy)
    step = compiled_step.DecodeStep(model)
    model._compiled_decode = lambda *a: step(*compiled_step.step_inputs(model, *a[:-1]))
    torch.set_num_threads(2)
    try:
        ids, mask = left_pad(prompts([3, 9]))
        model.generate(ids, 3, False, attention_mask=mask)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
        model._compiled_decode = None
    assert seen and set(seen) == {1}


# --- the cache's rules, with a stand-in builder ------------------------------------------------------


def test_a_built_entry_is_used_and_a_stale_one_is_not(cache, capfd):
    build, calls = _writer()
    first = compiled_cache.obtain("tiny", KEY, build, "a step")
    assert first.read_bytes() == b"program" and len(calls) == 1
    assert "compiling a step" in capfd.readouterr().err
    assert compiled_cache.obtain("tiny", KEY, build, "a step") == first and len(calls) == 1
    other = dict(KEY, model="another")  # another key: another entry, built anew, the first one kept
    assert compiled_cache.obtain("tiny", other, build, "a step") != first and len(calls) == 2
    assert first.is_file()
    # An entry whose recorded key differs from its name's (copied, or written by other code) is refused.
    meta = json.loads((first.parent / compiled_cache.META).read_text())
    (first.parent / compiled_cache.META).write_text(json.dumps(dict(meta, key=dict(KEY, threads=99))))
    capfd.readouterr()
    assert compiled_cache.obtain("tiny", KEY, build, "a step") == first and len(calls) == 3
    assert "built for another model" in capfd.readouterr().err


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "no entry.json", "garbage entry.json"])
def test_a_damaged_entry_is_deleted_with_a_note_and_built_again(damage, cache, capfd):
    build, calls = _writer(b"x" * 5000)
    package = compiled_cache.obtain("tiny", KEY, build, "a step")
    if damage == "flip a byte":
        data = bytearray(package.read_bytes())
        data[2500] ^= 1
        package.write_bytes(bytes(data))
    elif damage == "truncate":
        package.write_bytes(package.read_bytes()[:100])
    elif damage == "no entry.json":
        (package.parent / compiled_cache.META).unlink()
    else:
        (package.parent / compiled_cache.META).write_bytes(b"\x00{not json")
    capfd.readouterr()
    assert compiled_cache.obtain("tiny", KEY, build, "a step") == package and len(calls) == 2
    assert package.read_bytes() == b"x" * 5000
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "building it again" in notes[0]


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from lmcli.io import compiled_cache
    def build(path):
        path.write_bytes(b"half a progr")
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)  # both builders are now between building and placing
        path.write_bytes(b"program " + sys.argv[1].encode())
    print(compiled_cache.obtain("tiny", {"format": 1, "model": "m", "batch": 1}, build, "a step").read_bytes())
""")


def _child(mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_build_killed_midway_leaves_nothing_that_looks_complete(cache):
    child = _child("kill")
    child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL
    assert compiled_cache.entries() == []  # only a hidden staging directory is left
    assert [p.name for p in (cache / "compiled").iterdir() if not p.name.startswith(".")] == []
    build, calls = _writer()
    package = compiled_cache.obtain("tiny", KEY, build, "a step")
    assert package.read_bytes() == b"program" and len(calls) == 1
    assert sorted(p.name for p in (cache / "compiled").iterdir()) == [package.parent.name]  # leftovers removed


def test_two_processes_building_at_once_leave_one_good_entry(cache):
    children = [_child("one"), _child("two")]
    outputs = [child.communicate(timeout=120)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert all(out.strip() in (b"b'program one'", b"b'program two'") for out in outputs)
    assert len(compiled_cache.entries()) == 1
    build, calls = _writer()
    assert compiled_cache.obtain("tiny", KEY, build, "a step").read_bytes() in (b"program one", b"program two")
    assert calls == []  # the entry they left checks out


def test_an_unwritable_cache_or_a_failing_build_decodes_eagerly_with_one_warning(tmp_path, cache, monkeypatch, capfd):
    save_reference("llama", tmp_path / "llama")
    model, _ = lmcli.load(tmp_path / "llama")
    (ids,) = prompts([7])
    want = model.generate(ids[None], 8, False)
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(blocker / "cache"))  # a cache that cannot be made (even by root)
    assert model.compile_decode()
    capfd.readouterr()
    assert torch.equal(model.generate(ids[None], 8, False), want)
    assert capfd.readouterr().err.strip().splitlines() == [
        f"warning: --compile failed (cannot write the compiled-program cache {blocker / 'cache' / 'compiled'} "
        "(Not a directory)); decoding without it"]
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(cache))

    def failing(*args):
        raise RuntimeError("C++ compile error: no working compiler\nmore")

    monkeypatch.setattr(compiled_step, "build", failing)
    assert model.compile_decode()
    capfd.readouterr()
    assert torch.equal(model.generate(ids[None], 8, False), want)
    progress, warning = capfd.readouterr().err.strip().splitlines()
    assert progress.startswith("compiling the decode step of llama-") and progress.endswith(" ... failed")
    [marker] = (cache / "compiled").glob("*.bad")
    assert warning == ("warning: --compile failed (building it failed: C++ compile error: no working compiler; "
                       f"recorded in {marker}, not tried again); decoding without it")
    assert compiled_cache.entries() == []
    # Recorded once: a later --compile neither builds nor loads it again, and says so in one line.
    monkeypatch.setattr(compiled_step, "build", lambda *args: pytest.fail("a failed build was tried again"))
    assert model.compile_decode()
    capfd.readouterr()
    assert torch.equal(model.generate(ids[None], 8, False), want)
    [warning] = capfd.readouterr().err.strip().splitlines()
    assert warning.startswith("warning: --compile failed (the decode step of llama-") and "failed here before (" \
        "building it failed: C++ compile error: no working compiler)" in warning and f"delete {marker}" in warning


# --- the default model (builds take minutes: `make test-full`) -----------------------------------------


@pytest.mark.full
def test_the_default_model_compiled_agrees_with_eager_up_to_a_near_tie(smollm2_gguf, cache, capfd, monkeypatch):
    """The real-model prompts, each alone (the batch-1 program) and the five as one left-padded batch (the
    batch-5 program). Each compiled step's logits, on eager's cache, within 2^-6 of the row's largest logit
    of eager's; the compiled greedy text is eager's up to the first step where eager's two best logits lie
    within twice that of each other (measured: one prompt of five parts there, at token 22); over 128
    tokens of a fixed text (the first token as the prompt) the mean KL from eager's distributions is within KL_TOLERANCE."""
    from lmcli.bench.synthetic import QUALITY_TEXT

    monkeypatch.setenv("LMCLI_KERNEL", "int4pack")  # compiled programs run torch's kernels (lmcli's are not exported)
    model, tokenizer = lmcli.load(smollm2_gguf)
    rows = [torch.tensor(tokenizer.encode(p)) for p in TEXT_PROMPTS]
    new = 24
    alone = [model.generate(row[None], new, False)[0, -new:] for row in rows]
    ids, mask = left_pad(rows)
    batched = model.generate(ids, new, False, attention_mask=mask)[:, -new:]
    assert torch.equal(batched, torch.stack(alone))  # batch-invariant (eager)
    assert model.compile_decode()

    def check(prompt_ids, prompt_mask, want_tokens):
        got_tokens = model.generate(prompt_ids, new, False, attention_mask=prompt_mask)[:, -new:]
        tokens, pairs = _eager_and_step_logits(model, prompt_ids, prompt_mask, new)  # along eager's own path
        assert torch.equal(tokens[:, -new:], want_tokens) and len(pairs) == new - 1
        for row in range(len(want_tokens)):
            near_tie = new
            for step, (got, want) in enumerate(pairs, start=1):  # pairs[i] gives token i + 1
                tolerance = 2**-6 * float(want[row].abs().max())
                torch.testing.assert_close(got[row], want[row], rtol=0, atol=tolerance)
                best = want[row].topk(2).values
                if float(best[0] - best[1]) <= 2 * tolerance:
                    near_tie = min(near_tie, step)
            differs = (got_tokens[row] != want_tokens[row]).nonzero()
            assert not len(differs) or int(differs[0]) >= near_tie, (row, got_tokens[row], want_tokens[row], near_tie)

    for row, want_tokens in zip(rows, alone):
        check(row[None], None, want_tokens[None])
    check(ids, mask, batched)
    text = torch.tensor(tokenizer.encode(QUALITY_TEXT)[:129])[None]
    _, pairs = _eager_and_step_logits(model, text[:, :1], None, 128, forced=text[:, 1:])
    kl = _mean_kl(pairs)
    print(f"default model: mean KL over 128 forced tokens {kl:.2e}")
    assert len(pairs) == 128 and kl <= KL_TOLERANCE  # the one-token prompt's own step too
    assert "compiling" in capfd.readouterr().err
    assert {entry.name.split("-b")[1].split("-")[0] for entry, _ in compiled_cache.entries()} == {"1", "5"}


def test_lmcli_info_lists_the_entries_with_their_size(cache, tmp_path):
    from lmcli.console import describe_cache

    build, _ = _writer(b"y" * 3000)
    package = compiled_cache.obtain("tiny", KEY, build, "a step")
    checkpoint = tmp_path / "model"  # any checkpoint: compiled entries are listed whatever it is
    checkpoint.mkdir()
    size = sum(f.stat().st_size for f in package.parent.iterdir())
    assert f"a compiled decode step, {size / 1024:.1f} KiB (compiled/{package.parent.name})" in describe_cache(checkpoint)
