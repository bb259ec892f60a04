"""A batch job killed with SIGKILL at several moments, then resumed: every row exactly once, each row
identical to the one an uninterrupted run writes (string, integer and look-alike ids; seeded sampling)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from cli_fixtures import subprocess_env, tiny_checkpoint  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli.cli import app
from lmcli.io.output_lock import lock_path

pytestmark = pytest.mark.usefixtures("one_thread")


def job_input(path, rows: int = 24):
    """JSONL rows with string ids, integer ids and ids that look alike (7 and "7"); some with their own seed."""
    lines = []
    for i in range(rows):
        row_id = [f"row-{i}", i, str(i - 1)][i % 3]  # ..., 6, "6", ... : an int and a string that look alike
        row = {"id": row_id, "prompt": f"prompt {i}: Привет 🙂"}
        if i % 4 == 0:
            row["seed"] = 1000 + i
        lines.append(json.dumps(row, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return rows


def start(flags, out):
    return subprocess.Popen([sys.executable, "-m", "lmcli", "generate", *map(str, flags), "--output", str(out), "--resume"],
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kill_when(job, ready, what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None and not ready():
        time.sleep(0.01)
    assert job.poll() is None, f"the job ended before {what}: {job.stderr.read().decode()}"
    job.send_signal(signal.SIGKILL)
    job.wait()


def lines_in(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_at_several_moments_then_resume(tiny_checkpoint, tmp_path):
    source = tmp_path / "in.jsonl"
    rows = job_input(source)
    out, reference = tmp_path / "out.jsonl", tmp_path / "reference.jsonl"
    flags = ["-c", tiny_checkpoint, "--input", source, "-n", 10, "--seed", 7, "--temperature", 1.2, "--ignore-eos"]

    # 1. During load: the output file is open (empty), the model not yet loaded.
    job = start([*flags, "--batch-size", 4], out)
    kill_when(job, lambda: out.exists() and lines_in(out) == 0, "the output was opened")
    assert lines_in(out) == 0

    # 2. Mid-job: some rows written, not all.
    job = start([*flags, "--batch-size", 2], out)
    kill_when(job, lambda: lines_in(out) >= 3, "three rows were written")
    done_before = lines_in(out)
    assert 3 <= done_before < rows
    assert lock_path(out).exists()  # left by the kill: harmless (the flock went with the process)

    # 3. While a row is being written: the kill left a partial line (a duplicate of a finished row's id too).
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    with open(out, "ab") as f:
        f.write(json.dumps(first, ensure_ascii=False).encode()[:-9])

    result = CliRunner().invoke(app, ["generate", *map(str, flags), "--output", str(out), "--resume", "--batch-size", "3"])
    assert result.exit_code == 0, result.stderr
    assert f"{done_before} already done" in result.stderr
    assert not lock_path(out).exists()  # the resume took the stale lock file and removed it at its end

    result = CliRunner().invoke(app, ["generate", *map(str, flags), "--output", str(reference), "--batch-size", "8"])
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in reference.parent.iterdir() if p.name.endswith(".lock")) == []  # a clean end leaves none
    resumed = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    fresh = [json.loads(line) for line in reference.read_text(encoding="utf-8").splitlines()]
    key = lambda row: json.dumps(row["id"])  # noqa: E731 (7 and "7" are different ids)
    assert len(resumed) == len({key(r) for r in resumed}) == rows  # every row exactly once
    assert sorted(resumed, key=key) == sorted(fresh, key=key)  # and as an uninterrupted run writes it
