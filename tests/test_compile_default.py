"""Which runs use a compiled decode step by default (models/compiled_step.compile_mode), through the CLI.

The builder and loader are stand-ins here (a real build takes a minute: tests/test_compile_cache.py):
`build` writes a file, `load` returns the exported step run eagerly, which is eager decoding bit for bit
(tests/test_compile_cache.py checks that), and records each call. The reference is the same command with
--no-compile. The rest of the suite runs with LMCLI_COMPILE=0 (tests/conftest.py), so no test builds or
uses a program unless it asks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli.cli import app
from lmcli.errors import UsageError
from lmcli.io import compiled_cache
from lmcli.models import compiled_step

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "Once upon a time there was"


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """Record builds and loads; the cache in a fresh directory; LMCLI_COMPILE as a user's shell has it."""
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(compiled_step.COMPILE_VAR, raising=False)
    calls: dict[str, list[int]] = {"build": [], "load": [], "threads": []}

    def build(model, cache, example, package: Path) -> dict:
        calls["build"].append(example[0].shape[0])
        package.write_bytes(b"a stand-in program")
        return {}

    def load(package: Path, model, meta) -> object:
        step = compiled_step.DecodeStep(model)
        calls["load"].append(0)

        def run(*args):
            calls["load"][-1] += 1  # steps run by this program
            calls["threads"].append(torch.get_num_threads())
            return step(*args)
        return run

    monkeypatch.setattr(compiled_step, "build", build)
    monkeypatch.setattr(compiled_step, "load", load)
    return calls


def _generate(checkpoint, *flags: str, prompt: str = PROMPT) -> tuple[list[int], str]:
    args = ["generate", "-c", str(checkpoint), "-q", "int4", "--greedy", "-n", "8", "--format", "jsonl",
            "--logprobs", "1", *flags, prompt]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    [line] = result.stdout.splitlines()
    return [step["id"] for step in json.loads(line)["logprobs"]], result.stderr


def test_by_default_a_single_prompt_runs_a_program_already_built_and_never_builds_one(tiny_checkpoint, stand_ins):
    eager, _ = _generate(tiny_checkpoint, "--no-compile")
    assert stand_ins["build"] == stand_ins["load"] == []
    # No program yet: the default decodes eagerly, builds nothing and says nothing about compiling.
    tokens, err = _generate(tiny_checkpoint)
    assert tokens == eager and stand_ins["build"] == stand_ins["load"] == [] and "compil" not in err
    # --compile builds one (with its progress line) and runs it.
    tokens, err = _generate(tiny_checkpoint, "--compile")
    assert tokens == eager and stand_ins["build"] == [1] and stand_ins["load"] == [7]
    assert "compiling the decode step of llama-" in err and "for batch 1" in err
    # Now the default runs it: every decode step through the program, nothing built.
    tokens, err = _generate(tiny_checkpoint)
    assert tokens == eager and stand_ins["build"] == [1] and stand_ins["load"] == [7, 7] and "compil" not in err
    # --no-compile, and LMCLI_COMPILE=0, decode eagerly though a program is there.
    assert _generate(tiny_checkpoint, "--no-compile")[0] == eager and stand_ins["load"] == [7, 7]


def test_the_variable_and_the_flag_choose_and_a_job_stays_eager_by_default(tiny_checkpoint, stand_ins, tmp_path,
                                                                          monkeypatch):
    _generate(tiny_checkpoint, "--compile")
    assert stand_ins["build"] == [1] and stand_ins["load"] == [7]
    monkeypatch.setenv(compiled_step.COMPILE_VAR, "0")
    _generate(tiny_checkpoint)
    assert stand_ins["load"] == [7]
    assert _generate(tiny_checkpoint, "--compile")[1].count("compiling") == 0 and stand_ins["load"] == [7, 7]
    monkeypatch.setenv(compiled_step.COMPILE_VAR, "1")  # as --compile: builds what is missing
    _generate(tiny_checkpoint, "--no-compile")  # the flag wins
    assert stand_ins["load"] == [7, 7]
    # A job decodes eagerly by default though a batch-1 program is there (its rows' tokens must not
    # depend on --batch-size), and under LMCLI_COMPILE=1 builds a program per batch size.
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPT, "The cat sat", "A B C D E F")))

    def job(*flags: str) -> list[str]:
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.jsonl"
        args = ["generate", "-c", str(tiny_checkpoint), "-q", "int4", "--greedy", "-n", "6", "--input", str(rows),
                "--output", str(out), "--batch-size", "3", *flags]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.stderr
        return [json.loads(line)["completion"] for line in out.read_text().splitlines()]

    monkeypatch.delenv(compiled_step.COMPILE_VAR)
    eager = job("--no-compile")
    assert job() == eager and stand_ins["load"] == [7, 7] and stand_ins["build"] == [1]
    monkeypatch.setenv(compiled_step.COMPILE_VAR, "1")
    assert job() == eager and 3 in stand_ins["build"] and len(stand_ins["load"]) > 2


