"""Speculation chosen per job row (lmcli rows and OpenAI batch bodies): each row's tokens are plain
greedy's (`model.generate` called directly), its counts those of a direct speculative `generate` call on
its prompt, `--stats` their sum; a bad field value makes that row an error row."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from cli_fixtures import build_tiny_checkpoint, tiny_checkpoint  # noqa: F401  (fixtures)
from real_models import smollm2_gguf  # noqa: F401  (fixtures)
from test_cli import cli

import lmcli
from lmcli.generation.speculative import DEFAULT_DRAFT_TOKENS, SpeculationStats

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: per-op overhead

TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
N = 16


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Other random weights with the same tokenizer: a draft that agrees now and then."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-draft-rows"), seed=2)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return lmcli.load(str(tiny_checkpoint))


def reference(loaded, prompt: str, **speculation) -> tuple[list[int], SpeculationStats]:
    """A row's new tokens by a direct generate() call on its prompt (plain greedy without `speculation`),
    and that call's speculation stats."""
    model, tokenizer = loaded
    ids = torch.tensor([list(tokenizer.encode(prompt))])
    stats = SpeculationStats()
    extra = {**speculation, "stats": stats} if speculation else {}
    out = model.generate(ids, max_new_tokens=N, do_sample=False, **extra)
    return out[0, ids.shape[1]:].tolist(), stats


def counts(stats: SpeculationStats, method: str) -> dict:
    out = {"method": method, "drafted": stats.drafted, "accepted": stats.accepted, "passes": stats.passes}
    if stats.draft_passes:
        out["draft_passes"] = stats.draft_passes
    return out


