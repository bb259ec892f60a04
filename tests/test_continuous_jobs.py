"""Jobs run continuously (the default on batch-invariant models): each row as its single run writes it
(`--batch-size 1` in planned batches, i.e. generate_batch on the row alone), bad rows as error rows,
over-long prompts as today, and a SIGKILL with rows in flight at different steps loses and repeats
no row on --resume."""

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
from lmcli.generation.continuous import SCHEDULER_ENV

pytestmark = pytest.mark.usefixtures("one_thread")

COMPARED = ("completion", "completion_tokens", "finish_reason", "seed", "prompt_tokens", "error", "logprobs")


def rows_of(path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    by_id = {json.dumps(row["id"]): row for row in rows}
    assert len(by_id) == len(rows), "a row was written twice"
    return by_id


def write_job(path, count: int, new_tokens=lambda i: 3 + (i * 7) % 17) -> None:
    lines = []
    for i in range(count):
        row = {"id": i, "prompt": "a shared opening for every prompt, and then " + f"part {i} " * (1 + i % 4),
               "max_new_tokens": new_tokens(i), "temperature": [0, 0.9, 1.4][i % 3]}
        if i % 3:
            row["seed"] = 500 + i
        if i % 5 == 3:
            row["stop"] = ["e"]
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_job_rows_are_their_single_runs_with_errors_and_long_prompts(tiny_checkpoint, tmp_path, monkeypatch):
    source = tmp_path / "in.jsonl"
    write_job(source, 10)
    with source.open("a", encoding="utf-8") as f:
        f.write("{not json\n")
        f.write(json.dumps({"id": "long", "prompt": "x" * 700, "max_new_tokens": 5, "temperature": 0}) + "\n")  # > 512 positions
        f.write(json.dumps({"id": "max", "prompt": "y", "max_new_tokens": 0}) + "\n")  # below the setting's minimum
    runner = CliRunner()
    outputs = {}
    for name, scheduler, batch in (("continuous", "", 3), ("alone", "batches", 1)):
        monkeypatch.setenv(SCHEDULER_ENV, scheduler)
        out = tmp_path / f"{name}.jsonl"
        result = runner.invoke(app, ["generate", "-c", str(tiny_checkpoint), "-q", "int4", "--input", str(source),
                                     "--output", str(out), "--batch-size", str(batch), "--stats", "--logprobs", "2"])
        assert result.exit_code == 1, result.output  # the bad rows fail the job, after the others
        assert ("full" in result.stderr) == (name == "continuous")  # the summary's batch occupancy
        assert "first 194 tokens were dropped" in result.stderr  # the long prompt, truncated as before
        outputs[name] = rows_of(out)
    assert outputs["continuous"].keys() == outputs["alone"].keys() and len(outputs["alone"]) == 13
    for key, row in outputs["alone"].items():
        assert {f: row.get(f) for f in COMPARED} == {f: outputs["continuous"][key].get(f) for f in COMPARED}, key
    assert "error" in outputs["continuous"]['"max"'] and "error" in outputs["continuous"]["11"]
    assert {row["finish_reason"] for row in outputs["alone"].values() if "error" not in row} >= {"length", "stop"}


def start(flags, out, env):
    return subprocess.Popen([sys.executable, "-m", "lmcli", "generate", *map(str, flags), "--output", str(out),
                             "--resume"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def lines_in(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_with_rows_in_flight_then_resume(tiny_checkpoint, tmp_path):
    source = tmp_path / "in.jsonl"
    count = 24
    write_job(source, count, new_tokens=lambda i: 20 + (i * 13) % 41)  # rows end at many different steps
    flags = ["-c", tiny_checkpoint, "-q", "int4", "--input", source, "--batch-size", 4, "--ignore-eos"]
    env = subprocess_env()
    reference, out = tmp_path / "reference.jsonl", tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "lmcli", "generate", *map(str, flags), "--output", str(reference),
                           "--stats"], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0 and b"full" in done.stderr, done.stderr.decode()
    kills = 0
    for wanted in (5,):  # killed once some rows are written and others are in flight
        job = start(flags, out, env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None and lines_in(out) < wanted:
            time.sleep(0.005)
        if job.poll() is None:
            job.send_signal(signal.SIGKILL)
            kills += 1
        job.wait()
    assert kills >= 1, "the job finished before it could be killed"
    assert lines_in(out) < count
    job = start(flags, out, env)
    assert job.wait(timeout=300) == 0, job.stderr.read().decode() if job.stderr else ""
    got, expected = rows_of(out), rows_of(reference)
    assert got.keys() == expected.keys() and len(got) == count  # none lost, none repeated
    for key, row in expected.items():
        assert {f: row.get(f) for f in COMPARED} == {f: got[key].get(f) for f in COMPARED}, key
