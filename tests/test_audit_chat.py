"""Chat commands and resumes the earlier tests did not reach (found by the planted-bug audit,
docs/testing.md): /clear with a system message, //text, /set greedy, a transcript that starts with a
system message, and --context given beside --resume.

Each reply is compared with `model.generate` run without a cache over the conversation the user
wrote (test_chat.fresh_reply), never with another chat run.
"""

from __future__ import annotations

import json

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from test_chat import CharTokenizer, cli, fresh_reply, greedy, reply_text

import lmcli
from lmcli.chat.repl import ChatSession

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return lmcli.load(tiny_checkpoint)


def test_clear_keeps_the_system_message(tiny_models):
    model, tokenizer, n = tiny_models("llama"), CharTokenizer(), 4
    system = {"role": "system", "content": tokenizer.text(50, 51, 52)}
    session = ChatSession(model, tokenizer, greedy(n), context=64, system=system["content"])
    session.reply(tokenizer.text(10, 11, 12))
    session.clear()
    assert session.messages == [system]
    message = {"role": "user", "content": tokenizer.text(20, 21)}
    turn = session.reply(message["content"])
    assert turn.result.tokens == fresh_reply(model, tokenizer, [system, message], n)


def test_set_greedy_on_and_off(tiny_models):
    session = ChatSession(tiny_models("llama"), CharTokenizer(), greedy(4, temperature=None), context=64)
    assert session.set_setting("greedy", "on").temperature == 0
    assert session.set_setting("greedy", "off").temperature > 0
    assert session.set_setting("greedy", "yes").temperature == 0


def test_double_slash_sends_the_text_with_one_slash(tiny_checkpoint, loaded):
    model, tokenizer = loaded
    result = cli("chat", "-c", tiny_checkpoint, "--greedy", "-n", "4", input="//help me\n")
    assert result.exit_code == 0, result.output
    want = fresh_reply(model, tokenizer, [{"role": "user", "content": "/help me"}], 4)
    assert result.stdout == reply_text(tokenizer, want) + "\n"


def transcript(path, messages, context=None):
    data = {"format": "lmcli-chat/1", "messages": messages, "settings": {}, "model": {}}
    if context is not None:
        data["context"] = context
    path.write_text(json.dumps(data))
    return path


def test_a_transcript_that_starts_with_a_system_message_resumes(tiny_checkpoint, loaded, tmp_path):
    model, tokenizer = loaded
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there"}]
    saved = transcript(tmp_path / "talk.json", messages)
    result = cli("chat", "-c", tiny_checkpoint, "--resume", saved, "--greedy", "-n", "3", input="And then?\n")
    assert result.exit_code == 0, result.output
    want = fresh_reply(model, tokenizer, [*messages, {"role": "user", "content": "And then?"}], 3)
    assert result.stdout == reply_text(tokenizer, want) + "\n"

    late = transcript(tmp_path / "late.json", [messages[1], messages[0]])  # only the first may be a system message
    result = cli("chat", "-c", tiny_checkpoint, "--resume", late, input="Hi\n")
    assert result.exit_code == 1 and "message 2 is a system message" in result.stderr


def test_context_flag_wins_over_the_transcripts(tiny_checkpoint, tmp_path):
    """The transcript says 64 tokens; --context 200 with -n 100 must be taken (64 would leave no room)."""
    saved = transcript(tmp_path / "talk.json", [{"role": "user", "content": "Hello"},
                                                {"role": "assistant", "content": "Hi"}], context=64)
    result = cli("chat", "-c", tiny_checkpoint, "--resume", saved, "--context", "200", "--greedy", "-n", "100",
                 input="And then?\n")
    assert result.exit_code == 0, result.output
    result = cli("chat", "-c", tiny_checkpoint, "--resume", saved, "--greedy", "-n", "100", input="And then?\n")
    assert result.exit_code == 2 and "64-token context" in result.stderr  # the transcript's, without the flag
