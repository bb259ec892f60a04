"""Prompt lookup where the earlier tests did not look (found by the planted-bug audit, docs/testing.md): a
batched row that the caller stops from `on_token` (as a stop string does), a row whose guess runs past
its end-of-text token, and a guess that would run past max_new_tokens. The reference is plain greedy
decoding, `model.generate(..., do_sample=False)` without prompt lookup, given the same callback.
"""

from __future__ import annotations

import pytest
import torch
from test_speculative import grounded, plain
from tiny import left_pad, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def stopper(at: dict[int, int]):
    """on_token that ends row r after its at[r]-th new token, recording every step's tokens."""
    steps: list[list[int]] = []

    def on_token(event):
        steps.append(event.token_id.tolist())
        return torch.tensor([event.length[i].item() >= at.get(i, 10**6) for i in range(len(event.token_id))])

    return on_token, steps


@pytest.mark.parametrize("case", ["llama", "qwen2-window"])
def test_a_batched_row_stopped_by_the_caller_equals_plain(tiny_models, case):
    model = tiny_models(case)
    ids, mask = left_pad([grounded(8, 7), grounded(6, 9), grounded(7, 3)])
    kwargs = dict(attention_mask=mask, eos_token_id=None, pad_token_id=0)
    plain_stop, plain_steps = stopper({0: 3, 2: 7})
    expected = plain(model, ids, 12, on_token=plain_stop, **kwargs)
    lookup_stop, lookup_steps = stopper({0: 3, 2: 7})
    got = model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup=4, on_token=lookup_stop, **kwargs)
    assert torch.equal(got, expected)
    assert lookup_steps == plain_steps


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_the_length_is_max_new_tokens_whatever_the_guess(tiny_models, n):
    model = tiny_models("llama")
    ids = grounded(9, 3)[None]  # a passage that repeats: long guesses
    expected = plain(model, ids, n)
    got = model.generate(ids, max_new_tokens=n, do_sample=False, prompt_lookup=8)
    assert torch.equal(got, expected) and got.shape[1] == ids.shape[1] + n


def test_end_of_text_inside_a_taken_guess_ends_the_row(tiny_models):
    """The text is forced (by a processor both paths apply) to continue the passage the prompt repeats, so
    every guess is taken; an end-of-text token in the middle of a taken guess must end the row there."""
    model = tiny_models("llama")
    passage = prompts([12], seed=3)[0].tolist()
    prompt = [*passage, 40, 41, 42, *passage[:3]]  # the latest 3-gram recurs: lookup guesses passage[3:]
    target = passage[3:]

    def follow_the_passage(ids, scores):
        step = ids.shape[1] - len(prompt)
        scores = scores.clone()
        if step < len(target):
            scores[:, target[step]] += 100.0
        return scores

    for at in (2, 4):
        eos = target[at]
        if eos in target[:at]:
            continue
        kwargs = dict(eos_token_id=eos, logits_processors=[follow_the_passage])
        ids = torch.tensor([prompt])
        expected = plain(model, ids, 8, **kwargs)
        assert expected[0, len(prompt):].tolist() == target[: at + 1]
        got = model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup=8, **kwargs)
        assert torch.equal(got, expected), at


def test_processors_see_a_padded_rows_pads_as_plain_decoding_shows_them(tiny_models):
    """Whatever value fills a row's pad slots, processors that read the text (a repetition penalty) see
    what the plain loop shows them, so a pad value that is also the row's best next token changes nothing."""
    from lmcli.generation.sampling import RepetitionPenalty

    model = tiny_models("llama")
    long_row, short_row = grounded(8, 7), grounded(3, 11)
    penalty = [RepetitionPenalty(8.0)]
    best = plain(model, short_row[None], 1, logits_processors=penalty)[0, -1].item()
    assert best not in short_row.tolist()  # else the penalty applies to it anyway (not with these seeds)
    ids, mask = left_pad([long_row, short_row], pad=best)
    kwargs = dict(attention_mask=mask, eos_token_id=None, pad_token_id=0, logits_processors=penalty)
    expected = plain(model, ids, 10, **kwargs)
    got = model.generate(ids, max_new_tokens=10, do_sample=False, prompt_lookup=4, **kwargs)
    assert torch.equal(got, expected)
