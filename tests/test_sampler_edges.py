"""The sampler chain where settings meet on the same tokens, and the edges of single samplers.

References: transformers' processors chained in transformers' order (sequence bias, repetition
penalty, n-gram blocking, min-new-tokens, then the warpers), with OpenAI's presence/frequency formula
written out here at the place lmcli documents for it (after the repetition penalty, before the warpers).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TypicalLogitsWarper,
)

from lmcli.generation.sampling import NoRepeatNGram, PresencePenalty, SamplingSettings, TypicalP

V = 16


def openai(ids, logits, prompt_length, presence, frequency):
    out = logits.clone()
    for row in range(len(ids)):
        for token, count in Counter(ids[row, prompt_length:].tolist()).items():
            out[row, token] -= count * frequency + presence
    return out


def reference_chain(ids, logits, *, prompt_length, bias, repetition, presence, frequency, temperature, top_k):
    out = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(ids, logits.clone())
    out = RepetitionPenaltyLogitsProcessor(repetition)(ids, out)
    out = openai(ids, out, prompt_length, presence, frequency)
    out = TemperatureLogitsWarper(temperature)(ids, out)
    return TopKLogitsWarper(top_k)(ids, out)


@pytest.mark.parametrize("repetition", [0.7, 1.6])
@pytest.mark.parametrize("signs", [(1.0, 1.0), (-1.0, 0.5), (0.8, -0.6)])
def test_bias_and_all_three_penalties_on_the_same_tokens(repetition, signs):
    """Tokens 3, 5 and 9 are biased, in the prompt, and generated again: every setting acts on them."""
    presence, frequency = signs
    generator = torch.Generator().manual_seed(7)
    prompt_length = 6
    ids = torch.tensor([[3, 5, 9, 1, 2, 4, 3, 3, 5, 9, 0],
                        [9, 9, 5, 3, 7, 8, 5, 5, 3, 6, 9]])
    logits = torch.randn(2, V, generator=generator) * 3
    bias = {3: 2.5, 5: -1.5, 9: 4.0}
    values = dict(logit_bias=bias, repetition_penalty=repetition, presence_penalty=presence,
                  frequency_penalty=frequency, temperature=0.7, top_k=6)
    do_sample, processors = SamplingSettings(**values).policy(prompt_length=prompt_length, vocab_size=V)
    assert do_sample
    got = logits
    for processor in processors:
        got = processor(ids, got)
    want = reference_chain(ids, logits, prompt_length=prompt_length, bias=bias, repetition=repetition,
                           presence=presence, frequency=frequency, temperature=0.7, top_k=6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_presence_penalty_ignores_the_prompts_tokens():
    """OpenAI counts generated tokens only: a token seen only in the prompt keeps its logit."""
    ids = torch.tensor([[4, 4, 4, 7, 8]])  # prompt 4 4 4, generated 7 8
    logits = torch.zeros(1, V)
    got = PresencePenalty(1.0, prompt_length=3)(ids, logits)
    assert got[0, 4] == 0 and got[0, 7] == -1 and got[0, 8] == -1
    assert torch.equal(got, openai(ids, logits, 3, 1.0, 0.0))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ngram_blocking_when_the_text_is_exactly_n_long(n):
    """At length n there is one complete n-gram; its first n-1 tokens are not the current suffix
    unless they repeat, so transformers blocks exactly what the written-out rule blocks."""
    for ids in (torch.tensor([[1] * n]), torch.tensor([list(range(1, n + 1))]), torch.tensor([[2, 2] * n][:1])[:, :n]):
        logits = torch.zeros(1, V)
        got = NoRepeatNGram(n)(ids, logits)
        assert torch.equal(got, NoRepeatNGramLogitsProcessor(n)(ids, logits.clone()))
        tokens = ids[0].tolist()
        banned = {tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tokens[i:i + n - 1] == tokens[-(n - 1):]}
        assert {t for t in range(V) if got[0, t] == float("-inf")} == banned


@pytest.mark.parametrize("mass", [0.25, 0.5, 0.75])
def test_typical_p_at_an_exact_tie(mass):
    """Four equally likely tokens: each has the same surprise, so the cut falls inside a tie; transformers
    keeps the tokens its stable sort puts first."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -30.0, -30.0] + [-30.0] * (V - 6)])
    got = TypicalP(mass)(None, logits)  # type: ignore[arg-type]  # it ignores input_ids
    want = TypicalLogitsWarper(mass)(None, logits.clone())
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.isfinite(got).sum() >= 1


def test_padded_batch_rows_equal_transformers_processors_alone(tmp_path, one_thread):
    """Each row of a left-padded batch sampled through lmcli's chain equals the row sampled alone through
    transformers' processors (and OpenAI's penalties written out), under the same seeded stream."""
    from tiny import PAD, VOCAB, left_pad, prompts, save_reference
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        MinPLogitsWarper,
    )

    import lmcli

    save_reference("llama", tmp_path)
    model = lmcli.load(tmp_path)[0]
    # Rows that start and end with the same token: the pads (copies of the first token) must form no
    # n-gram, so a row may still repeat its last token (made likely by the bias on 11) as it does alone.
    rows = [torch.tensor([11, 12, 11]), *prompts([9], seed=31), torch.tensor([11, 40, 41, 42, 11])]
    ids, mask = left_pad(rows)
    values: dict[str, Any] = dict(temperature=0.9, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                  no_repeat_ngram_size=2, min_new_tokens=4, logit_bias={5: 2.0, 7: -100.0, 11: 6.0})
    width = ids.shape[1]
    do_sample, processors = SamplingSettings(**values).policy(
        prompt_length=width, pad_counts=[width - len(r) for r in rows], eos_token_ids=[2], vocab_size=VOCAB)
    batch = model.generate(ids, 10, do_sample, attention_mask=mask, seed=[1, 2, 3], logits_processors=processors,
                           eos_token_id=2, pad_token_id=PAD)
    for i, row in enumerate(rows):
        length = len(row)
        reference = LogitsProcessorList([
            SequenceBiasLogitsProcessor([[[5], 2.0], [[7], -100.0], [[11], 6.0]]),
            RepetitionPenaltyLogitsProcessor(1.3),
            lambda x, s, n=length: openai(x, s, n, 0.5, 0.3),
            NoRepeatNGramLogitsProcessor(2),
            MinNewTokensLengthLogitsProcessor(length, 4, 2),
            TemperatureLogitsWarper(0.9),
            MinPLogitsWarper(0.05),
        ])
        alone = model.generate(row[None], 10, True, seed=[i + 1], logits_processors=[reference],
                               eos_token_id=2, pad_token_id=PAD)
        got = batch[i, width - length:][: alone.shape[1]]
        assert got.tolist() == alone[0].tolist(), i
