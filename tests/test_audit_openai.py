"""OpenAI batch request fields a user can write and the earlier tests did not read (found by the planted-bug
audit, docs/testing.md): `top_logprobs` without `"logprobs": true`, completions `"logprobs": 0`, a
`prompt` list, chat content given as text parts, and `response_format` judged without a real model
(its text parsed by `json` and validated by the `jsonschema` library).

One job runs every row; each answer is checked against OpenAI's rules written out here and against
`model.generate` called directly on transformers' token ids (test_openai_batch_fields.greedy).
"""

from __future__ import annotations

import json

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from test_openai_batch_fields import chat, completion, greedy, run_job  # noqa: F401 (greedy: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = 1


def parts(custom_id, texts, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}], **body}}


SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
ROWS = [
    chat("top-without-logprobs", "Hello", temperature=0, max_tokens=2, logprobs=False, top_logprobs=2),
    chat("top-alone", "Hello", temperature=0, max_tokens=2, top_logprobs=2),
    completion("logprobs-0", "Once upon a time", temperature=0, max_tokens=3, logprobs=0),
    completion("two-prompts", ["Hello", "Once upon a time"], temperature=0, max_tokens=2),
    completion("one-prompt-list", ["Hello there"], temperature=0, max_tokens=3),
    parts("text-parts", ["Hello ", "there"], temperature=0, max_tokens=4),
    chat("json-object", "Hello", temperature=0, response_format={"type": "json_object"}),
    chat("json-schema", "Hello", temperature=0,
         response_format={"type": "json_schema", "json_schema": {"name": "point", "strict": True, "schema": SCHEMA}}),
]


def choice_tokens(row) -> int:
    return row["response"]["body"]["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def answers(tmp_path_factory, tiny_checkpoint):
    result, got = run_job(tmp_path_factory.mktemp("job"), ROWS, checkpoint=tiny_checkpoint)
    assert result.exit_code == 1, result.output  # some rows are errors, on purpose
    return got


@pytest.mark.parametrize("custom_id", ["top-without-logprobs", "top-alone"])
def test_top_logprobs_needs_logprobs_true(answers, custom_id):
    row = answers[custom_id]
    assert row["response"] is None
    assert "top_logprobs" in row["error"]["message"] and '"logprobs": true' in row["error"]["message"]


def test_completion_logprobs_zero_gives_each_chosen_tokens_logprob(answers, greedy):
    """OpenAI: logprobs 0 still returns the chosen tokens' logprobs, with no alternatives."""
    want = greedy("Once upon a time", 3)
    [choice] = answers["logprobs-0"]["response"]["body"]["choices"]
    logprobs = choice["logprobs"]
    assert logprobs is not None
    assert len(logprobs["tokens"]) == len(want["ids"]) == choice_tokens(answers["logprobs-0"])
    assert [t for t, i in zip(logprobs["tokens"], want["ids"]) if i != EOS] == want["tokens"]
    assert logprobs["token_logprobs"] == pytest.approx(
        [step[token].item() for step, token in zip(want["logprobs"], want["ids"])], abs=1e-4)
    assert logprobs["top_logprobs"] == [{}] * len(want["ids"])


def test_a_prompt_list_of_several_prompts_is_refused(answers):
    row = answers["two-prompts"]
    assert row["response"] is None and 'body field "prompt"' in row["error"]["message"]


def test_a_prompt_list_of_one_is_that_prompt(answers, greedy):
    [choice] = answers["one-prompt-list"]["response"]["body"]["choices"]
    assert choice["text"] == greedy("Hello there", 3)["text"]


def test_text_parts_are_the_message_as_written(answers, greedy):
    """Content parts join with nothing between them (OpenAI's reading): the model sees "Hello there"."""
    [choice] = answers["text-parts"]["response"]["body"]["choices"]
    assert choice["message"]["content"] == greedy("Hello there", 4, chat_form=True)["text"]


@pytest.mark.parametrize(("custom_id", "schema"), [("json-object", {"type": "object"}), ("json-schema", SCHEMA)])
def test_response_format_is_enforced(answers, custom_id, schema):
    """The text is JSON of the schema (whole when the row ended by itself, else a start of it)."""
    import jsonschema

    row = answers[custom_id]
    assert row["error"] is None, row["error"]
    [choice] = row["response"]["body"]["choices"]
    content = choice["message"]["content"]
    assert content.startswith("{"), content
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(content), schema)
