"""`lmcli bench --sections server` (lmcli/bench/server.py) without starting servers: the throughput rows
are the same work as a job and as requests (read by the job reader and by the server's request parser),
llama_cpp.server is left out with a reason when it cannot run, and the report prints what was measured."""

from __future__ import annotations

import io
import json
import statistics
from typing import Any

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from rich.console import Console

import lmcli
from lmcli.bench import server as bench_server
from lmcli.generation.rows import prepare_row
from lmcli.jobs import openai_batch
from lmcli.jobs.input import read_rows
from lmcli.serve.requests import parse
from lmcli.settings.generation_settings import GenerationSettings


def test_throughput_rows_are_the_same_rows_as_a_job_and_as_requests(tiny_checkpoint, tmp_path):
    """Each row, read by the job reader (jobs/input.py) and sent as a request (serve/requests.py's parser,
    what `lmcli serve` runs): the same prompt tokens, max_tokens, greedy, and the same banned tokens."""
    model, tokenizer = lmcli.load(tiny_checkpoint)
    banned = [0, 2, 5]
    rows = bench_server.throughput_rows(5, 24, banned)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    base = GenerationSettings(chat=True)
    read = read_rows(path, base)
    assert [row.error for row in read] == [None] * len(rows)
    vocab = model.config.vocab_size
    for i, (row, job_row) in enumerate(zip(rows, read)):
        assert job_row.settings is not None and job_row.prompt is not None
        as_job = prepare_row(tokenizer, job_row.id, job_row.prompt, job_row.settings)
        body = bench_server.request_body(row)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert "stream_options" not in bench_server.request_body(row, usage=False)
        [served] = parse(openai_batch.CHAT, body, base, tokenizer, vocab, 4096, 1000 * (i + 1)).rows
        assert served.prompt_ids == as_job.prompt_ids
        for settings in (served.settings, as_job.settings):
            assert settings.max_new_tokens == 24 and settings.greedy
            assert settings.logit_bias_ids(tokenizer, vocab) == {token: -100 for token in banned}
        assert served.settings.batch_key() == as_job.settings.batch_key()  # the same decoding settings


def test_llama_cpp_left_out_with_its_reason(monkeypatch):
    assert "not a GGUF" in (bench_server.llama_cpp_missing("/models/x.safetensors") or "")
    assert "not a GGUF" in (bench_server.llama_cpp_missing(None) or "")
    monkeypatch.setattr(bench_server.importlib.util, "find_spec", lambda name: None)
    assert "make bench-deps" in (bench_server.llama_cpp_missing("/models/x.gguf") or "")
    command = bench_server.llama_cpp_command("/models/x.gguf", 8123, 3)
    # Its default would cut a stream short whenever another request waits: not the same work as lmcli's.
    assert command[command.index("--interrupt_requests") + 1] == "False"
    assert command[command.index("--n_threads") + 1] == command[command.index("--n_threads_batch") + 1] == "3"


def test_percentiles_are_nearest_rank():
    firsts = [0.5, 0.1, 0.3, 0.2, 0.4] * 20 + [9.0]
    figures = bench_server.percentiles(firsts, 120)
    assert figures == {"requests": 120, "p50": statistics.median(firsts), "p99": sorted(firsts)[99]}
    assert bench_server.percentiles([], 3) == {"requests": 3, "p50": None, "p99": None}


@pytest.mark.parametrize("llama", [True, False])
def test_report_prints_both_servers_or_why_not(llama):
    latency = {str(c): {"requests": c * 2, "p50": 0.1 * c, "p99": 0.2 * c} for c in bench_server.LATENCY_CLIENTS}
    throughput = {"rows": 16, "clients": 8, "max_tokens": 64, "rounds": 1, "served_tokens_per_s": 40.0,
                  "job_tokens_per_s": 50.0, "ratio": 0.8, "same_text": True, "equal_token_counts": True}
    result: dict[str, Any] = {"startup": {"python -c pass": 0.03}, "throughput": throughput, "batch_size": 8, "threads": 2,
              "latency": {bench_server.LMCLI: latency}, "llama_cpp": "not measured: the model is not a GGUF file"}
    if llama:
        throughput.update(llama_cpp_tokens_per_s=20.0, vs_llama_cpp=2.0)
        result["latency"][bench_server.LLAMA_CPP] = latency
    out = io.StringIO()
    bench_server.report(result, Console(file=out, width=250))
    text = out.getvalue()
    assert "40.0" in text and "0.80" in text and "3.200" in text and "6.400" in text
    assert ("llama_cpp.server tok/s" in text and "2.00" in text) == llama
    assert ("not a GGUF" in text) != llama


def test_server_env_leaves_threads_to_the_server_or_fixes_them_as_the_users():
    """What lmcli.threads, in the server's process, reads from the environment the bench gives it."""
    from lmcli import threads

    ours = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE", threads.SET_BY_LMCLI_VAR: "OMP_NUM_THREADS,OMP_WAIT_POLICY",
            "LMCLI_API_KEY": "k", "PATH": "/bin"}
    env = bench_server.server_env(ours, None)
    assert env == {"PATH": "/bin"} and threads._users(env) == {}  # the server chooses (and follows the load)
    env = bench_server.server_env(ours, 1)
    assert threads._users(env) == {"OMP_NUM_THREADS": "1"}  # --threads 1: fixed, as if the user had set it
    users = {"OMP_NUM_THREADS": "3", "PATH": "/bin"}  # the user's own: kept
    assert bench_server.server_env(users, None) == users
