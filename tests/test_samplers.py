"""The samplers beyond temperature/top-k/top-p, and the order of the chain built from settings,
checked against transformers' processors of the same name (and, where transformers has none, against
OpenAI's formula written out by hand)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from tiny import PAD, VOCAB, left_pad, prompts, save_reference
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TypicalLogitsWarper,
)

import lmcli
from lmcli.generation.sampling import (
    FrequencyPenalty,
    LogitBias,
    MinNewTokens,
    MinP,
    NoRepeatNGram,
    PresencePenalty,
    RepetitionPenalty,
    SamplingError,
    SamplingSettings,
    Temperature,
    TypicalP,
    row_generators,
    sample,
)

V = 97

pytestmark = pytest.mark.usefixtures("one_thread")


def random_logits(rows=32, seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=generator) * scale


def random_ids(rows, length, seed=1, vocab=V):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


# --- each processor equals transformers' ----------------------------------------------------------


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.5, 0.9, 1.0])
def test_min_p_equals_transformers(min_p):
    logits = random_logits()
    got = MinP(min_p)(None, logits)  # type: ignore[arg-type]  # these processors ignore input_ids, as transformers' do
    assert torch.equal(got, MinPLogitsWarper(min_p)(None, logits))  # type: ignore[arg-type]  # these processors ignore input_ids, as transformers' do
    kept = torch.isfinite(got)
    assert kept.gather(1, logits.argmax(-1, keepdim=True)).all()  # the best token always stays


@pytest.mark.parametrize("mass", [0.05, 0.2, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_typical_p_equals_transformers(mass, scale):
    logits = random_logits(scale=scale)
    got = TypicalP(mass)(None, logits)  # type: ignore[arg-type]  # these processors ignore input_ids, as transformers' do
    assert torch.equal(got, TypicalLogitsWarper(mass)(None, logits))
    assert torch.isfinite(got).sum(-1).min() >= 1


def test_typical_p_can_drop_the_most_likely_token():
    """What sets it apart from top-p: with one dominant token among many near-uniform ones, the
    dominant token is atypical (its surprise is far below the entropy)."""
    logits = torch.cat([torch.tensor([[6.0]]), torch.zeros(1, 1000)], dim=1)
    kept = torch.isfinite(TypicalP(0.2)(None, logits))  # type: ignore[arg-type]  # these processors ignore input_ids, as transformers' do
    assert not kept[0, 0] and kept.sum() > 1
    assert torch.equal(kept, torch.isfinite(TypicalLogitsWarper(0.2)(None, logits)))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_equals_transformers(n):
    ids = random_ids(8, 40, vocab=6)  # a small alphabet: plenty of repeated n-grams
    logits = random_logits(8)
    got = NoRepeatNGram(n)(ids, logits)
    assert torch.equal(got, NoRepeatNGramLogitsProcessor(n)(ids, logits.clone()))
    assert (~torch.isfinite(got)).any()  # something was blocked
    short = ids[:, : n - 1]
    assert torch.equal(NoRepeatNGram(n)(short, logits), NoRepeatNGramLogitsProcessor(n)(short, logits.clone()))


def test_no_repeat_ngram_ignores_left_padding():
    """A row in a padded batch blocks what it blocks alone: the pads (shown to processors as copies
    of the row's first token) form no n-grams."""
    row = torch.tensor([[3, 4, 5, 4, 3]])
    padded = torch.tensor([[3, 3, 3, 3, 4, 5, 4, 3]])  # three pads copied from the first token
    logits = random_logits(1)
    alone = NoRepeatNGramLogitsProcessor(2)(row, logits.clone())
    assert torch.equal(NoRepeatNGram(2, pad_counts=[3])(padded, logits), alone)
    assert not torch.equal(NoRepeatNGram(2)(padded, logits), alone)  # without the counts, (3, 3) is blocked


@pytest.mark.parametrize("minimum", [0, 1, 5, 12])
def test_min_new_tokens_equals_transformers(minimum):
    logits = random_logits(4)
    eos = [2, 50]
    for length in (10, 14, 22, 30):
        ids = random_ids(4, length)
        got = MinNewTokens(10, minimum, eos)(ids, logits)
        want = MinNewTokensLengthLogitsProcessor(10, minimum, eos)(ids, logits.clone())
        assert torch.equal(got, want)


def test_logit_bias_equals_transformers_sequence_bias():
    bias = {5: 3.5, 17: -100.0, 96: 0.25}
    logits = random_logits(4)
    want = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(random_ids(4, 3), logits.clone())
    assert torch.equal(LogitBias(bias)(None, logits), want)  # type: ignore[arg-type]  # these processors ignore input_ids, as transformers' do


def test_logit_bias_outside_the_vocabulary_is_a_value_error():
    with pytest.raises(ValueError, match="vocabulary has 97 tokens"):
        LogitBias({97: 1.0})(None, random_logits(1))  # type: ignore[arg-type]  # these processors ignore input_ids, as transformers' do


def openai_penalties(ids, logits, prompt_length, presence, frequency):
    """OpenAI's formula, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence, where c[j]
    counts the times j was generated (the prompt does not count)."""
    out = logits.clone()
    for row in range(len(ids)):
        for token, count in Counter(ids[row, prompt_length:].tolist()).items():
            out[row, token] -= count * frequency + presence
    return out


@pytest.mark.parametrize("presence,frequency", [(0.6, 0.0), (0.0, 0.4), (1.5, -0.5), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_follow_openais_formula(presence, frequency):
    ids = random_ids(6, 30, vocab=12)
    logits = random_logits(6)
    got = logits
    if presence:
        got = PresencePenalty(presence, prompt_length=10)(ids, got)
    if frequency:
        got = FrequencyPenalty(frequency, prompt_length=10)(ids, got)
    torch.testing.assert_close(got, openai_penalties(ids, logits, 10, presence, frequency), rtol=0, atol=1e-5)
    prompt_only = set(ids[:, :10].flatten().tolist()) - set(ids[:, 10:].flatten().tolist())
    for token in prompt_only:
        assert torch.equal(got[:, token], logits[:, token])  # the prompt is not penalised


# --- the rules ------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,value", [
    (MinP, -0.1), (MinP, 1.5), (MinP, float("nan")), (MinP, "0.1"),
    (TypicalP, 0), (TypicalP, 1.2), (TypicalP, float("inf")),
    (lambda v: PresencePenalty(v), 2.5), (lambda v: FrequencyPenalty(v), -3),
    (lambda v: PresencePenalty(v), float("nan")),
    (NoRepeatNGram, 0), (NoRepeatNGram, 2.0),
    (lambda v: MinNewTokens(0, v, [2]), -1),
    (lambda v: LogitBias({3: v}), 101), (lambda v: LogitBias({v: 1.0}), -1), (LogitBias, [3]),
    (Temperature, float("inf")),
])
def test_invalid_arguments_are_one_line_sampling_errors(make, value):
    with pytest.raises(SamplingError) as error:
        make(value)
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)