def run_job(tmp_path, checkpoint, rows, *flags):
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    result = cli("generate", "-c", checkpoint, "--greedy", "-n", N, "--ignore-eos", "--logprobs", 0, "--input", job,
                 "-o", out, "--overwrite", "--batch-size", 2, "--stats", *flags)
    written = {row["custom_id"] if "custom_id" in row else row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    return result, written


def prompts() -> list[str]:
    return [f"{TEXT} {word}. The quick brown" for word in ("one", "two", "three", "four")]


@pytest.mark.parametrize("scheduler", ["batches", "continuous"])
def test_rows_that_choose_prompt_lookup_give_plain_greedy_tokens_and_their_own_counts(
        tiny_checkpoint, loaded, tmp_path, monkeypatch, scheduler):
    monkeypatch.setenv("LMCLI_JOB_SCHEDULER", scheduler)
    p = prompts()
    rows: list[dict[str, Any]] = [{"id": 0, "prompt": p[0], "prompt_lookup": True},
            {"id": 1, "prompt": p[1], "prompt_lookup": True, "num_draft_tokens": 2},
            {"id": 2, "prompt": p[2]},
            {"id": 3, "prompt": p[3], "prompt_lookup": False}]
    result, written = run_job(tmp_path, tiny_checkpoint, rows)
    assert result.exit_code == 0, result.stderr
    drafted = accepted = 0
    for row in rows:
        got = written[row["id"]]
        assert [step["id"] for step in got["logprobs"]] == reference(loaded, row["prompt"])[0], row
        if row.get("prompt_lookup"):
            k = row.get("num_draft_tokens", DEFAULT_DRAFT_TOKENS)
            _, stats = reference(loaded, row["prompt"], prompt_lookup=k)
            assert got["speculation"] == counts(stats, "prompt lookup")
            assert got["settings"]["prompt_lookup"] is True
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        else:
            assert "speculation" not in got
    assert drafted > 0 and accepted > 0  # the text repeats itself: lookup guesses, and some guesses are kept
    assert re.search(rf"prompt lookup: {drafted} drafted, {accepted} accepted", result.stderr), result.stderr


def test_a_row_turns_off_the_flags_speculation_and_sets_its_own_bound(tiny_checkpoint, loaded, tmp_path):
    p = prompts()
    rows: list[dict[str, Any]] = [{"id": "off", "prompt": p[0], "prompt_lookup": False},
            {"id": "k3", "prompt": p[1], "num_draft_tokens": 3},
            {"id": "flag", "prompt": p[2]}]
    result, written = run_job(tmp_path, tiny_checkpoint, rows, "--prompt-lookup", "--num-draft-tokens", 5)
    assert result.exit_code == 0, result.stderr
    for row, k in zip(rows, (None, 3, 5)):
        got = written[row["id"]]
        assert [step["id"] for step in got["logprobs"]] == reference(loaded, row["prompt"])[0]
        if k is None:
            assert "speculation" not in got and "prompt_lookup" not in got["settings"]
        else:
            assert got["speculation"] == counts(reference(loaded, row["prompt"], prompt_lookup=k)[1], "prompt lookup")


def test_rows_switch_the_commands_draft_model_on_or_off(tiny_checkpoint, tiny_draft, loaded, tmp_path):
    draft, _ = lmcli.load(str(tiny_draft))
    p = prompts()
    rows: list[dict[str, Any]] = [{"id": "draft", "prompt": p[0]},
            {"id": "plain", "prompt": p[1], "draft_model": False},
            {"id": "lookup", "prompt": p[2], "prompt_lookup": True, "num_draft_tokens": 4}]
    result, written = run_job(tmp_path, tiny_checkpoint, rows, "--draft-model", tiny_draft, "--num-draft-tokens", 3)
    assert result.exit_code == 0, result.stderr
    for row in rows:
        assert [step["id"] for step in written[row["id"]]["logprobs"]] == reference(loaded, row["prompt"])[0]
    _, by_draft = reference(loaded, p[0], draft_model=draft, num_draft_tokens=3)
    assert written["draft"]["speculation"] == counts(by_draft, f"draft model {tiny_draft}") and by_draft.draft_passes
    assert "speculation" not in written["plain"]
    _, by_lookup = reference(loaded, p[2], prompt_lookup=4)
    assert written["lookup"]["speculation"] == counts(by_lookup, "prompt lookup")
    assert f"draft model {tiny_draft}: {by_draft.drafted} drafted" in result.stderr
    assert f"prompt lookup: {by_lookup.drafted} drafted" in result.stderr


BAD_ROWS: list[tuple[dict[str, Any], str]] = [
    ({"prompt_lookup": "yes"}, '"prompt_lookup" must be true or false, got "yes"'),
    ({"prompt_lookup": True, "num_draft_tokens": 0}, '"num_draft_tokens" must be an integer from 1 to 64, got 0'),
    ({"prompt_lookup": True, "num_draft_tokens": 10**9}, '"num_draft_tokens" must be an integer from 1 to 64'),
    ({"prompt_lookup": True, "num_draft_tokens": 2.5}, '"num_draft_tokens" must be an integer, got 2.5'),
    ({"num_draft_tokens": 4}, '"num_draft_tokens" needs "prompt_lookup": true'),
    ({"draft_model": True}, '"draft_model" needs --draft-model'),
    ({"prompt_lookup": True, "draft_model": True}, '"prompt_lookup" and "draft_model" are two ways to guess'),
]


def test_bad_speculation_fields_make_error_rows_and_the_rest_run(tiny_checkpoint, tmp_path):
    rows = [{"id": i, "prompt": TEXT, **fields} for i, (fields, _) in enumerate(BAD_ROWS)]
    rows.append({"id": "good", "prompt": TEXT, "prompt_lookup": True})
    result, written = run_job(tmp_path, tiny_checkpoint, rows)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    for i, (_, message) in enumerate(BAD_ROWS):
        assert message in written[i]["error"] and "\n" not in written[i]["error"], written[i]
    assert "error" not in written["good"] and written["good"]["speculation"]["passes"] > 0


def openai_row(custom_id: str, prompt: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": N, "temperature": 0, **body}}


def test_openai_bodies_take_the_extension_fields_and_report_counts_in_usage(tiny_checkpoint, loaded, tmp_path):
    p = prompts()
    rows = [openai_row("plain", p[0]), openai_row("lookup", p[0], prompt_lookup=True, num_draft_tokens=3),
            openai_row("bad-switch", p[1], prompt_lookup=1), openai_row("bad-k", p[1], prompt_lookup=True,
                                                                        num_draft_tokens=65)]
    result, written = run_job(tmp_path, tiny_checkpoint, rows)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    plain, lookup = (written[key]["response"]["body"] for key in ("plain", "lookup"))
    assert lookup["choices"][0]["text"] == plain["choices"][0]["text"]
    _, model_tokenizer = loaded
    assert model_tokenizer.decode(reference(loaded, p[0])[0]) == plain["choices"][0]["text"]
    _, stats = reference(loaded, p[0], prompt_lookup=3)
    assert lookup["usage"]["speculation"] == counts(stats, "prompt lookup") and stats.drafted
    assert lookup["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": stats.accepted, "rejected_prediction_tokens": stats.drafted - stats.accepted}
    assert "speculation" not in plain["usage"]
    assert written["bad-switch"]["error"]["message"].endswith('body field "prompt_lookup" must be true or false, got 1')
    assert 'body field "num_draft_tokens" must be an integer from 1 to 64, got 65' in written["bad-k"]["error"]["message"]


@pytest.mark.full  # loads the default model
def test_on_the_default_model_a_job_mixing_lookup_rows_gives_plain_greedy_tokens(smollm2_gguf, tmp_path):
    passage = "The river rises in the northern hills and meets the sea at a wide delta."
    prompts = [f"Repeat this text exactly: {passage}\n{passage[:15]}", "Write a short story about a cat.",
               f"Copy: {passage}\n{passage[:9]}"]
    rows: list[dict[str, Any]] = [{"id": i, "prompt": text, "prompt_lookup": i != 1} for i, text in enumerate(prompts)]
    result, written = run_job(tmp_path, smollm2_gguf, rows)  # batch-invariant: the plain row runs continuously
    assert result.exit_code == 0, result.stderr
    real = lmcli.load(str(smollm2_gguf))
    for row in rows:
        got = written[row["id"]]
        assert [step["id"] for step in got["logprobs"]] == reference(real, row["prompt"])[0], row
        if row["prompt_lookup"]:
            assert got["speculation"] == counts(reference(real, row["prompt"], prompt_lookup=8)[1], "prompt lookup")
    assert written[0]["speculation"]["accepted"] > 0


def test_a_sampled_row_draws_as_the_api_does_with_its_seed(tiny_checkpoint, loaded, tmp_path):
    model, tokenizer = loaded
    rows = [{"id": "s", "prompt": prompts()[0], "temperature": 0.9, "seed": 11, "prompt_lookup": True,
             "num_draft_tokens": 3}]
    job = tmp_path / "sampled.jsonl"
    job.write_text(json.dumps(rows[0]) + "\n")
    out = tmp_path / "sampled-out.jsonl"
    result = cli("generate", "-c", tiny_checkpoint, "-n", N, "--ignore-eos", "--logprobs", 0, "--input", job, "-o", out)
    assert result.exit_code == 0, result.stderr
    [got] = map(json.loads, out.read_text().splitlines())
    ids = torch.tensor([list(tokenizer.encode(rows[0]["prompt"]))])
    stats = SpeculationStats()
    direct = model.generate(ids, max_new_tokens=N, do_sample=True, temperature=0.9, seed=[11], prompt_lookup=3,
                            stats=stats)
    assert [step["id"] for step in got["logprobs"]] == direct[0, ids.shape[1]:].tolist()
    assert got["speculation"] == counts(stats, "prompt lookup")


def test_greedy_rows_resume_under_other_speculation_flags_sampled_rows_do_not(tiny_checkpoint, tmp_path):
    from lmcli.settings.generation_settings import GenerationSettings, input_hash

    greedy, sampled = GenerationSettings.from_flags(greedy=True), GenerationSettings.from_flags(temperature=0.7)
    for base, same in ((greedy, True), (sampled, False)):
        plain, speculating = base.for_row({}), base.for_row({"prompt_lookup": True})
        assert (input_hash("p", plain) == input_hash("p", speculating)) is same
    rows = [{"id": i, "prompt": text} for i, text in enumerate(prompts()[:2])]
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    flags = ["generate", "-c", tiny_checkpoint, "--greedy", "-n", 6, "--input", job, "-o", out]
    assert cli(*flags, "--prompt-lookup").exit_code == 0
    first = out.read_text().splitlines()[0]
    out.write_text(first + "\n")  # as if killed after one row
    resumed = cli(*flags, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == [0, 1]


def test_a_constrained_row_says_speculation_was_off_for_it(tiny_checkpoint, loaded, tmp_path):
    rows: list[dict[str, Any]] = [{"id": "json", "prompt": TEXT, "prompt_lookup": True, "regex": "[ab]{3,5}"},
                                  {"id": "free", "prompt": prompts()[0], "prompt_lookup": True}]
    result, written = run_job(tmp_path, tiny_checkpoint, rows)
    assert result.exit_code == 0, result.stderr
    assert re.fullmatch("[ab]{3,5}", written["json"]["completion"])
    note = "a structured-output constraint follows the text one token at a time"
    assert written["json"]["speculation"] == {"method": "prompt lookup", "off": note}
    free = reference(loaded, rows[1]["prompt"], prompt_lookup=DEFAULT_DRAFT_TOKENS)[1]
    assert written["free"]["speculation"] == counts(free, "prompt lookup")
    assert f"prompt lookup: {free.drafted} drafted, {free.accepted} accepted" in result.stderr
    assert f"switched off for 1 row ({note})" in result.stderr


def test_on_a_batch_invariant_model_lookup_rows_of_a_job_share_passes(tiny_checkpoint, tmp_path, monkeypatch):
    """int8 weights: rows are batch-invariant, so a job's lookup rows of one kind go together."""
    from lmcli.generation import speculative, speculative_batch

    together: list[int] = []
    decode = speculative_batch.decode_together

    def counting(model, rows):
        together.append(len(rows))
        return decode(model, rows)

    monkeypatch.setattr(speculative, "decode_together", counting)
    quantized = lmcli.load(str(tiny_checkpoint), quantize="int8")
    assert quantized[0].batch_invariant
    p = prompts()
    rows: list[dict[str, Any]] = [{"id": i, "prompt": text, "prompt_lookup": i != 2} for i, text in enumerate(p)]
    rows.append({"id": "k2", "prompt": p[2], "prompt_lookup": True, "num_draft_tokens": 2})  # another kind
    result, written = run_job(tmp_path, tiny_checkpoint, rows, "--quantize", "int8", "--batch-size", 8)
    assert result.exit_code == 0, result.stderr
    assert together == [3]  # the three rows with K = 8 share passes; the K = 2 row is a call of one
    for row in rows:
        got = written[row["id"]]
        assert [step["id"] for step in got["logprobs"]] == reference(quantized, row["prompt"])[0], row["id"]
        if row["prompt_lookup"]:
            k = row.get("num_draft_tokens", DEFAULT_DRAFT_TOKENS)
            assert got["speculation"] == counts(reference(quantized, row["prompt"], prompt_lookup=k)[1], "prompt lookup")
