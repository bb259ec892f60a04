"""OpenAI batch files (vLLM run-batch's format) and resume by id and by model, on the tiny real checkpoint.

Each response row is checked against `model.generate` called directly with the settings its body asks
for, on prompt ids from transformers' own tokenizer and chat template; resume is checked against an
uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch
from cli_fixtures import tiny_checkpoint, tiny_spm_checkpoint  # noqa: F401 (fixtures)
from typer.testing import CliRunner

from lmcli.cli import app
from lmcli.resolve import model_names

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 6  # tokens per row; every job runs with --ignore-eos so each row makes exactly NEW


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def chat(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], **body}}


def completion(custom_id, prompt, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """model.generate on the tiny model, prompts encoded by transformers."""
    import transformers

    import lmcli

    model, _ = lmcli.load(tiny_checkpoint)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)

    def run(prompt, *, temperature=0.0, top_p=None, top_k=None, seed=None, logprobs=False):
        if isinstance(prompt, list):
            ids: Any = hf_tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = hf_tokenizer(prompt)["input_ids"]
        steps = []
        out = model.generate(torch.tensor([list(ids)]), NEW, do_sample=temperature > 0,
                             temperature=temperature or 1.0, top_p=top_p, top_k=top_k,
                             seed=[seed] if temperature > 0 else None,
                             on_token=(lambda e: steps.append(torch.log_softmax(e.logits[0].float(), -1)))
                             if logprobs else None)
        new = out[0, len(ids):].tolist()
        text = hf_tokenizer.decode(list(ids) + new)[len(hf_tokenizer.decode(list(ids))):]
        return {"prompt_tokens": len(ids), "ids": new, "text": text, "logprobs": steps}

    return run


def run_job(tmp_path, rows, *flags, checkpoint):
    source, out = tmp_path / "requests.jsonl", tmp_path / "responses.jsonl"
    if rows is not None:
        write_jsonl(source, rows)
    result = cli("generate", "-c", checkpoint, "--ignore-eos", "-n", NEW, "--input", source, "--output", out, *flags)
    return result, out


def test_chat_and_completion_rows_equal_model_generate(tmp_path, tiny_checkpoint, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Привет, мир!"}]
    rows = [
        {**chat("greedy-chat", ""), "body": {"messages": messages, "max_tokens": NEW, "temperature": 0}},
        chat("sampled-chat", "Hello there", temperature=0.9, top_p=0.8, seed=11, max_completion_tokens=NEW),
        completion("greedy-text", "The quick brown fox", temperature=0),
        completion("sampled-text", "Once upon a time", temperature=1.3, top_k=5, seed=3),
    ]
    result, out = run_job(tmp_path, rows, checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    got = {row["custom_id"]: row for row in read_jsonl(out)}
    assert sorted(got) == sorted(r["custom_id"] for r in rows)
    expected = {
        "greedy-chat": reference(messages),
        "sampled-chat": reference([{"role": "user", "content": "Hello there"}], temperature=0.9, top_p=0.8, seed=11),
        "greedy-text": reference("The quick brown fox"),
        "sampled-text": reference("Once upon a time", temperature=1.3, top_k=5, seed=3),
    }
    for custom_id, want in expected.items():
        row = got[custom_id]
        assert row["error"] is None and row["response"]["status_code"] == 200
        body = row["response"]["body"]
        [choice] = body["choices"]
        text = choice["message"]["content"] if custom_id.endswith("chat") else choice["text"]
        assert text == want["text"], custom_id
        assert body["object"] == ("chat.completion" if custom_id.endswith("chat") else "text_completion")
        assert body["usage"] == {"prompt_tokens": want["prompt_tokens"], "completion_tokens": NEW,
                                 "total_tokens": want["prompt_tokens"] + NEW}
        assert choice["finish_reason"] == "length" and choice["logprobs"] is None
        assert body["system_fingerprint"] == row["lmcli"]["model"]["fingerprint"]



def test_flags_win_over_body_fields(tmp_path, tiny_checkpoint, reference):
    """A command-line flag beats the same setting in a request body, as it beats a row's field."""
    rows = [completion("flagged", "Once upon a time", temperature=1.3, top_k=5, seed=3, max_tokens=2)]
    result, out = run_job(tmp_path, rows, "--greedy", checkpoint=tiny_checkpoint)  # and -n NEW
    assert result.exit_code == 0, result.output
    assert "override" not in result.output  # silently
    [row] = read_jsonl(out)
    assert row["error"] is None
    body = row["response"]["body"]
    assert body["choices"][0]["text"] == reference("Once upon a time")["text"]
    assert body["usage"]["completion_tokens"] == NEW

