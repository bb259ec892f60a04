"""Chat sequences users hit, each reply compared by LOG-PROBABILITIES with `model.generate` run without a
cache over the whole conversation as the template renders it (a greedy-token match alone lets a cache
that is slightly off pass): /undo then the same message again, /undo of the only exchange, /undo back
past turns the context dropped (they stay dropped), and a saved transcript resumed (with a flag) through the CLI.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_fixtures import run_lmcli, tiny_checkpoint  # noqa: F401 (fixture)
from test_chat import CharTokenizer, greedy, reply_text

import lmcli
from lmcli.chat.repl import ChatSession

pytestmark = pytest.mark.usefixtures("one_thread")
TOP = 4


def fresh(model, tokenizer, messages, n, **sampling):
    """(tokens, per-step log-softmax) of a cache-free run over the rendered conversation."""
    ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    steps: list[torch.Tensor] = []
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, use_cache=False,
                         eos_token_id=tokenizer.eos_token_ids,
                         on_token=lambda e: steps.append(torch.log_softmax(e.logits[0].float(), -1)),
                         **({"do_sample": False} | sampling))
    tokens = out[0, len(ids):].tolist()
    return tokens, steps


def assert_same_distribution(turn, model, tokenizer, messages, n):
    tokens, steps = fresh(model, tokenizer, messages, n)
    assert turn.result.tokens == tokens
    assert len(turn.result.logprobs) == len(tokens)
    for got, want, token in zip(turn.result.logprobs, steps, tokens):
        assert got["logprob"] == pytest.approx(want[token].item(), abs=1e-4)
        top = want.topk(TOP).values.tolist()
        assert [t["logprob"] for t in got["top"]] == pytest.approx(top, abs=1e-4)


def session_for(tiny_models, case, n, context=64, system=None):
    return ChatSession(tiny_models(case), CharTokenizer(), greedy(n, logprobs=TOP), context=context, system=system)


@pytest.mark.parametrize("case", ["llama", "gemma2"])  # a static cache; sliding layers on a ring
def test_undo_then_the_same_message_again(tiny_models, case):
    n, tokenizer = 6, CharTokenizer()
    session = session_for(tiny_models, case, n)
    model = tiny_models(case)
    u1, u2 = tokenizer.text(10, 11, 12, 13), tokenizer.text(20, 21, 22)
    first = session.reply(u1)
    a1 = {"role": "assistant", "content": reply_text(tokenizer, first.result.tokens)}
    second = session.reply(u2)
    conversation = [{"role": "user", "content": u1}, a1, {"role": "user", "content": u2}]
    assert_same_distribution(second, model, tokenizer, conversation, n)
    assert session.undo()
    again = session.reply(u2)  # the cache was rewound: the same message must give the same reply
    assert_same_distribution(again, model, tokenizer, conversation, n)
    assert again.result.tokens == second.result.tokens


@pytest.mark.parametrize("case", ["llama", "gemma2"])
def test_undo_of_the_only_exchange(tiny_models, case):
    n, tokenizer = 5, CharTokenizer()
    session = session_for(tiny_models, case, n)
    model = tiny_models(case)
    session.reply(tokenizer.text(10, 11, 12))
    assert session.undo()
    assert session.messages == [] and not session.undo()
    u = tokenizer.text(30, 31, 32, 33)
    turn = session.reply(u)
    assert_same_distribution(turn, model, tokenizer, [{"role": "user", "content": u}], n)


@pytest.mark.parametrize("case", ["llama", "gemma2"])
def test_undo_back_past_the_dropped_turns(tiny_models, case):
    n, tokenizer = 4, CharTokenizer()
    system = tokenizer.text(50, 51, 52)
    session = session_for(tiny_models, case, n, system=system)
    model = tiny_models(case)
    dropped = False
    for index in range(9):
        turn = session.reply(tokenizer.text(*range(10 + index, 18 + index)))
        dropped = dropped or turn.dropped_messages > 0
    assert dropped and session.hidden > 0, "the conversation never outgrew the context"
    exchanges = (len(session.messages) - 1) // 2
    for _ in range(exchanges - 1):  # back to the first exchange: what was dropped must come back
        assert session.undo()
    # Dropped messages stay dropped (the model saw the conversation without them); the undone ones are gone.
    assert 0 < session.hidden <= len(session.messages) - 1
    kept = session.messages[1:]
    u = tokenizer.text(60, 61, 62)
    turn = session.reply(u)
    assert session.messages[1:-2] == kept
    visible = [{"role": "system", "content": system}, *session.messages[1 + session.hidden:-1]]
    assert visible[-1] == {"role": "user", "content": u}
    assert_same_distribution(turn, model, tokenizer, visible, n)


def test_a_resumed_transcript_restores_the_context_and_takes_a_flag(tiny_checkpoint, tmp_path):
    """Save after one exchange, resume with -n 3 (a flag): the next reply is model.generate over the
    whole restored conversation with 3 new tokens."""
    model, tokenizer = lmcli.load(tiny_checkpoint)
    saved = tmp_path / "talk.json"
    result = run_lmcli("chat", "-c", str(tiny_checkpoint), "--greedy", "-n", "5",
                       input=f"Hello there\n/save {saved}\n")
    assert result.returncode == 0, result.stderr
    transcript = json.loads(saved.read_text())
    first = [m for m in transcript["messages"] if m["role"] != "system"]
    assert [m["role"] for m in first] == ["user", "assistant"]
    want, _ = fresh(model, tokenizer, first[:1], 5)
    assert first[1]["content"] == reply_text(tokenizer, want)

    result = run_lmcli("chat", "-c", str(tiny_checkpoint), "--resume", str(saved), "-n", "3",
                       input="And then?\n")
    assert result.returncode == 0, result.stderr
    conversation = [*first, {"role": "user", "content": "And then?"}]
    tokens, _ = fresh(model, tokenizer, conversation, 3)
    assert len(tokens) <= 3
    assert result.stdout.decode() == reply_text(tokenizer, tokens) + "\n"
