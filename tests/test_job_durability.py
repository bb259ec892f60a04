"""Jobs keep every finished row, observed from outside: an `os.fsync` spy, a rewrite made to fail, and
output files laid out by the test.

No outside library decides what "durable" means here; the references are the operating system's own
calls (which file each fsync reached, what the file held at that moment) and the bytes the test wrote.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def job(checkpoint, source, out, *flags):
    return cli("generate", "-c", checkpoint, "--greedy", "-n", 3, "--ignore-eos", "--batch-size", 2,
               "--input", source, "--output", out, *flags)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def fd_path(fd: int) -> str:
    return os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))


def test_each_finished_row_is_fsynced_as_it_is_written(tmp_path, tiny_checkpoint, monkeypatch):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(source, [{"id": i, "prompt": p} for i, p in enumerate(["a", "bb", "ccc", "dddd", "eeeee"])])
    lines_at_fsync: list[int] = []
    real_fsync = os.fsync

    def spy(fd):
        if fd_path(fd) == os.path.realpath(out):
            with open(out, "rb") as f:
                lines_at_fsync.append(f.read().count(b"\n"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    result = job(tiny_checkpoint, source, out)
    assert result.exit_code == 0, result.output
    # every row reached the disk on its own: an fsync saw 1 line, then 2, ... then 5
    assert sorted(set(lines_at_fsync)) == [1, 2, 3, 4, 5]


def test_a_resume_whose_rewrite_fails_leaves_the_output_as_it_was(tmp_path, tiny_checkpoint, monkeypatch):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(source, [{"id": i, "prompt": p} for i, p in enumerate(["a", "bb", "ccc"])])
    assert job(tiny_checkpoint, source, out).exit_code == 0
    lines = out.read_bytes().splitlines(keepends=True)
    killed = lines[0] + lines[1][:15]  # a kill mid-write: the tidy-up must rewrite the file
    out.write_bytes(killed)
    real_fsync = os.fsync

    def full_disk(fd):
        if fd_path(fd) != os.path.realpath(out):  # the rewrite's temporary file
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    result = job(tiny_checkpoint, source, out, "--resume")
    assert result.exit_code == 1, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output
    assert out.read_bytes() == killed  # nothing lost, nothing half-replaced
    monkeypatch.setattr(os, "fsync", real_fsync)
    result = job(tiny_checkpoint, source, out, "--resume")  # and the next resume finishes the job
    assert result.exit_code == 0, result.output
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == [0, 1, 2]


def test_a_duplicate_id_on_two_complete_lines_is_refused(tmp_path, tiny_checkpoint):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(source, [{"id": "x", "prompt": "a"}, {"id": "y", "prompt": "b"}])
    assert job(tiny_checkpoint, source, out).exit_code == 0
    first = out.read_text().splitlines(keepends=True)[0]
    out.write_text(first + first)  # the same finished row twice
    before = out.read_bytes()
    result = job(tiny_checkpoint, source, out, "--resume")
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and str(out) in result.stderr and '"x"' in result.stderr
    assert out.read_bytes() == before


# Each row field and two values it can take; changing it must make --resume refuse the old row.
CHANGES = [
    ("temperature", 0.7, 0.9), ("top_p", 0.8, 0.9), ("top_k", 3, 4), ("min_p", 0.1, 0.2),
    ("typical_p", 0.8, 0.9), ("repetition_penalty", 1.1, 1.2), ("presence_penalty", 0.5, 0.6),
    ("frequency_penalty", 0.5, 0.6), ("seed", 1, 2), ("stop", ["zz"], ["zy"]), ("max_new_tokens", 3, 4),
    ("no_repeat_ngram_size", 2, 3), ("min_new_tokens", 1, 2), ("logit_bias", {"5": 1}, {"5": 2}),
]


@pytest.mark.parametrize("field, before, after", CHANGES, ids=[c[0] for c in CHANGES])
def test_resume_refuses_when_any_row_setting_changes(tmp_path, tiny_checkpoint, field, before, after):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    sampled = field not in ("max_new_tokens", "stop", "no_repeat_ngram_size", "min_new_tokens", "logit_bias",
                            "repetition_penalty", "presence_penalty", "frequency_penalty")
    base = {"id": "r", "prompt": "Hello"} if not sampled else {"id": "r", "prompt": "Hello", "temperature": 0.8,
                                                               "seed": 0}
    write_rows(source, [{**base, field: before}])
    flags = ("-c", tiny_checkpoint, "--input", source, "--output", out)
    assert cli("generate", *flags).exit_code == 0
    unchanged = cli("generate", *flags, "--resume")
    assert unchanged.exit_code == 0 and "1 already done" in unchanged.stderr, unchanged.output
    write_rows(source, [{**base, field: after}])
    result = cli("generate", *flags, "--resume")
    assert result.exit_code == 1 and "is not the row that produced it" in result.stderr, (field, result.output)