def test_logprobs_in_both_shapes_equal_the_model_distribution(tmp_path, tiny_checkpoint, reference):
    rows = [chat("c", "Hello", temperature=0, logprobs=True, top_logprobs=3),
            completion("t", "Hello", temperature=0, logprobs=2)]
    result, out = run_job(tmp_path, rows, checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    got = {row["custom_id"]: row["response"]["body"]["choices"][0] for row in read_jsonl(out)}

    want = reference([{"role": "user", "content": "Hello"}], logprobs=True)
    content = got["c"]["logprobs"]["content"]
    assert len(content) == NEW
    for step, distribution, token in zip(content, want["logprobs"], want["ids"]):
        assert step["logprob"] == pytest.approx(distribution[token].item(), abs=1e-4)
        top = distribution.topk(3)
        assert [t["logprob"] for t in step["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert step["bytes"] == list(step["token"].encode())

    want = reference("Hello", logprobs=True)
    legacy = got["t"]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) == NEW
    for logprob, top, distribution, token in zip(legacy["token_logprobs"], legacy["top_logprobs"], want["logprobs"],
                                                 want["ids"]):
        assert logprob == pytest.approx(distribution[token].item(), abs=1e-4)
        # The legacy shape maps token text -> logprob, so two tokens that decode alike share one entry.
        best = distribution.topk(2).values.tolist()
        assert max(top.values()) == pytest.approx(best[0], abs=1e-4)
        assert all(any(abs(v - b) < 1e-4 for b in best) for v in top.values()) and 1 <= len(top) <= 2


def test_bad_requests_are_error_rows_and_good_ones_still_run(tmp_path, tiny_checkpoint):
    rows = [
        completion("ok", "Hello", temperature=0),
        completion("typo", "Hello", max_tokenz=5),
        completion("two", "Hello", n=2),
        chat("stream", "Hello", stream=True),
        chat("penalty", "Hello", frequency_penalty=0.5),
        chat("hot", "Hello", temperature=-1),
        completion("none", "Hello", max_tokens=0),
        {**completion("get", "Hello"), "method": "GET"},
        {**completion("where", "Hello"), "url": "/v1/embeddings"},
        {**completion("extra", "Hello"), "priority": 1},
        {"custom_id": "empty", "method": "POST", "url": "/v1/chat/completions", "body": {}},
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}},
        "{not json",
    ]
    result, out = run_job(tmp_path, rows, checkpoint=tiny_checkpoint)
    assert result.exit_code == 1 and "12 of 13 rows failed" in result.stderr
    got = read_jsonl(out)
    assert len(got) == 13
    errors = {row["custom_id"]: row["error"]["message"] for row in got if row["error"] is not None}
    assert all(row["response"] is None for row in got if row["error"] is not None)
    expected = {
        "typo": 'body field "max_tokenz" is not supported',
        "two": 'body field "n" = 2 is not supported',
        "stream": 'body field "stream" = True is not supported',
        "penalty": 'body field "frequency_penalty" = 0.5',
        "hot": 'body field "temperature" must be >= 0',
        "none": 'body field "max_tokens" must be at least 1',
        "get": '"method" must be "POST"',
        "where": '"url" must be "/v1/chat/completions" or "/v1/completions"',
        "extra": 'unknown field "priority"',
        "empty": 'body field "messages" is missing',
    }
    for custom_id, message in expected.items():
        assert message in errors[custom_id], (custom_id, errors[custom_id])
    nameless = [row["error"]["message"] for row in got if row["custom_id"] is None]
    assert any('"custom_id" must be a non-empty string' in m for m in nameless)
    assert any("not valid JSON" in m for m in nameless)
    assert [row["custom_id"] for row in got if row["error"] is None] == ["ok"]


def test_resume_by_custom_id_after_a_kill_mid_write(tmp_path, tiny_checkpoint):
    rows = [completion(f"r{i}", prompt, temperature=0.8, seed=i)
            for i, prompt in enumerate(["Hello", "The fox", "Привет", "Emoji 🙂", "Once"])]
    result, out = run_job(tmp_path, rows, checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    full = {row["custom_id"]: row["response"]["body"]["choices"][0]["text"] for row in read_jsonl(out)}
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1] + lines[2][:25])  # killed while writing the third row
    result, out = run_job(tmp_path, None, "--resume", checkpoint=tiny_checkpoint)
    assert result.exit_code == 0 and "2 already done" in result.stderr, result.output
    resumed = read_jsonl(out)
    assert sorted(row["custom_id"] for row in resumed) == sorted(full)
    assert {row["custom_id"]: row["response"]["body"]["choices"][0]["text"] for row in resumed} == full


