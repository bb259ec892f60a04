"""Sampled speculation keeps the model's sampling distribution (lmcli.generation.speculative_sampling).

Each test compares empirical frequencies with exact probabilities by a chi-square test at significance
0.001 (bins with an expected count under 5 merged). Seeds are fixed, so each test is deterministic:
it passed with these seeds, and a biased rule fails it by far (e.g. keeping every guess, or not
removing a rejected certain guess from the residual).
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny import prompts

from lmcli.generation import speculative
from lmcli.generation.sampling import RepetitionPenalty
from lmcli.generation.speculative_sampling import accept_or_resample, draw

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: per-op overhead

TEMPERATURE, TOP_K, PENALTY = 1.5, 3, 1.3


def chi_square_passes(counts: dict, probs: dict, n: int) -> tuple[bool, float, float]:
    """(statistic <= the 0.999 quantile, statistic, quantile) for observed `counts` of n draws against `probs`."""
    assert set(counts) <= {key for key, p in probs.items() if p > 0}, "an outcome of probability 0 was drawn"
    expected = {key: p * n for key, p in probs.items() if p > 0}
    small = [key for key, e in expected.items() if e < 5]
    bins = [(counts.get(key, 0), e) for key, e in expected.items() if e >= 5]
    if small:
        bins.append((sum(counts.get(key, 0) for key in small), sum(expected[key] for key in small)))
    statistic = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    z = 3.090  # the standard normal's 0.999 quantile; Wilson-Hilferty's approximation of chi-square's
    quantile = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic <= quantile, statistic, quantile


@pytest.mark.parametrize("proposal", ["certain", "drawn"])
def test_the_acceptance_rule_gives_the_target_distribution(proposal):
    p = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])
    q = torch.tensor([0.3, 0.1, 0.2, 0.0, 0.3, 0.1])
    generator = torch.Generator().manual_seed(7)
    n = 6000
    counts: dict[int, int] = {}
    for _ in range(n):
        if proposal == "certain":  # prompt lookup: the guess is fixed, a point mass
            token, _ = accept_or_resample(p, 0, None, generator)
        else:
            guess = draw(q, generator)
            token, _ = accept_or_resample(p, guess, q, generator)
        counts[token] = counts.get(token, 0) + 1
    ok, statistic, quantile = chi_square_passes(counts, dict(enumerate(p.tolist())), n)
    assert ok, (statistic, quantile, counts)


def target_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """The next token's sampling distribution [B, V] for rows ids [B, T], computed here from the
    model's full forward in generate()'s order: its temperature and top-k, then the caller's processor
    (the repetition penalty)."""
    logits = model(ids)[:, -1].float() / TEMPERATURE
    kept = logits.topk(TOP_K, dim=-1).indices
    logits = torch.full_like(logits, float("-inf")).scatter_(1, kept, logits.gather(1, kept))
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
    logits = torch.where(seen, torch.where(logits > 0, logits / PENALTY, logits * PENALTY), logits)
    return torch.softmax(logits, dim=-1)


def exact_distribution(model, prompt: torch.Tensor, steps: int) -> dict[tuple[int, ...], float]:
    """Every sequence of the first `steps` new tokens with its probability, enumerated."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(steps):
        prefixes = list(dist)
        ids = torch.stack([torch.cat([prompt, torch.tensor(list(p), dtype=torch.long)]) for p in prefixes])
        with torch.inference_mode():
            probs = target_probs(model, ids)
        dist = {(*p, t): dist[p] * float(probs[i, t]) for i, p in enumerate(prefixes)
                for t in torch.nonzero(probs[i] > 0).flatten().tolist()}
    return dist


def grounded_prompt(model) -> torch.Tensor:
    """A prompt whose last token b appears earlier followed by each of the model's likeliest next tokens c,
    each followed by the model's likeliest token after c: prompt lookup then has a guess whatever the
    first token drawn (a top-k one) is, and the guess is one the model may keep."""
    tail = prompts([5], seed=11)[0]
    prompt, b = tail, int(tail[-1])
    follows: dict[int, int] = {}  # c -> the token after it, for every c that was once among the likeliest
    for _ in range(10):
        with torch.inference_mode():
            likely = model(prompt[None])[0, -1].topk(TOP_K).indices.tolist()
            if set(likely) <= set(follows):
                return prompt
            for c in likely:
                follows[c] = int(model(torch.cat([prompt, torch.tensor([c])])[None])[0, -1].argmax())
        prompt = torch.cat([torch.tensor([t for c, x in follows.items() for t in (b, c, x)]), tail])
    raise AssertionError("no prompt found that holds its likeliest continuations")


@pytest.mark.parametrize("method", ["plain", "prompt lookup", "draft"])
def test_sampled_speculation_matches_the_enumerated_distribution(tiny_models, method):
    model = tiny_models("llama")
    prompt, steps, n = grounded_prompt(model), 3, 400
    exact = exact_distribution(model, prompt, steps)
    ids = prompt[None].expand(n, -1)
    kwargs = dict(max_new_tokens=steps, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, seed=list(range(n)),
                  logits_processors=[RepetitionPenalty(PENALTY)])
    stats = speculative.SpeculationStats()
    if method == "prompt lookup":
        kwargs.update(prompt_lookup=4, stats=stats)
    elif method == "draft":
        kwargs.update(draft_model=tiny_models("llama-linear-rope"), num_draft_tokens=2, stats=stats)  # similar weights
    out = model.generate(ids, **kwargs)[:, prompt.shape[0]:]
    counts: dict[tuple[int, ...], int] = {}
    for row in out.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    ok, statistic, quantile = chi_square_passes(counts, exact, n)
    assert ok, (method, statistic, quantile)
    if method != "plain":  # guesses were both kept and replaced
        assert 0 < stats.accepted < stats.drafted, stats
    # A row's seed makes it reproducible alone.
    alone = {**kwargs, "seed": [5]} | ({"stats": speculative.SpeculationStats()} if "stats" in kwargs else {})
    again = model.generate(ids[:1], **alone)
    assert again[0, prompt.shape[0]:].tolist() == out[5].tolist()
