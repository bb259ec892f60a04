"""A compiled program that fails is recorded as bad once and never built, loaded or tried again (issue 31,
defect 2; issue 33, "the compiled path"), a new one is checked against eager decoding before it is kept,
is built on a fixed example rather than the user's prompt, and entry.json's constants are checksummed.

The builder and loader are stand-ins (a real build takes minutes: tests/test_compile_cache.py, `full`),
as in tests/test_compile_default.py: the reference is always the same command decoded eagerly
(--no-compile), and the program stand-ins are eager's own exported step, broken on purpose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from test_compile_default import _generate, stand_ins  # noqa: F401 (fixture)

from lmcli.io import compiled_cache
from lmcli.models import compiled_step

pytestmark = pytest.mark.usefixtures("one_thread")


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def _failing_after(history: int):
    """A program as the one kept on a fresh machine (issue 33): eager's step, but an IndexError once the
    history is longer than `history` slots (the length it was built on)."""
    def load(package: Path, model, meta) -> object:
        step = compiled_step.DecodeStep(model)

        def run(*args):
            if args[4].shape[0] > history:  # the step's history, as a size
                raise IndexError("index out of range in self")
            return step(*args)
        return run
    return load


def test_a_program_that_fails_at_a_step_is_recorded_once_and_never_loaded_again(tiny_checkpoint, stand_ins,
                                                                                monkeypatch):
    eager, _ = _generate(tiny_checkpoint, "--no-compile")
    _generate(tiny_checkpoint, "--compile")  # the stand-in program, kept
    assert stand_ins["build"] == [1] and len(compiled_cache.entries()) == 1
    monkeypatch.setattr(compiled_step, "load", _failing_after(10))
    # The first plain run that meets the failure: eager's tokens, one warning that says where it is recorded.
    tokens, err = _generate(tiny_checkpoint)
    [marker] = (compiled_cache.root()).glob("*.bad")
    assert tokens == eager and _lines(err) == [
        "warning: --compile failed (the program failed at a step (IndexError: index out of range in self); "
        f"recorded in {marker}, not tried again); decoding without it"]
    assert compiled_cache.entries() == []
    # Every later plain run: nothing loaded, nothing said.
    monkeypatch.setattr(compiled_step, "load", lambda *args: pytest.fail("a failed program was loaded again"))
    for _ in range(2):
        tokens, err = _generate(tiny_checkpoint)
        assert tokens == eager and err == ""
    # --compile neither builds nor loads it again: one line says why.
    tokens, err = _generate(tiny_checkpoint, "--compile")
    [line] = _lines(err)
    assert tokens == eager and stand_ins["build"] == [1]
    assert "failed here before (the program failed at a step (IndexError" in line and f"delete {marker}" in line
    # Deleting the record is the way to try once more.
    marker.unlink()
    monkeypatch.setattr(compiled_step, "load", _failing_after(10_000))
    tokens, err = _generate(tiny_checkpoint, "--compile")
    assert tokens == eager and stand_ins["build"] == [1, 1] and len(compiled_cache.entries()) == 1


@pytest.mark.parametrize("fault", ["fails on other prompts", "rotary tables scaled", "works"])
def test_a_new_program_is_checked_against_eager_before_it_is_kept(fault, tiny_checkpoint, stand_ins, monkeypatch):
    """The real `build`, with the compiler replaced: its program (eager's exported step, or one broken as
    the kept one was) must decode the fixed text as eager does, else it is recorded as bad and not kept."""
    built = []

    def compile_stand_in(model, cache, example, package: Path) -> dict:
        built.append([tuple(t.shape) for t in example[:7]])
        package.write_bytes(b"a stand-in program")
        return {}

    def load(package: Path, model, meta) -> object:
        step = compiled_step.DecodeStep(model)

        def run(*args):
            if fault == "fails on other prompts" and args[4].shape[0] != built[0][4][0]:
                raise IndexError("index out of range in self")  # as a program specialised to its example
            logits = step(*args)
            return logits * 3 if fault == "rotary tables scaled" else logits  # numbers off, no error
        return run

    monkeypatch.setattr(compiled_step, "build", _REAL_BUILD)
    monkeypatch.setattr(compiled_step, "_build", compile_stand_in)
    monkeypatch.setattr(compiled_step, "load", load)
    eager, _ = _generate(tiny_checkpoint, "--no-compile")
    tokens, err = _generate(tiny_checkpoint, "--compile")
    assert tokens == eager and len(built) == 1
    if fault == "works":
        assert len(compiled_cache.entries()) == 1 and not list(compiled_cache.root().glob("*.bad"))
        return
    [marker] = compiled_cache.root().glob("*.bad")
    assert compiled_cache.entries() == []
    why = "it failed on the check's fixed text (IndexError" if fault.startswith("fails") else \
        "its logits differ from eager decoding's on the check's fixed text"
    assert why in json.loads(marker.read_text())["why"]
    progress, warning = _lines(err)
    assert progress.endswith(" ... failed") and why in warning and f"recorded in {marker}" in warning
    _generate(tiny_checkpoint, "--compile")  # not built again
    assert len(built) == 1


_REAL_BUILD = compiled_step.build


def test_the_program_is_built_on_a_fixed_example_whatever_the_prompt(tiny_checkpoint, stand_ins, monkeypatch):
    """The shapes export sees do not depend on the user's prompt, and none of its dynamic lengths is 0, 1 or
    equal to another that can differ from it."""
    shapes = []

    def build(model, cache, example, package: Path) -> dict:
        shapes.append([tuple(t.shape) for t in example[:7]] + [tuple(cache.layers[0].keys.shape)])
        package.write_bytes(b"a stand-in program")
        return {}

    monkeypatch.setattr(compiled_step, "build", build)
    import shutil

    for prompt in ["Hi", "Once upon a time there was a tiny model that wrote strange stories."]:
        shutil.rmtree(compiled_cache.root(), ignore_errors=True)  # built anew for each prompt
        _generate(tiny_checkpoint, "--compile", prompt=prompt)
    assert len(shapes) == 2 and shapes[0] == shapes[1]
    (_, _, _, slot_is_token, history, index, mask, keys) = shapes[0]
    lengths = {slot_is_token[1], history[0], index[1], keys[2]}
    assert len(lengths) == 4 and min(lengths) > 1 and mask[3] == index[1]


def test_scaled_constants_in_entry_json_are_rejected_and_built_again(tmp_path, monkeypatch, capfd):
    """The program's own constants (the rotary tables) live in entry.json: under a checksum, as the package."""
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path / "cache"))
    key = {"format": 1, "model": "m", "batch": 1}
    calls = []
    constants = {"extra_constants": {"rotary": {"dtype": "float32", "shape": [2], "values": [0.5, 0.25]}},
                 "weight_layout": {}}

    def build(path: Path) -> dict:
        calls.append(path)
        path.write_bytes(b"program")
        return constants

    package, program = compiled_cache.obtain_entry("tiny", key, build, "a step")
    assert program == constants and len(calls) == 1
    meta_path = package.parent / compiled_cache.META
    meta = json.loads(meta_path.read_text())
    meta["program"]["extra_constants"]["rotary"]["values"] = [1.5, 0.75]  # scaled by 3
    meta_path.write_text(json.dumps(meta))
    capfd.readouterr()
    _, program = compiled_cache.obtain_entry("tiny", key, build, "a step")
    assert program == constants and len(calls) == 2
    [note] = _lines(capfd.readouterr().err)[:1]
    assert note.startswith("note: ") and "constants" in note and "building it again" in note


