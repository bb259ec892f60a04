"""Speculation through the commands: generate, a job and lmcli chat print what they print without it
(greedy), with its stats; bad flags and a draft with another tokenizer get one line and exit 2."""

from __future__ import annotations

import json
import re

import pytest
from cli_fixtures import build_tiny_checkpoint, tiny_checkpoint, tiny_spm_checkpoint  # noqa: F401  (fixtures)
from test_cli import cli

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: per-op overhead

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Other random weights with the same tokenizer (trained alike): a draft that agrees now and then."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-draft"), seed=2)


def test_generate_with_a_draft_model_prints_plain_greedy_text_and_its_stats(tiny_checkpoint, tiny_draft):
    flags = ["generate", "-c", tiny_checkpoint, "--greedy", "-n", 20, "--ignore-eos", "--stats"]
    expected = cli(*flags, PROMPT)
    got = cli(*flags, "--draft-model", tiny_draft, "--num-draft-tokens", 3, PROMPT)
    assert expected.exit_code == got.exit_code == 0, got.stderr
    assert got.stdout == expected.stdout and got.stdout.strip()
    assert re.search(rf"draft model {re.escape(str(tiny_draft))}: [1-9]\d* drafted, \d+ accepted .* draft passes",
                     got.stderr)
    assert "no less than the model's" in got.stderr  # as big as the target: speculation will not pay


def test_bad_speculation_flags_get_one_line_and_exit_2(tiny_checkpoint, tiny_spm_checkpoint):
    flags = ["generate", "-c", tiny_checkpoint, "--greedy", "-n", 4]
    cases = [
        (["--draft-model", tiny_spm_checkpoint], rf"the draft model {re.escape(str(tiny_spm_checkpoint))} has "
                                                 r"another vocabulary .* than .*tiny-llama"),
        (["--prompt-lookup", "--draft-model", tiny_checkpoint], "choose one"),
        (["--prompt-lookup", "--num-draft-tokens", 10**9], "--num-draft-tokens must be an integer from 1 to 64"),
        (["--draft-quantize", "int4"], "--draft-quantize needs --prompt-lookup or --draft-model"),
    ]
    for extra, message in cases:
        result = cli(*flags, *extra, PROMPT)
        assert result.exit_code == 2 and re.search(message, result.stderr), (extra, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    empty = cli(*flags, "--prompt-lookup", "")
    assert empty.exit_code == 2 and "the prompt is empty" in empty.stderr


@pytest.mark.parametrize("scheduler", ["", "continuous"])
def test_a_job_with_prompt_lookup_writes_plain_greedy_rows(tiny_checkpoint, tmp_path, monkeypatch, scheduler):
    """With continuous batching asked for (the default on quantized models) speculation must still run."""
    monkeypatch.setenv("LMCLI_JOB_SCHEDULER", scheduler)
    rows = [{"id": i, "prompt": f"{PROMPT} {word}. The quick brown"} for i, word in enumerate(["one", "two", "three"])]
    rows.append({"id": 3, "prompt": "A different text", "max_new_tokens": 7})
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps(row) + "\n" for row in rows))
    outputs: list[list[tuple]] = []
    for extra in ([], ["--prompt-lookup", "--num-draft-tokens", 4]):
        out = tmp_path / f"out{len(outputs)}.jsonl"
        result = cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", 16, "--input", job, "-o", out,
                     "--batch-size", 2, "--stats", *extra)
        assert result.exit_code == 0, result.stderr
        outputs.append(sorted((r["id"], r["completion"], r["finish_reason"])
                              for r in map(json.loads, out.read_text().splitlines())))
        if extra:
            assert re.search(r"prompt lookup: [1-9]\d* drafted, [1-9]\d* accepted", result.stderr)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4


def test_chat_with_prompt_lookup_replies_as_plain_greedy(tiny_checkpoint):
    messages = f"{PROMPT}\nSay it again: {PROMPT}\n"
    flags = ["chat", "-c", tiny_checkpoint, "--greedy", "-n", 40]
    expected = cli(*flags, input=messages)
    got = cli(*flags, "--prompt-lookup", "--num-draft-tokens", 4, "--stats", input=messages)
    assert expected.exit_code == got.exit_code == 0, got.stderr
    assert got.stdout == expected.stdout and got.stdout.strip()
    assert re.search(r"prompt lookup: [1-9]\d* drafted", got.stderr)


def test_the_bench_section_compares_each_method_with_plain_greedy(tiny_checkpoint):
    import io

    from rich.console import Console

    import lmcli
    from lmcli.bench import sections as bench_sections
    from lmcli.bench import speculative as bench_speculative

    assert bench_sections.SECTIONS["speculative"] == "lmcli.bench.speculative"
    model, tokenizer = lmcli.load(tiny_checkpoint)
    methods = {"plain": (model, {}), "prompt lookup": (model, {"prompt_lookup": 4})}
    rows = bench_speculative._measure_model("tiny", model, tokenizer, methods, 12, 1, lambda _: None, quick=True)
    assert [(r["prompt"], r["method"]) for r in rows] == [(label, m) for label in ("repeat", "edit code", "story")
                                                          for m in methods]
    assert all(r["same_text"] and r["tokens"] > 0 and r["tok_s"] > 0 for r in rows)
    assert sum(r["drafted"] for r in rows if r["method"] == "prompt lookup") > 0
    out = io.StringIO()
    bench_speculative.report({"new_tokens": 12, "num_draft_tokens": 4, "rows": rows, "notes": ["n"]},
                             Console(file=out, width=200))
    assert "prompt lookup" in out.getvalue() and "NO" not in out.getvalue()