@pytest.mark.parametrize("values,setting", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=0, min_p=0.1), "min_p"),
    (dict(temperature=0, typical_p=0.5), "typical_p"), (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"), (dict(no_repeat_ngram_size=0), "no_repeat_ngram_size"),
    (dict(frequency_penalty=9.0), "frequency_penalty"), (dict(logit_bias={1: 500}), "logit_bias"),
])
def test_settings_errors_name_the_setting(values, setting):
    with pytest.raises(SamplingError) as error:
        SamplingSettings(**values).check()
    assert error.value.setting == setting
    assert error.value.message_for(lambda name: f"--{name}").startswith(f"--{setting}")


def test_seed_bounds_are_the_same_for_settings_and_generators():
    for seed in (0, 2**63, 2**64 - 1):
        SamplingSettings(seed=seed).check()
        row_generators(seed, 1, torch.device("cpu"))
    for seed in (-1, 2**64):
        with pytest.raises(SamplingError):
            SamplingSettings(seed=seed).check()
        with pytest.raises(SamplingError):
            row_generators(seed, 1, torch.device("cpu"))


# --- the chain's order equals transformers' ------------------------------------------------------


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral")
    reference = save_reference("mistral", directory)
    reference.generation_config.eos_token_id = None
    return reference, lmcli.load(directory)[0]


def transformers_chain(reference, prompt_length, **config):
    """The processor list transformers' generate() would build for these settings."""
    generation_config = GenerationConfig(**config, pad_token_id=PAD)
    generation_config._eos_token_tensor = torch.tensor([2])
    return reference._get_logits_processor(generation_config, input_ids_seq_length=prompt_length,
                                           logits_processor=LogitsProcessorList(), device="cpu", model_kwargs={})


