"""Sampler edges the earlier tests did not reach (found by the planted-bug audit, docs/testing.md): top-p
and min-p exactly at their cut, n-gram blocking of a padded row's first n-gram, one seed for every row,
and the text a caller's own processor is given.

Probabilities here are powers of two, so every sum is exact and the cut is a true tie; each result is
compared with transformers' processor of the same name, or with torch.Generator and the ids the test wrote.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tiny import save_reference
from transformers.generation.logits_process import MinPLogitsWarper, NoRepeatNGramLogitsProcessor, TopPLogitsWarper

import lmcli
from lmcli.generation.sampling import MinP, NoRepeatNGram, SamplingSettings, TopP, row_generators

pytestmark = pytest.mark.usefixtures("one_thread")


def exact_logits(*probabilities: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probabilities]])


@pytest.mark.parametrize("top_p", [0.75, 0.5, 0.875])
def test_top_p_at_an_exact_cut_equals_transformers(top_p):
    logits = exact_logits(0.5, 0.25, 0.125, 0.125)
    ids = torch.zeros(1, 1, dtype=torch.long)
    want = TopPLogitsWarper(top_p)(ids, logits.clone())
    assert torch.equal(TopP(top_p)(ids, logits.clone()), want)
    kept = SamplingSettings(temperature=1.0, top_p=top_p).policy()[1]
    assert torch.equal(kept[-1](ids, logits.clone()), want)


@pytest.mark.parametrize("min_p", [0.25, 0.5])
def test_min_p_at_an_exact_floor_equals_transformers(min_p):
    logits = exact_logits(0.5, 0.25, 0.125, 0.125)
    ids: Any = torch.zeros(1, 1, dtype=torch.long)  # transformers types it LongTensor
    want = MinPLogitsWarper(min_p)(ids, logits.clone())
    assert torch.equal(MinP(min_p)(ids, logits.clone()), want)


@pytest.mark.parametrize("n", [2, 3])
def test_a_padded_rows_first_ngram_is_blocked_as_alone(n):
    row = [7, 8, 9, 7, 8][: n + 2]  # its first n-gram recurs at the end
    alone = torch.tensor([row])
    scores = torch.zeros(1, 20)
    want = NoRepeatNGramLogitsProcessor(n)(alone, scores.clone())
    for pads in (1, 2):
        padded = torch.tensor([[0] * pads + row])
        got = NoRepeatNGram(n, pad_counts=[pads])(padded, scores.clone())
        assert torch.equal(got, want), pads


def test_one_seed_gives_every_row_the_stream_of_that_seed():
    for generator in row_generators(7, 3, torch.device("cpu")):
        alone = torch.Generator().manual_seed(7)
        assert [torch.rand((), generator=generator).item() for _ in range(3)] == \
               [torch.rand((), generator=alone).item() for _ in range(3)]


def test_a_callers_processor_is_given_the_whole_text(tmp_path):
    """A plain callable may read the text: generate() must hand it the prompt and every token so far."""
    save_reference("llama", tmp_path)
    model = lmcli.load(tmp_path)[0]
    prompt = [3, 14, 15, 92, 65]
    seen: list[list[int]] = []

    def watch(input_ids, scores):
        seen.append(input_ids[0].tolist())
        return scores

    out = model.generate(torch.tensor([prompt]), 4, do_sample=False, logits_processors=[watch])
    text = out[0].tolist()
    assert seen == [text[: len(prompt) + i] for i in range(4)]
