"""Prompt lookup decodes exactly the tokens plain greedy decoding gives (lmcli.generation.speculative)."""

from __future__ import annotations

import re

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401  (a fixture)
from real_models import gemma_gguf, smollm2_gguf  # noqa: F401  (fixtures)
from tiny import CASES, VOCAB, left_pad, prompts

import lmcli
from lmcli.generation import speculative
from lmcli.generation.sampling import LogitBias, NoRepeatNGram, RepetitionPenalty

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: per-op overhead


def grounded(n: int, seed: int) -> torch.Tensor:
    """A prompt that repeats a random passage: text to look up, as in 'repeat this text'."""
    passage = prompts([n], seed=seed)[0]
    return torch.cat([passage, prompts([3], seed=seed + 50)[0], passage[: n // 2]])


def plain(model, ids, n, **kwargs):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_lookup_equals_plain_greedy_on_every_architecture(tiny_models, case):
    model = tiny_models(case)
    stats = speculative.SpeculationStats()
    for prompt, k in [(grounded(9, 3), 4), (grounded(7, 4), 2), (prompts([11], seed=5)[0], 3)]:
        ids = prompt[None]
        expected = plain(model, ids, 30)
        got = model.generate(ids, max_new_tokens=30, do_sample=False, prompt_lookup=k, stats=stats)
        assert torch.equal(got, expected), (case, prompt.tolist(), k)
    # The speculative path itself ran: guesses were made, some kept, in fewer passes than tokens.
    assert stats.enabled and stats.accepted > 0 and stats.drafted > stats.accepted - 1
    assert stats.passes < 3 * 30


@pytest.mark.parametrize("case", ["gemma3_text", "qwen2-window", "llama"])
def test_prompt_lookup_with_processors_and_a_padded_batch_equals_plain(tiny_models, case):
    model = tiny_models(case)
    rows = [grounded(8, 7), prompts([5], seed=8)[0], grounded(6, 9)]
    ids, mask = left_pad(rows)
    pads = (mask == 0).sum(-1).tolist()
    processors = [RepetitionPenalty(1.3), LogitBias({5: 2.0, 7: -1.5}), NoRepeatNGram(4, pad_counts=pads)]
    kwargs = dict(attention_mask=mask, eos_token_id=2, pad_token_id=0, logits_processors=processors)
    expected = plain(model, ids, 25, **kwargs)
    events: list[list[int]] = []

    def on_token(event):
        events.append(event.token_id.tolist())

    got = model.generate(ids, max_new_tokens=25, do_sample=False, prompt_lookup=5, on_token=on_token, **kwargs)
    assert torch.equal(got, expected)
    # The steps replayed in batch shape are the plain loop's.
    assert torch.equal(torch.tensor(events).T, expected[:, ids.shape[1]:])


def test_a_row_ends_at_eos_as_plain_greedy_does(tiny_models):
    model = tiny_models("llama")
    ids = grounded(9, 3)[None]
    free = plain(model, ids, 20)[0, ids.shape[1]:].tolist()
    eos = free[6]  # a token the text reaches: as EOS it ends the row there
    expected = plain(model, ids, 20, eos_token_id=eos)
    assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False, prompt_lookup=4, eos_token_id=eos),
                       expected)
    assert expected.shape[1] == ids.shape[1] + free.index(eos) + 1


def test_past_the_context_speculation_is_off_and_the_result_plain(tiny_models):
    model = tiny_models("mistral")  # 64 positions
    ids = prompts([40], seed=2)[0][None]
    stats = speculative.SpeculationStats()
    got = model.generate(ids, max_new_tokens=30, do_sample=False, prompt_lookup=4, stats=stats)
    assert not stats.enabled and torch.equal(got, plain(model, ids, 30))


@pytest.mark.parametrize("bad", [0, -1, 10**9, 2.0, True])
def test_num_draft_tokens_out_of_bounds_is_refused(tiny_models, bad):
    model = tiny_models("llama")
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer from 1 to"):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=3, do_sample=False, prompt_lookup=bad)


def test_lookup_proposes_what_followed_the_latest_ngram():
    tokens = [5, 6, 7, 8, 9, 5, 6]
    lookup = speculative.NgramLookup(tokens)
    assert lookup.propose(3) == [7, 8, 9]
    tokens.append(10)  # (6, 10) was never seen
    assert lookup.propose(3) == []
    assert VOCAB > 10


PASSAGE = ("The river rises in the northern hills, runs south through three small towns, and meets the sea at "
           "a wide muddy delta where fishermen have worked for centuries, mending their nets each winter.")
CODE = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n"


@pytest.mark.full  # minutes on a busy machine: loads the real models
@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_real_models_prompt_lookup_equals_plain_greedy(request, which):
    # bfloat16 activations: each guess is verified as a one-token step computes it, so even near-ties
    # come out as plain greedy's (a chunk of guesses in one attention call rounded some differently).
    path = request.getfixturevalue("smollm2_gguf" if which == "smollm2" else "gemma_gguf")
    model, tokenizer = lmcli.load(path)
    stats = speculative.SpeculationStats()
    for prompt in (f"Repeat this text exactly: {PASSAGE}\nThe river rises",
                   f"Rename add to plus in this code:\n{CODE}\nAnswer:\n", "Once upon a time"):
        ids = torch.tensor([tokenizer.encode(prompt)])
        expected = plain(model, ids, 40)
        got = model.generate(ids, max_new_tokens=40, do_sample=False, prompt_lookup=8, stats=stats)
        assert got.tolist() == expected.tolist(), prompt
    assert stats.accepted > 20


def test_cli_prompt_lookup_prints_plain_greedy_text_and_its_stats(tiny_checkpoint):
    from test_cli import cli

    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    flags = ["generate", "-c", tiny_checkpoint, "--greedy", "-n", 24, "--ignore-eos", "--stats"]
    expected = cli(*flags, prompt)
    got = cli(*flags, "--prompt-lookup", "--num-draft-tokens", 4, prompt)
    assert expected.exit_code == got.exit_code == 0
    assert got.stdout == expected.stdout and got.stdout.strip()
    assert re.search(r"prompt lookup: \d+ drafted, \d+ accepted", got.stderr)
    for bad in (0, 10**9):
        refused = cli(*flags, "--prompt-lookup", "--num-draft-tokens", bad, prompt)
        assert refused.exit_code == 2 and "--num-draft-tokens must be an integer from 1 to 64" in refused.stderr
    refused = cli(*flags, "--num-draft-tokens", 3, prompt)
    assert refused.exit_code == 2 and "--num-draft-tokens needs --prompt-lookup" in refused.stderr



@pytest.mark.full  # loads the default model
def test_a_verify_pass_gives_each_guess_a_one_token_steps_logits(smollm2_gguf):
    # bfloat16 with batch-invariant attention: a row's queries are the attention call's batch, so one
    # call of several queries gives each what a call of one gives it (with them as rows of one matrix,
    # every guess here came out different).
    from lmcli.generation.loop import positions_from_mask

    model, tokenizer = lmcli.load(smollm2_gguf)
    ids = torch.tensor([tokenizer.encode(f"Repeat this text exactly: {PASSAGE}\nThe river rises in the northern")])
    width = ids.shape[1]
    slot_is_token = torch.ones((1, width + 4), dtype=torch.bool)
    positions = positions_from_mask(slot_is_token)
    start = width - 7  # the last 7 tokens play a verify pass's newest token and guesses

    def run(chunked: bool) -> torch.Tensor:
        cache = model.init_cache(1, width + 4, rollback=8)
        model.forward_slots(ids[:, :start], positions[:, :start], torch.arange(start), slot_is_token, cache,
                            last_only=True)
        if chunked:
            return model.forward_slots(ids[:, start:], positions[:, start:width], torch.arange(start, width),
                                       slot_is_token, cache)[0]
        return torch.cat([model.forward_slots(ids[:, s:s + 1], positions[:, s:s + 1], torch.arange(s, s + 1),
                                              slot_is_token, cache)[0] for s in range(start, width)])

    with torch.inference_mode():
        assert torch.equal(run(True), run(False))
