"""Top-p's cheap roads (generation/nucleus.py) give exactly transformers' TopPLogitsWarper mask: on random
float32 rows, on bfloat16-valued rows whose ties straddle the cut, with -inf entries, in batches, and on
the real default model's logits at the target job's temperatures and top-p. Each test also checks that the
roads it means to cover were taken (the bounds deciding alone, the bounds proving a straddle, the sort)."""

from __future__ import annotations

import collections

import pytest
import torch
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from transformers.generation.logits_process import TopPLogitsWarper

import lmcli
from lmcli.generation.nucleus import TopP

NO_TEXT = torch.empty(1, 0, dtype=torch.long)
V = 49152


@pytest.fixture
def roads(monkeypatch):
    """Counts the road each row's bounds chose: "value", "order" (a proven straddle) or "open"."""
    taken: collections.Counter = collections.Counter()
    decide = TopP._cut_by_bounds

    def spy(self, row):
        found = decide(self, row)
        taken[found[0]] += 1
        return found

    monkeypatch.setattr(TopP, "_cut_by_bounds", spy)
    return taken


def check(p: float, logits: torch.Tensor) -> None:
    want = TopPLogitsWarper(p)(None, logits)
    assert torch.equal(TopP(p)(NO_TEXT, logits), want)


def test_random_rows_and_batches(roads):
    generator = torch.Generator().manual_seed(11)
    for n, p in enumerate([0.5, 0.8, 0.9, 0.95, 0.99, 1e-6]):
        scale = [0.5, 2.0, 4.0, 8.0][n % 4]
        rows = torch.randn(4, V, generator=generator) * scale
        rows[1, torch.randint(0, V, (3000,), generator=generator)] = float("-inf")  # as an earlier top-k leaves
        check(p, rows)  # a batch: each row takes its own road
        check(p, rows[2:3])
    check(0.9, torch.randn(3, 7, generator=generator))  # rows shorter than the first look at the best
    check(0.9, torch.randn(2, 1000, generator=generator, dtype=torch.float64))
    assert roads["value"] > 0 and roads["open"] > 0


def test_bfloat16_valued_rows_with_ties_at_the_cut(roads):
    """A model's bfloat16 logits scaled by a temperature: a couple of thousand distinct values, tie
    groups everywhere, the cut often inside one (then only torch.sort's order can tell which go)."""
    generator = torch.Generator().manual_seed(12)
    for n in range(24):
        raw = (torch.randn(1, V, generator=generator) * 6 + torch.rand(1, generator=generator) * 4).bfloat16().float()
        raw[0, torch.randint(0, V, (1 + n % 5,), generator=generator)] = raw.max() + 3  # a few clear leaders
        logits = raw / [0.5, 0.7, 0.9, 1.0][n % 4]
        check([0.8, 0.9, 0.95][n % 3], logits)
    tied = torch.full((1, V), -5.0)
    tied[0, :400] = 1.0  # one group of 400 tied tokens holding most of the mass, the cut inside it
    tied[0, 400] = 3.0
    for p in (0.3, 0.6, 0.9):
        check(p, tied)
    top_tied = torch.randn(1, V, generator=generator)
    top_tied[0, [7, 70, 700]] = 9.0  # the best value tied three ways, the cut among them
    check(0.5, top_tied)
    assert roads["order"] > 0 and roads["value"] > 0


def test_p_at_the_references_own_running_sums(roads):
    """1 - p set to the reference's running sum at a token, and a float either side: the cut then hangs on
    the last bit of the reference's rounding, which the bounds must leave to the sort, never guess."""
    generator = torch.Generator().manual_seed(13)
    logits = (torch.randn(1, V, generator=generator) * 5).bfloat16().float() / 0.7
    ascending = torch.sort(logits, dim=-1).values
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)[0]
    picked = [int(i) for i in torch.nonzero((cumulative > 0.02) & (cumulative < 0.4))[:, 0]]
    for i in picked[:: max(1, len(picked) // 12)]:
        at = cumulative[i]
        for value in (torch.nextafter(at, torch.tensor(0.0)), at, torch.nextafter(at, torch.tensor(1.0))):
            check(1 - float(value), logits)
    assert roads["open"] > 0


def test_a_long_tied_tail_whose_float_sum_drifts(roads):
    """48,000 equal tokens: the reference's float32 softmax sums them with an error of many ulps of the
    running sum, so an estimate without the bounds' allowance misplaces cuts set at and around the
    reference's own running sums; with it, such rows go to the sort."""
    generator = torch.Generator().manual_seed(14)
    logits = torch.zeros(1, V)
    logits[0, 48000:] = 2 + 6 * torch.rand(V - 48000, generator=generator)
    ascending = torch.sort(logits, dim=-1).values
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)[0]
    for i in range(48000, V - 1, 193):
        for k in range(-8, 9, 2):  # the drift is up to ~1.5e-6 of the sum (24 ulps) here
            check(1 - float(cumulative[i]) * (1 + k * 2e-7), logits)  # (with no allowance, 6 of these failed)
    assert roads["open"] > 0


@pytest.mark.full  # bfloat16-valued rows with ties at the cut are checked above without loading the model
def test_real_model_logits_at_the_jobs_settings(smollm2_gguf, roads):
    """The default model's own logits (bfloat16-valued: ties everywhere) at each position of a chat prompt,
    at the target job's temperatures and top-p."""
    model, tokenizer = lmcli.load(smollm2_gguf)
    ids = torch.tensor([list(tokenizer.encode_chat([{"role": "system", "content": "You answer in one line."},
                                                    {"role": "user", "content": "Name three rivers and a sea."}],
                                                   add_generation_prompt=True))])
    with torch.inference_mode():
        logits = model(ids)[0, -12:].float()  # (12, V): one forward gives every position's
    for temperature in (0.5, 0.7, 1.0):
        for p in (0.8, 0.9, 0.95):
            check(p, logits / temperature)
    assert roads["value"] > 0 and roads["order"] + roads["open"] > 0
