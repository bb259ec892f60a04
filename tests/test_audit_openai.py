"""OpenAI batch request fields a user can write and the earlier tests did not read (found by the planted-bug
audit, docs/testing.md): `top_logprobs` without `"logprobs": true`, completions `"logprobs": 0`, a
`prompt` list, chat content given as text parts.

One job runs every row; each answer is checked against OpenAI's rules written out here and against
`model.generate` called directly on transformers' token ids (test_openai_batch_fields.greedy).
"""

from __future__ import annotations

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from test_openai_batch_fields import chat, completion, greedy, run_job  # noqa: F401 (greedy: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = 1


def parts(custom_id, texts, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}], **body}}


ROWS = [
    chat("top-without-logprobs", "Hello", temperature=0, max_tokens=2, logprobs=False, top_logprobs=2),
    chat("top-alone", "Hello", temperature=0, max_tokens=2, top_logprobs=2),
    completion("logprobs-0", "Once upon a time", temperature=0, max_tokens=3, logprobs=0),
    completion("two-prompts", ["Hello", "Once upon a time"], temperature=0, max_tokens=2),
    completion("one-prompt-list", ["Hello there"], temperature=0, max_tokens=3),
    parts("text-parts", ["Hello ", "there"], temperature=0, max_tokens=4),
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