CHAINS = [
    dict(temperature=0.7, top_k=5, repetition_penalty=1.8),
    dict(temperature=1.3, top_p=0.8, min_p=0.05, repetition_penalty=0.7, no_repeat_ngram_size=2),
    dict(temperature=0.9, typical_p=0.6, min_new_tokens=8),
    dict(temperature=0.5, min_p=0.2, no_repeat_ngram_size=3, repetition_penalty=1.3, min_new_tokens=3),
]


@pytest.mark.parametrize("values", CHAINS, ids=lambda v: ",".join(v))
def test_settings_chain_equals_transformers_chain(mistral, values):
    reference, _ = mistral
    do_sample, ours = SamplingSettings(**values).policy(prompt_length=12, eos_token_ids=[2])
    theirs = transformers_chain(reference, 12, do_sample=True, **values)
    assert do_sample
    for length in (12, 16, 30):
        ids, logits = random_ids(5, length, vocab=8), random_logits(5)
        ids[:, -1] = 2  # the last token is also EOS, so min_new_tokens has something to forbid
        want = theirs(ids, logits.clone())
        got = logits
        for processor in ours:
            got = processor(ids, got)
        assert torch.equal(got, want)


def test_greedy_settings_keep_the_processors_and_drop_the_warpers():
    do_sample, processors = SamplingSettings(temperature=0, repetition_penalty=1.2, min_new_tokens=2).policy(
        eos_token_ids=[2])
    assert not do_sample
    assert [type(p) for p in processors] == [RepetitionPenalty, MinNewTokens]


def replay(events, seed, prompt, chain):
    """The tokens an independent run would sample from the recorded raw logits with `chain` applied,
    one draw per step from the same seeded stream."""
    generator = row_generators([seed], 1, torch.device("cpu"))
    text, tokens = prompt[None], []
    for event in events:
        token = sample(chain(text, event.logits.clone()), generator)
        tokens.append(int(token))
        text = torch.cat([text, event.token_id[None]], dim=1)
    return tokens


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_text_with_a_penalty_follows_transformers_order(mistral, seed):
    """Each sampled token is what transformers' processor list (penalty on the raw logits, then
    temperature and top-k) gives under the same random stream; the old order (penalty after top-k)
    gives other tokens."""
    reference, model = mistral
    values: dict[str, Any] = dict(temperature=0.8, top_k=8, repetition_penalty=3.0)
    (prompt,) = prompts([6], seed=20 + seed)
    do_sample, processors = SamplingSettings(**values).policy(prompt_length=6)
    events: list[Any] = []
    out = model.generate(prompt[None], 24, do_sample, seed=[seed], logits_processors=processors,
                         on_token=events.append)
    generated = out[0, 6:].tolist()
    assert replay(events, seed, prompt, transformers_chain(reference, 6, do_sample=True, **values)) == generated
    old_order = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(8),
                                     RepetitionPenaltyLogitsProcessor(3.0)])
    assert replay(events, seed, prompt, old_order) != generated


def test_padded_batch_rows_equal_rows_alone_with_every_processor(mistral):
    _, model = mistral
    rows = prompts([3, 9, 6], seed=30)
    ids, mask = left_pad(rows)
    settings = SamplingSettings(temperature=0.9, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.3, no_repeat_ngram_size=2, min_new_tokens=4,
                                logit_bias={5: 2.0, 7: -100.0})
    width = ids.shape[1]
    do_sample, processors = settings.policy(prompt_length=width, pad_counts=[width - len(r) for r in rows],
                                            eos_token_ids=[2], vocab_size=VOCAB)
    batch = model.generate(ids, 12, do_sample, attention_mask=mask, seed=[1, 2, 3], logits_processors=processors,
                           eos_token_id=2, pad_token_id=PAD)
    for i, row in enumerate(rows):
        do_sample, alone_processors = settings.policy(prompt_length=len(row), eos_token_ids=[2], vocab_size=VOCAB)
        alone = model.generate(row[None], 12, do_sample, seed=[i + 1], logits_processors=alone_processors,
                               eos_token_id=2, pad_token_id=PAD)
        got = batch[i, width - len(row):][: alone.shape[1]]
        assert got.tolist() == alone[0].tolist()
        assert 7 not in got[len(row):].tolist()
