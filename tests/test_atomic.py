"""io/atomic.py, the one write-a-temporary-then-rename: a target is either the old one or the new one,
never half written, and a failed or killed writer's temporary does not outlive the next write."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmcli.io.atomic import atomic_file, replace_directory, write_atomically


def test_write_atomically_replaces_the_whole_file_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    write_atomically(target, "new é")
    assert target.read_bytes() == "new é".encode()
    write_atomically(target, b"\x00bytes", durable=True)
    assert target.read_bytes() == b"\x00bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("killed midway")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_dead_writers_temporary_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "out.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f".out.json.partial-{int(dead.stdout)}-abcd"
    leftover.write_text("from a killed run")
    write_atomically(target, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_replace_directory_moves_aside_a_directory_already_there(tmp_path):
    target, staging = tmp_path / "entry", tmp_path / "staging"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "stale.bin").write_bytes(b"stale")
    staging.mkdir()
    (staging / "fresh.bin").write_bytes(b"fresh")
    replace_directory(staging, target)
    assert [p.name for p in target.iterdir()] == ["fresh.bin"] and (target / "fresh.bin").read_bytes() == b"fresh"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