def test_format_is_decided_by_the_first_row(tmp_path, tiny_checkpoint):
    rows = [completion("a", "Hello", temperature=0), {"prompt": "an lmcli row"}]
    result, out = run_job(tmp_path, rows, checkpoint=tiny_checkpoint)
    assert result.exit_code == 1
    second = read_jsonl(out)[0 if read_jsonl(out)[0]["custom_id"] is None else 1]
    assert second["custom_id"] is None and "custom_id" in second["error"]["message"]


# ----------------------------------------------------------------------------- resume: ids and models


def test_ids_that_look_alike_stay_apart_through_a_resume(tmp_path, tiny_checkpoint):
    """1 and "1" are two rows; a row without an id (line 3 -> 3) and "3" too; resume duplicates none."""
    rows = [{"id": 1, "prompt": "one as a number"}, {"id": "1", "prompt": "one as a string"},
            {"prompt": "third line"}, {"id": "3", "prompt": "three as a string"},
            {"id": "x-7", "prompt": "a string id"}, {"id": 7, "prompt": "seven"}]
    result, out = run_job(tmp_path, [json.dumps(r) for r in rows], "--greedy", checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    full = read_jsonl(out)
    by_id = {json.dumps(row["id"]): row for row in full}
    assert sorted(by_id) == sorted(['1', '"1"', '3', '"3"', '"x-7"', '7'])
    assert by_id['1']["prompt"] == "one as a number" and by_id['"1"']["prompt"] == "one as a string"
    assert by_id['3']["prompt"] == "third line" and by_id['"3"']["prompt"] == "three as a string"

    for keep in (1, 3, 5):  # killed after `keep` rows, the next one half-written
        lines = out.read_text().splitlines(keepends=True)
        out.write_text("".join(lines[:keep]) + lines[keep][:20])
        result, _ = run_job(tmp_path, None, "--greedy", "--resume", checkpoint=tiny_checkpoint)
        assert result.exit_code == 0 and f"{keep} already done" in result.stderr, result.output
        resumed = read_jsonl(out)
        assert len(resumed) == len(rows)
        assert {json.dumps(r["id"]): r for r in resumed} == by_id


def test_resume_refuses_another_model_and_accepts_a_copy(tmp_path, tiny_checkpoint, tiny_spm_checkpoint):
    rows = [{"prompt": "Hello"}, {"prompt": "World"}]
    result, out = run_job(tmp_path, rows, "--greedy", checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    recorded = read_jsonl(out)[0]["model"]
    assert recorded["fingerprint"] == model_names.checkpoint_fingerprint(tiny_checkpoint)
    out.write_text(out.read_text().splitlines(keepends=True)[0])  # one row done

    result, _ = run_job(tmp_path, None, "--greedy", "--resume", checkpoint=tiny_spm_checkpoint)
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "came from another model" in result.stderr and recorded["fingerprint"] in result.stderr
    assert len(read_jsonl(out)) == 1  # nothing written

    copy = tmp_path / "copy-of-tiny"  # the same files elsewhere: the same model
    shutil.copytree(tiny_checkpoint, copy)
    result, _ = run_job(tmp_path, None, "--greedy", "--resume", checkpoint=copy)
    assert result.exit_code == 0 and len(read_jsonl(out)) == 2, result.output


def test_resume_reports_orphan_rows(tmp_path, tiny_checkpoint):
    rows = [{"id": "keep", "prompt": "Hello"}, {"id": "gone", "prompt": "World"}]
    result, out = run_job(tmp_path, rows, "--greedy", checkpoint=tiny_checkpoint)
    assert result.exit_code == 0
    result, _ = run_job(tmp_path, rows[:1], "--greedy", "--resume", checkpoint=tiny_checkpoint)
    assert result.exit_code == 0
    assert 'warning: ' in result.stderr and 'keeps 1 row whose id is not in' in result.stderr
    assert '"gone"' in result.stderr
    assert len(read_jsonl(out)) == 2  # reported, not dropped


def test_fingerprint_follows_content_not_place(tmp_path, tiny_checkpoint):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_checkpoint, copy)
    assert model_names.checkpoint_fingerprint(copy) == model_names.checkpoint_fingerprint(tiny_checkpoint)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert model_names.checkpoint_fingerprint(copy) != model_names.checkpoint_fingerprint(tiny_checkpoint)

    big = tmp_path / "big.gguf"  # large files are sampled: a change in a sampled piece shows
    big.write_bytes(bytes(40 << 20))
    before = model_names.checkpoint_fingerprint(big)
    with open(big, "r+b") as f:
        f.seek(20 << 20)
        f.write(b"\x01")
    assert model_names.checkpoint_fingerprint(big) != before
