"""OpenAI batch bodies that carry their own length, stop and logprobs: no `-n`, no `--ignore-eos`.

The other OpenAI batch tests pin every row's length with flags, so a body's own `max_tokens`, its
`stop`, the finish reason at the end-of-text token, `text_offset` and the error codes would go unread.
Each row here is checked against `model.generate` called directly on transformers' token ids, and
against OpenAI's documented formulas written out below (text_offset, usage, finish_reason).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = 1  # cli_fixtures.SPECIAL_TOKENS: "<s>", "</s>", "<pad>"


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def run_job(tmp_path, rows, *flags, checkpoint):
    source, out = tmp_path / "requests.jsonl", tmp_path / "responses.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("generate", "-c", checkpoint, "--input", source, "--output", out, *flags)
    return result, {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}


def completion(custom_id, prompt, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


def chat(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], **body}}


@pytest.fixture(scope="module")
def greedy(tiny_checkpoint):
    """Greedy tokens and text from model.generate, prompts encoded by transformers (EOS honoured)."""
    import transformers

    import lmcli

    model, _ = lmcli.load(tiny_checkpoint)
    hf = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)

    def run(prompt, n, *, eos_bias=0.0, chat_form=False):
        if chat_form:
            rendered: Any = hf.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, tokenize=True)
            ids: list[int] = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        else:
            ids = list(hf(prompt)["input_ids"])

        def bias(_ids, scores):
            scores = scores.clone()
            scores[:, EOS] += eos_bias
            return scores

        steps: list[torch.Tensor] = []
        out = model.generate(torch.tensor([ids]), n, do_sample=False, eos_token_id=EOS,
                             logits_processors=[bias] if eos_bias else None,
                             on_token=lambda e: steps.append(torch.log_softmax(e.logits[0].float(), -1)))
        new = out[0, len(ids):].tolist()
        if EOS in new:
            new = new[:new.index(EOS) + 1]
        shown = [t for t in new if t != EOS]
        text = hf.decode(ids + shown)[len(hf.decode(ids)):]
        return {"ids": new, "text": text, "prompt_tokens": len(ids), "logprobs": steps,
                "tokens": [hf.decode(ids + shown[:i + 1])[len(hf.decode(ids + shown[:i])):]
                           for i in range(len(shown))]}

    return run


def test_body_max_tokens_sets_the_length_without_a_flag(tmp_path, tiny_checkpoint, greedy):
    rows = [completion("three", "The quick brown fox", temperature=0, max_tokens=3),
            chat("five", "Hello there", temperature=0, max_completion_tokens=5)]
    result, got = run_job(tmp_path, rows, checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    for custom_id, n, want in (("three", 3, greedy("The quick brown fox", 3)),
                               ("five", 5, greedy("Hello there", 5, chat_form=True))):
        body = got[custom_id]["response"]["body"]
        [choice] = body["choices"]
        if EOS in want["ids"]:  # a random model may still stop early; then it must say so
            assert choice["finish_reason"] == "stop"
        else:
            assert choice["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == n
        text = choice["text"] if custom_id == "three" else choice["message"]["content"]
        assert text == want["text"]
        usage = body["usage"]
        assert usage["prompt_tokens"] == want["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_body_stop_string_cuts_the_text_and_says_stop(tmp_path, tiny_checkpoint, greedy):
    want = greedy("Once upon a time", 12)
    assert EOS not in want["ids"] and len(want["text"]) > 6
    stop = want["text"][3:6]  # a piece from inside the greedy text: it must cut there
    rows = [completion("cut", "Once upon a time", temperature=0, max_tokens=12, stop=[stop]),
            completion("uncut", "Once upon a time", temperature=0, max_tokens=12, stop="\u2603never")]
    result, got = run_job(tmp_path, rows, checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    cut = got["cut"]["response"]["body"]["choices"][0]
    assert cut["text"] == want["text"][:want["text"].index(stop)]
    assert cut["finish_reason"] == "stop"
    uncut = got["uncut"]["response"]["body"]["choices"][0]
    assert uncut["text"] == want["text"] and uncut["finish_reason"] == "length"


def test_the_end_of_text_token_finishes_with_stop_and_is_not_text(tmp_path, tiny_checkpoint, greedy):
    """--logit-bias makes EOS likely; the row must end where model.generate with the same bias ends."""
    want = greedy("Hello", 8, eos_bias=4.0)
    assert EOS in want["ids"], "the bias should make the tiny model stop within 8 tokens"
    rows = [completion("eos", "Hello", temperature=0, max_tokens=8)]
    result, got = run_job(tmp_path, rows, "--logit-bias", f"{EOS}=4", checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    body = got["eos"]["response"]["body"]
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == want["text"] and "</s>" not in choice["text"]
    assert body["usage"]["completion_tokens"] in (len(want["ids"]) - 1, len(want["ids"]))


def test_text_offset_follows_openais_formula(tmp_path, tiny_checkpoint, greedy):
    """OpenAI: text_offset[i] is the character offset of token i in prompt + completion."""
    prompt = "The quick brown fox"
    rows = [completion("t", prompt, temperature=0, max_tokens=6, logprobs=1)]
    result, got = run_job(tmp_path, rows, "--ignore-eos", checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    choice = got["t"]["response"]["body"]["choices"][0]
    logprobs = choice["logprobs"]
    tokens = logprobs["tokens"]
    assert "".join(tokens) == choice["text"]
    expected, at = [], len(prompt)
    for token in tokens:
        expected.append(at)
        at += len(token)
    assert logprobs["text_offset"] == expected
    want = greedy(prompt, 6)
    for got_lp, dist, token in zip(logprobs["token_logprobs"], want["logprobs"], want["ids"]):
        assert got_lp == pytest.approx(dist[token].item(), abs=1e-4)


def test_chat_logprobs_true_without_top_logprobs(tmp_path, tiny_checkpoint, greedy):
    rows = [chat("c", "Hello", temperature=0, max_tokens=4, logprobs=True)]
    result, got = run_job(tmp_path, rows, "--ignore-eos", checkpoint=tiny_checkpoint)
    assert result.exit_code == 0, result.output
    content = got["c"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    want = greedy("Hello", 4, chat_form=True)
    assert len(content) == 4
    for step, dist, token in zip(content, want["logprobs"], want["ids"]):
        assert step["logprob"] == pytest.approx(dist[token].item(), abs=1e-4)
        assert step["top_logprobs"] == []
        assert step["bytes"] == list(step["token"].encode("utf-8"))


def test_error_rows_carry_a_code_and_a_null_response(tmp_path, tiny_checkpoint):
    rows = [completion("ok", "Hello", temperature=0, max_tokens=2),
            completion("bad", "Hello", max_tokenz=5),
            chat("hot", "Hello", temperature=-1)]
    result, got = run_job(tmp_path, rows, checkpoint=tiny_checkpoint)
    assert result.exit_code == 1
    assert got["ok"]["error"] is None
    for custom_id in ("bad", "hot"):
        error = got[custom_id]["error"]
        assert got[custom_id]["response"] is None
        assert error["code"] == "invalid_request", error
        assert isinstance(error["message"], str) and error["message"]