def test_an_entry_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """Durability: the package, entry.json and the staging directory are fsync'd before the rename."""
    import os

    from lmcli.io import atomic

    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path / "cache"))
    events: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.rename

    def spy_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_rename(source, target) -> None:
        events.append(("rename", str(target)))
        rename(source, target)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(atomic.os, "rename", spy_rename)
    package = compiled_cache.obtain("tiny", {"format": 1, "model": "m", "batch": 1},
                                    lambda path: path.write_bytes(b"program") and None, "a step")
    entry = package.parent
    renamed = events.index(("rename", str(entry)))
    synced = {Path(path).name for kind, path in events[:renamed] if kind == "fsync"}
    assert {compiled_cache.PACKAGE, compiled_cache.META} <= synced
    assert any(name.startswith(f".{entry.name}.partial-") for name in synced)  # the directory itself


def test_the_record_of_a_bad_program_is_keyed(tmp_path, monkeypatch):
    """A record for another key (another torch, model or batch size) does not stop this one's build."""
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path / "cache"))
    key = {"format": 1, "model": "m", "batch": 1}
    compiled_cache.record_bad("tiny", dict(key, model="other"), "it failed")
    assert compiled_cache.known_bad("tiny", key) is None
    assert compiled_cache.known_bad("tiny", dict(key, model="other")) == "it failed"
    marker = compiled_cache.bad_marker(compiled_cache.entry_path("tiny", key))
    marker.write_text(json.dumps({"key": dict(key, model="other"), "why": "copied"}))  # under another key's name
    assert compiled_cache.known_bad("tiny", key) is None
    assert compiled_cache.obtain("tiny", key, lambda path: path.write_bytes(b"p") and None, "a step").is_file()
    torch.set_num_threads(1)
