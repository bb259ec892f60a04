"""A job's input is read as it is consumed (job_input.JobRows): a large file is never held in memory,
its rows are counted and its duplicate ids refused as read_rows refuses them."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from lmcli.errors import UsageError
from lmcli.job_input import JobRows, read_rows
from lmcli.settings import GenerationSettings


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
    # Held as a list (read_rows), these rows take 1.1 MB (about 380 bytes each); streamed, what stays is
    # an 8-byte digest per row (24 kB) and, for a moment, their sort (about 110 kB).
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
