"""`lmcli bench --sections job` (lmcli/bench/job.py) on a tiny int4 model: what it reports against what
the test wrote into the job and counts in the rows itself."""

from __future__ import annotations

import io
import json
import types

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from rich.console import Console

import lmcli
from lmcli.bench import job as bench_job
from lmcli.generation.rows import prepare_row
from lmcli.settings.generation_settings import GenerationSettings

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_job_bench_runs_both_schedulers_and_a_full_batch_without_stops(tiny_checkpoint, tmp_path, monkeypatch):
    model, tokenizer = lmcli.load(tiny_checkpoint, quantize="int4")  # batch-invariant: both schedulers agree
    monkeypatch.setattr(lmcli, "load", lambda resolved: (model, tokenizer))
    asked = [3, 9, 5, 14, 2]
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps({"id": i, "prompt": f"tell me about the number {i}", "max_new_tokens": n,
                                       "temperature": [0, 0.8][i % 2], "seed": 7 + i}) + "\n"
                           for i, n in enumerate(asked)), encoding="utf-8")
    # Row 0 is greedy: make its first token an end-of-text token, so that it stops at once in the job,
    # and only ignoring EOS keeps it running in the full batch.
    first = prepare_row(tokenizer, 0, "tell me about the number 0", GenerationSettings(chat=True).for_row({}))
    stop = int(model.generate(torch.tensor([first.prompt_ids]), max_new_tokens=1, do_sample=False)[0, -1])
    monkeypatch.setattr(tokenizer, "eos_token_ids", [stop])
    settings = types.SimpleNamespace(batch_sizes=(2,), job_file=str(job), job_rows=len(asked))
    result = bench_job.measure(settings, None, lambda message: None)

    assert result["batch_size"] == 2 and result["same_rows"] is True
    for figures in result["runs"].values():
        assert figures["rows"] == len(asked) and figures["finished_at_eos"] >= 1
        assert figures["reference"]["occupancy"] == 1.0  # no row stopped early, none waited
        assert 0 < figures["tokens"] <= sum(asked)
        # The full batch is the job's first two rows, each making the most tokens the first two ask for.
        assert figures["reference"]["row_tokens"] == max(asked[:2])
        assert figures["reference"]["tokens_per_s"] > 0 and figures["greedy"]["tokens_per_s"] > 0
    continuous = result["runs"]["continuous"]
    assert continuous["prefill_requested"] >= continuous["prefill_computed"] > 0
    out = io.StringIO()
    bench_job.report(result, Console(file=out, width=200))
    assert "same completions from both schedulers: yes" in out.getvalue()
