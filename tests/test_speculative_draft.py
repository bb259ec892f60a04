"""A draft model's speculation decodes exactly plain greedy's tokens (lmcli.generation.speculative), and a
draft with another tokenizer is refused."""

from __future__ import annotations

import pytest
import torch
from real_models import smollm2_gguf  # noqa: F401  (a fixture)
from tiny import left_pad, prompts

import lmcli
from lmcli.generation import speculative
from lmcli.generation.speculative_draft import DraftMismatch, check_same_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: per-op overhead

# (target, draft): a draft of another architecture (same vocabulary) agrees now and then, so rows accept
# ragged numbers of guesses; the target as its own draft agrees always, so guesses are taken whole.
PAIRS = [("llama", "qwen2"), ("gemma3_text", "llama"), ("qwen2-window", "qwen2-window")]


def plain(model, ids, n, **kwargs):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kwargs)


@pytest.mark.parametrize("target_case, draft_case", PAIRS)
def test_draft_model_speculation_equals_plain_greedy_single_and_in_a_padded_batch(tiny_models, target_case,
                                                                                  draft_case):
    target, draft = tiny_models(target_case), tiny_models(draft_case)
    stats = speculative.SpeculationStats()
    rows = [prompts([9], seed=3)[0], prompts([4], seed=4)[0], prompts([7], seed=5)[0]]
    ids, mask = left_pad(rows)
    kwargs = dict(attention_mask=mask, eos_token_id=2, pad_token_id=0)
    expected = plain(target, ids, 24, **kwargs)
    got = target.generate(ids, max_new_tokens=24, do_sample=False, draft_model=draft, num_draft_tokens=4,
                          stats=stats, **kwargs)
    assert torch.equal(got, expected)
    for row in rows:  # alone, each row is the batch's row
        alone = target.generate(row[None], max_new_tokens=24, do_sample=False, draft_model=draft, num_draft_tokens=3,
                                eos_token_id=2)
        assert torch.equal(alone, plain(target, row[None], 24, eos_token_id=2))
    assert stats.enabled and stats.drafted > 0 and stats.draft_passes >= stats.drafted
    if target_case == draft_case:
        # Its own draft agrees but where the draft, reading the prompt and first token in one chunk,
        # rounds differently from the target's one-token step (float attention is not chunk-invariant).
        assert stats.accepted >= 0.9 * stats.drafted
    else:
        assert stats.accepted < stats.drafted


def test_a_draft_past_its_context_switches_speculation_off(tiny_models):
    target, draft = tiny_models("llama"), tiny_models("mistral")  # both 64 positions
    ids = prompts([40], seed=2)[0][None]
    stats = speculative.SpeculationStats()
    got = target.generate(ids, max_new_tokens=30, do_sample=False, draft_model=draft, stats=stats)
    assert not stats.enabled and "context" in (stats.note or "")
    assert torch.equal(got, plain(target, ids, 30))


def test_prompt_lookup_and_a_draft_together_are_refused(tiny_models):
    model = tiny_models("llama")
    with pytest.raises(ValueError, match="prompt_lookup=K is its own num_draft_tokens"):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=3, do_sample=False, prompt_lookup=2, draft_model=model)


def test_another_tokenizer_is_named_with_both_models(tmp_path):
    from cli_fixtures import build_tokenizer

    from lmcli.io.tokenizer import load_tokenizer

    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    build_tokenizer(tmp_path / "c", vocab_size=300)
    a, b, c = (load_tokenizer(tmp_path / name) for name in "abc")
    assert a is not None and b is not None and c is not None
    check_same_tokenizer(a, b, "A", "B")  # trained alike: the same tokenizer
    with pytest.raises(DraftMismatch, match=r"the draft model C has another vocabulary .* than A"):
        check_same_tokenizer(a, c, "A", "C")


@pytest.mark.full  # minutes on a busy machine: loads the default model twice
def test_real_default_model_as_the_draft_of_its_int8_self_equals_plain_greedy(smollm2_gguf):
    target, tokenizer = lmcli.load(smollm2_gguf, quantize="int8")  # twice the bytes a token
    draft, _ = lmcli.load(smollm2_gguf)  # the file's own int4 weights
    stats = speculative.SpeculationStats()
    for prompt in ("Repeat this text exactly: the quick brown fox jumps over the lazy dog.", "Once upon a time"):
        ids = torch.tensor([tokenizer.encode(prompt)])
        expected = plain(target, ids, 32)
        got = target.generate(ids, max_new_tokens=32, do_sample=False, draft_model=draft, num_draft_tokens=4,
                              stats=stats)
        assert got.tolist() == expected.tolist(), prompt
    assert stats.accepted > stats.drafted // 2
