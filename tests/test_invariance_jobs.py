"""Quantized jobs write each row as its prompt gives it alone: at --batch-size 8 what --batch-size 1
writes, and killed (SIGKILL) mid-run, then resumed at another batch size, what an uninterrupted run
writes; greedy and seeded rows alike. Tiny checkpoints under --quantize int4 and int8; the default model
and Gemma 3 as loaded by default (make test-full). The reference is always the uninterrupted
--batch-size 1 run, whose rows each have the batch to themselves."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_fixtures import subprocess_env, tiny_checkpoint  # noqa: F401 (fixture)
from real_models import gemma_gguf, smollm2_gguf  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    ("tiny", "int4"),
    pytest.param("tiny", "int8", marks=pytest.mark.full),  # int8 rows batched: test_batch_invariance.py
    pytest.param("smollm2", None, marks=pytest.mark.full),  # a minute or more each on two busy cores
    pytest.param("gemma", None, marks=pytest.mark.full),
]


def model_flags(request: pytest.FixtureRequest, name: str, kind: str | None) -> list[str]:
    if name == "tiny":
        return ["-c", str(request.getfixturevalue("tiny_checkpoint")), "--quantize", str(kind)]
    return ["-c", str(request.getfixturevalue(f"{name}_gguf"))]


def write_rows(path: Path, count: int) -> None:
    """Prompts of different lengths (so rows are padded differently in each batch); even rows greedy,
    odd ones sampled, some with their own seed and the others from the job's --seed."""
    words = ["the", "sea", "is", "a", "place", "of", "wonder", "and", "awe", "where", "ships", "sail", "on"]
    rows = []
    for i in range(count):
        row: dict = {"id": i, "prompt": " ".join(words[: 2 + (5 * i) % 11]).capitalize()}
        if i % 2 == 0:
            row["temperature"] = 0
        elif i % 4 == 1:
            row["seed"] = 100 + i
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def job_flags(source: Path, new: int) -> list[str]:
    return ["--input", str(source), "-n", str(new), "--ignore-eos", "--temperature", "1.2", "--seed", "7"]


def run_job(flags: list[str], out: Path, batch_size: int, *extra: str) -> list[dict]:
    result = CliRunner().invoke(app, ["generate", *flags, "--output", str(out), "--batch-size", str(batch_size),
                                      *extra])
    assert result.exit_code == 0, result.stderr
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda row: row["id"])


def killed_mid_run(flags: list[str], out: Path, batch_size: int, rows: int) -> int:
    """Start the job in a subprocess, SIGKILL it once some rows (not all) are written; how many were."""
    job = subprocess.Popen([sys.executable, "-m", "lmcli", "generate", *flags, "--output", str(out), "--resume",
                            "--batch-size", str(batch_size)],
                           env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    written = lambda: out.read_bytes().count(b"\n") if out.exists() else 0  # noqa: E731
    while time.monotonic() < deadline and job.poll() is None and written() < batch_size:
        time.sleep(0.01)
    assert job.poll() is None, f"the job ended before it could be killed: {job.communicate()[1].decode()}"
    job.send_signal(signal.SIGKILL)
    job.wait()
    done = written()
    assert 0 < done < rows
    return done


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_quantized_job_rows_are_as_alone_batched_and_after_kill_and_resume(name, kind, request, tmp_path):
    tiny = name == "tiny"
    count, new = (16, 8) if tiny else (10, 6)
    source = tmp_path / "in.jsonl"
    write_rows(source, count)
    flags = [*model_flags(request, name, kind), *job_flags(source, new)]
    alone = run_job(flags, tmp_path / "alone.jsonl", 1)
    assert len(alone) == count and len({row["completion"] for row in alone}) > 1  # real, different completions
    assert run_job(flags, tmp_path / "batched.jsonl", 8) == alone

    resumed_out = tmp_path / "resumed.jsonl"
    done = killed_mid_run(flags, resumed_out, 2, count)
    resumed = run_job(flags, resumed_out, 3, "--resume")  # other neighbours than the killed run gave them
    assert len(resumed) == count and [row["id"] for row in resumed] == list(range(count)), done
    assert resumed == alone