@pytest.mark.parametrize(("flag", "env", "job", "want"), [
    (None, None, False, "cached"), (None, None, True, "off"), (None, "auto", False, "cached"),
    (None, "0", False, "off"), (None, "1", True, "build"), (None, " OFF ", False, "off"),
    (True, "0", True, "build"), (False, "1", False, "off")])
def test_compile_mode_table(flag, env, job, want):
    assert compiled_step.compile_mode(flag, job, {} if env is None else {compiled_step.COMPILE_VAR: env}) == want


def test_a_bad_lmcli_compile_is_a_usage_error(tiny_checkpoint, stand_ins, monkeypatch):
    with pytest.raises(UsageError, match="LMCLI_COMPILE='maybe': use 0"):
        compiled_step.compile_mode(None, False, {compiled_step.COMPILE_VAR: "maybe"})
    monkeypatch.setenv(compiled_step.COMPILE_VAR, "maybe")
    result = CliRunner().invoke(app, ["generate", "-c", str(tiny_checkpoint), "-n", "2", PROMPT])
    assert result.exit_code == 2 and "LMCLI_COMPILE='maybe'" in result.stderr


def test_a_float_checkpoint_stays_eager_by_default(tiny_checkpoint, stand_ins):
    """Float weights are pinned to transformers' numbers: a program runs there only when asked for."""
    from lmcli import load

    model, _ = load(tiny_checkpoint)
    assert not model.batch_invariant
    assert not model.compile_decode(builds=False) and model._compiled_decode is None
    ids = torch.tensor([[1, 5, 9]])
    model.generate(ids, 3, False)
    assert stand_ins["build"] == stand_ins["load"] == []
    assert compiled_cache.entries() == []


def test_a_program_built_for_another_thread_count_runs_and_never_on_more_threads(tiny_checkpoint, stand_ins):
    """Built at 1 thread, then a run at 2: no rebuild; the program runs with torch at 1 thread (inductor
    sized its per-thread partials by the build's count), and the thread count is 2 again after each step."""
    eager, _ = _generate(tiny_checkpoint, "--threads", "1", "--compile")
    assert stand_ins["build"] == [1] and set(stand_ins["threads"]) == {1}
    tokens, err = _generate(tiny_checkpoint, "--threads", "2")
    assert tokens == eager and stand_ins["build"] == [1] and stand_ins["load"] == [7, 7]
    assert set(stand_ins["threads"]) == {1} and torch.get_num_threads() == 2 and "compil" not in err
    torch.set_num_threads(1)


def test_by_default_a_damaged_entry_is_deleted_with_one_note_and_the_run_decodes_eagerly(tiny_checkpoint, stand_ins):
    eager, _ = _generate(tiny_checkpoint, "--compile")
    [(entry, _)] = compiled_cache.entries()
    package = entry / compiled_cache.PACKAGE
    package.write_bytes(b"A" + package.read_bytes()[1:])  # one byte changed: the checksum no longer matches
    tokens, err = _generate(tiny_checkpoint)
    assert tokens == eager and stand_ins["build"] == [1] and stand_ins["load"] == [7]
    assert [line for line in err.splitlines() if line.strip()] == [
        f"note: {entry}: {compiled_cache.PACKAGE} is not the file that was built (size or checksum differs); "
        "decoding eagerly"]
    assert compiled_cache.entries() == []


def test_by_default_with_no_program_the_start_pays_no_fingerprint(tiny_checkpoint, stand_ins, monkeypatch):
    """The model's fingerprint (tens of milliseconds on the default model) is computed only when the cache
    holds some program for this model and batch size."""
    counted = []
    fingerprint = compiled_cache.model_fingerprint

    def counting(model):
        counted.append(1)
        return fingerprint(model)

    monkeypatch.setattr(compiled_cache, "model_fingerprint", counting)
    _generate(tiny_checkpoint)
    assert counted == []
    _generate(tiny_checkpoint, "--compile")
    assert counted
