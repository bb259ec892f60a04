"""Batched token choice (generation/sampling_batch.py): the plain rows of a batch choosing together get,
step after step, the tokens each row's own chain and sampler choose for it alone (the one-row path
that `generate` and the single run use), on a vocabulary of 16k with bfloat16-rounded logits,
whose ties often straddle a top-p cut."""

from __future__ import annotations

import pytest
import torch

from lmcli.generation import sampling_batch
from lmcli.generation.sampling import SamplingSettings, TopP, make_processor_chain, make_sampler
from lmcli.generation.sampling_batch import choose_plain, row_sampler

CPU = torch.device("cpu")
# (temperature, top_p, seed): greedy rows and sampled ones at other temperatures and top-p
ROWS = [(0, None, None), (0.7, 0.9, 11), (1.0, None, 12), (0.5, 0.8, 13), (0, None, None), (0.9, 0.95, 14),
        (1.3, 0.5, 15), (0.7, 0.9, 11)]


def chain_for(temperature: float, top_p: float | None):
    """A job row's chain as continuous.py builds it: generate()'s own steps, then the row's policy."""
    settings = SamplingSettings(temperature=temperature, top_p=top_p)
    do_sample, processors = settings.policy()
    return do_sample, make_processor_chain(do_sample, 1.0, None, None, processors)


def test_plain_rows_choose_together_what_each_chooses_alone(monkeypatch):
    fallbacks: list[int] = []
    own_sort = torch.sort

    def counted(*args, **kwargs):
        fallbacks.append(1)
        return own_sort(*args, **kwargs)

    monkeypatch.setattr(torch, "sort", counted)
    plains, alone = {}, []
    for place, (temperature, top_p, seed) in enumerate(ROWS):
        do_sample, chain = chain_for(temperature, top_p)
        plain = row_sampler(do_sample, chain, seed, CPU)[1]
        assert plain is not None
        plains[place] = plain
        alone.append((chain, make_sampler(do_sample, [seed] if do_sample else None, 1, CPU)))  # its own stream
    torch.manual_seed(0)
    top_p_steps = batched_fallbacks = 0
    for step in range(12):
        logits = (torch.randn(len(ROWS), 16384) * 3).bfloat16().float()  # (B, V): many ties
        if step % 4 == 0:
            logits[:, :20] = logits[:, :20].amax(dim=-1, keepdim=True) + 1  # a few tied best tokens
        fallbacks.clear()
        got = choose_plain(logits, plains)
        batched_fallbacks += len(fallbacks)
        top_p_steps += sum(top_p is not None for _, top_p, _ in ROWS)
        expected = {place: int(sample(chain(logits[place:place + 1, :0], logits[place:place + 1])))
                    for place, (chain, sample) in enumerate(alone)}
        assert got == expected, step
    assert 0 < batched_fallbacks < top_p_steps  # ties straddled some cuts (torch.sort's order), not all


def test_a_subset_of_rows_and_rows_that_are_not_plain():
    do_sample, chain = chain_for(0.8, 0.9)
    _, plain = row_sampler(do_sample, chain, 5, CPU)
    _, reference = row_sampler(do_sample, chain, 5, CPU)
    assert plain is not None and reference is not None
    logits = torch.randn(5, 300)
    got = choose_plain(logits, {3: plain})  # one row of five: the others are not touched
    assert list(got) == [3]
    assert got[3] == choose_plain(logits[3:4], {0: reference})[0]
    settings = SamplingSettings(temperature=0.8, repetition_penalty=1.3)  # a penalty: chooses alone
    do_sample, processors = settings.policy()
    assert row_sampler(do_sample, make_processor_chain(do_sample, 1.0, None, None, processors), 5, CPU)[1] is None
    greedy_biased = SamplingSettings(temperature=0, logit_bias={3: 5.0}).policy()[1]
    assert row_sampler(False, make_processor_chain(False, 1.0, None, None, greedy_biased), None, CPU)[1] is None


@pytest.mark.parametrize("top_p", [0.3, 0.999])
def test_top_p_mask_is_top_ps_own(top_p):
    """The batched mask is TopP's on rows of every kind: peaked, flat, with -inf tokens."""
    torch.manual_seed(1)
    logits = torch.randn(4, 1000).bfloat16().float() * torch.tensor([[1.0], [10.0], [0.1], [3.0]])
    logits[3, ::3] = float("-inf")
    cut = TopP(top_p)
    drop = sampling_batch._top_p_drop(logits, [cut] * 4)
    for row in range(4):
        assert torch.equal(drop[row] | torch.isneginf(logits[row]), torch.isneginf(cut(logits[:0], logits[row:row + 1])[0]))


def test_top_p_cut_exactly_on_a_cumulative_probability():
    """A p whose 1 - p (in float32, as TopP compares) is exactly one of the sorted cumulative sums: that
    token is dropped, by the batched mask as by TopP."""
    torch.manual_seed(2)
    logits = torch.randn(1, 1000)  # float32: ties are rare
    cumulative = logits.sort(dim=-1).values.softmax(dim=-1).cumsum(dim=-1)[0]
    index = next(i for i in range(600, 900) if float(torch.tensor(1 - (1 - float(cumulative[i])))) == float(cumulative[i])
                 and cumulative[i] < cumulative[i + 1])
    cut = TopP(1 - float(cumulative[index]))
    expected = torch.isneginf(cut(logits[:0], logits)[0])
    assert int(expected.sum()) == index + 1  # the token at the cut is dropped: <=, not <
    assert torch.equal(sampling_batch._top_p_drop(logits, [cut])[0], expected)
