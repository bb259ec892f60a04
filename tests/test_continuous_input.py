"""A job's input is read as it is consumed (job_input.JobRows): a large file is never held in memory,
its rows are counted and its duplicate ids refused as read_rows refuses them."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from lmcli.errors import UsageError
from lmcli.jobs.input import JobRows, read_rows
from lmcli.settings.generation_settings import GenerationSettings


def test_a_large_input_is_streamed_in_bounded_memory(tmp_path):
    path = tmp_path / "big.txt"
    count = 3000
    path.write_text("".join(f"prompt number {i} with some words after it\n" for i in range(count)), encoding="utf-8")
    settings = GenerationSettings()
    tracemalloc.start()
    try:
        rows = JobRows(path, settings)
        seen = 0
        for row in rows:
            seen += 1
            assert row.id == seen and row.prompt == f"prompt number {seen - 1} with some words after it"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(rows) == seen == count
    # Held as a list (read_rows), these rows take 1.1 MB (about 380 bytes each); streamed, nothing stays
    # (a plain-text row's id is its line number: the lines are only counted).
    assert peak < 2**19, peak
    share = rows[1::4]  # a data-parallel rank's share, as lazy
    assert [row.id for row in share][:3] == [2, 6, 10] and len(share) == count // 4


def test_streamed_rows_match_read_rows_and_refuse_duplicates(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": i, "prompt": f"p{i}"}) for i in range(5)] + ["{bad", "", json.dumps({"prompt": "x"})]
    path.write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    settings = GenerationSettings()
    assert list(JobRows(path, settings)) == read_rows(path, settings)
    assert [row.id for row in JobRows(path, settings).where(lambda row: row.error is None)] == [0, 1, 2, 3, 4, 8]
    path.write_text(path.read_text(encoding="utf-8") + json.dumps({"id": 3, "prompt": "again"}) + "\n",
                    encoding="utf-8")
    with pytest.raises(UsageError, match="input lines 4 and 9 have the same id 3"):
        JobRows(path, settings)


READ_ALL = """
import resource, sys
from pathlib import Path
from lmcli.jobs.input import JobRows, read_rows
from lmcli.settings.generation_settings import GenerationSettings
path, how = Path(sys.argv[1]), sys.argv[2]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = JobRows(path, GenerationSettings()) if how == "stream" else read_rows(path, GenerationSettings())
seen, last = 0, None
for row in rows:
    seen += 1
    last = row
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # ru_maxrss is in kB on Linux
print(len(rows), seen, last.id, last.prompt, grown)
"""


def test_a_million_row_input_is_read_in_bounded_memory(tmp_path):
    """1,000,000 plain-text rows, counted and read through in a fresh process: its peak memory grows by
    a few MB (the rows held at once, as read_rows holds a small file, would take about 300 MB)."""
    import subprocess
    import sys

    from cli_fixtures import subprocess_env

    count = 1_000_000
    path = tmp_path / "million.txt"
    path.write_text("".join(f"row {i}\n" for i in range(count)), encoding="utf-8")  # 12 MB
    done = subprocess.run([sys.executable, "-c", READ_ALL, str(path), "stream"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    total, seen, last_id, *last_prompt, grown = done.stdout.split()
    assert int(total) == int(seen) == count and int(last_id) == count and last_prompt == ["row", str(count - 1)]
    assert int(grown) < 16 * 2**20, grown  # planted check: "list" instead of "stream" grows by ~300 MB



def test_input_hash_is_the_documented_json_digest():
    """input_hash writes the settings' JSON once per settings (input_hasher); its digest must stay that of
    the whole payload, which --resume compares with rows written before."""
    import dataclasses
    import hashlib

    from lmcli.settings.generation_settings import SPECULATION, input_hash

    settings = GenerationSettings(temperature=0.5, stop=("\n\n", "é"), seed=3)
    # the settings that decide a sampled row's text: all compared fields, speculation's where set
    # (the beam fields, newer than earlier outputs' hashes, only where set)
    values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
              if f.compare and (f.name not in SPECULATION or getattr(settings, f.name))
              and not (f.name in ("num_beams", "length_penalty", "early_stopping", "lora")
                       and getattr(settings, f.name) is None)}
    for prompt in ["plain", 'quote " and \\ backslash\nnewline\ttab', "ünïcode ✓ \u2028 \x01",
                   [{"role": "user", "content": "hi"}, {"content": "x", "role": "system"}]]:
        payload = json.dumps({"prompt": prompt, "settings": values}, sort_keys=True, ensure_ascii=False)
        assert input_hash(prompt, settings) == hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def test_resume_keeps_a_record_per_finished_row_not_the_rows(tmp_path):
    """--resume reads a finished output as a stream and keeps each row's id, input hash and (shared)
    model record, never its text: 2,000 rows of 10 kB each (a 20 MB output) take about 1 MB to resume."""
    from lmcli.jobs.runner import output_row_key, read_finished

    model = {"name": "m", "fingerprint": "sha256:abc"}
    rows = [{"id": i, "completion": "x" * 10_000, "model": model, "input_hash": f"h{i}"} for i in range(2000)]
    rows[7] = {"id": 7, "error": "failed", "input_hash": "h7"}  # retried: dropped from the file
    path = tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"id": 2000, "compl', encoding="utf-8")
    tracemalloc.start()
    try:
        finished = read_finished(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(finished) == 1999 and '7' not in finished
    key, failed, record = output_row_key(finished["5"])
    assert (key, failed, record["input_hash"], record["model"]) == ("5", False, "h5", model)
    assert peak < 2**21, peak  # the whole file at once: 20 MB; the rows as parsed: 40 MB
    # The file was tidied (the failed row and the torn last line gone), through a stream as well.
    assert path.read_text(encoding="utf-8") == "".join(json.dumps(row) + "\n" for i, row in enumerate(rows) if i != 7)


def test_a_repeated_id_far_from_its_first_line_is_refused(tmp_path):
    """The ids' digests are sorted before neighbours are compared: a repeat 2,000 lines on is found."""
    path = tmp_path / "in.jsonl"
    rows = [{"id": f"r{i}", "prompt": "p"} for i in range(2000)] + [{"id": "r5", "prompt": "again"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(UsageError, match='input lines 6 and 2001 have the same id "r5"'):
        JobRows(path, GenerationSettings())
