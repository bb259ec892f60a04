"""Token choice: the transforms (temperature, top-k, top-p, repetition penalty), the sampler and the
per-row random streams, checked against transformers and against the distributions they promise."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lmcli.generation import sampling
from lmcli.generation.sampling import (
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
    row_generators,
    sample,
    sampling_transforms,
)

V = 97
# The sampling transforms do not read the text so far; transformers' warpers are given None for it.
NO_TEXT = torch.empty(1, 0, dtype=torch.long)


def random_logits(rows=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=generator) * 3


# --- the transforms equal transformers' -----------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 2.5])
def test_temperature_equals_transformers(temperature):
    logits = random_logits()
    assert torch.equal(Temperature(temperature)(NO_TEXT, logits), TemperatureLogitsWarper(temperature)(None, logits))


@pytest.mark.parametrize("k", [1, 2, 10, V, 5 * V])
def test_top_k_equals_transformers(k):
    logits = random_logits()
    got = TopK(k)(NO_TEXT, logits)
    assert torch.equal(got, TopKLogitsWarper(k)(None, logits))
    assert (torch.isfinite(got).sum(-1) == min(k, V)).all()  # no ties in random logits: exactly k kept


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 0.9, 0.999, 1.0])
def test_top_p_equals_transformers(p):
    logits = random_logits()
    assert torch.equal(TopP(p)(NO_TEXT, logits), TopPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p_with_ties_at_its_cut_equals_transformers(p):
    """Logits on a coarse grid tie by the hundreds, so the cut often falls among equal values: all of them
    dropped (the mask lmcli builds from the sorted values) or some (then torch.sort's order decides, as in
    transformers). Rows of a real vocabulary's width, and a bfloat16 row that takes torch.sort's road."""
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 49152, generator=generator) * 4).round() / 2  # few distinct values: many ties
    logits[1, :100] = float("-inf")  # what an earlier top-k leaves
    logits[2, :40000] = -30.0  # a tied floor dropped whole, the cut among distinct values above it
    logits[2, 40000:] = torch.randn(9152, generator=generator)
    assert torch.equal(TopP(p)(NO_TEXT, logits), TopPLogitsWarper(p)(None, logits))
    for row in logits:
        assert torch.equal(TopP(p)(NO_TEXT, row[None]), TopPLogitsWarper(p)(None, row[None]))
    half = logits[:2].bfloat16()
    assert torch.equal(TopP(p)(NO_TEXT, half), TopPLogitsWarper(p)(None, half))


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits = random_logits(8)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, V, (8, 40), generator=generator)  # with repeats
    got = RepetitionPenalty(penalty)(input_ids, logits)
    assert torch.equal(got, RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone()))
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, input_ids, True)
    assert torch.equal(got[~seen], logits[~seen])  # unseen tokens untouched
    if penalty > 1:
        assert (got[seen] < logits[seen]).all()  # seen tokens discouraged, whatever their sign


def test_temperature_then_top_p_equals_transformers_chain():
    """top_p is computed after temperature, as transformers' warpers run."""
    logits = random_logits()
    for temperature, p in [(0.5, 0.8), (2.0, 0.6)]:
        ours = logits
        for transform in sampling_transforms(temperature, None, p):
            ours = transform(NO_TEXT, ours)
        theirs = TopPLogitsWarper(p)(None, TemperatureLogitsWarper(temperature)(None, logits))
        assert torch.equal(ours, theirs)


# --- what each transform keeps --------------------------------------------------------------------


def nucleus_reference(probs, p):
    """The smallest set of most likely tokens whose probability adds up to >= p, in float64."""
    values, order = probs.double().sort(descending=True)
    size = int((values.cumsum(-1) < p).sum()) + 1
    return set(order[:min(size, len(values))].tolist())


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.8, 0.95])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    logits = random_logits(64, seed=3)
    kept = torch.isfinite(TopP(p)(NO_TEXT, logits))
    probs = logits.softmax(-1).double()
    checked = 0
    for row in range(len(logits)):
        cumulative = probs[row].sort(descending=True).values.cumsum(-1)
        if (cumulative - p).abs().min() < 1e-5:
            continue  # a boundary within float32 rounding of p: either answer is right
        assert set(kept[row].nonzero().flatten().tolist()) == nucleus_reference(probs[row], p)
        checked += 1
    assert checked >= 60


def test_top_p_one_keeps_every_token_and_tiny_p_keeps_the_best():
    logits = random_logits()
    assert torch.isfinite(TopP(1.0)(NO_TEXT, logits)).all()
    kept = torch.isfinite(TopP(1e-9)(NO_TEXT, logits))
    assert torch.equal(kept, torch.nn.functional.one_hot(logits.argmax(-1), V).bool())


def test_order_of_temperature_and_top_p_matters_and_is_temperature_first():
    # probabilities at T=1: about [0.50, 0.30, 0.20]. With p=0.7 the raw nucleus is {0, 1}; at T=0.3
    # token 0 alone is above 0.7.
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    transforms = sampling_transforms(0.3, None, 0.7)
    assert [type(t) for t in transforms] == [Temperature, TopP]
    scores = logits
    for transform in transforms:
        scores = transform(NO_TEXT, scores)
    assert torch.isfinite(scores).tolist() == [[True, False, False]]
    assert torch.isfinite(TopP(0.7)(NO_TEXT, logits)).tolist() == [[True, True, False]]
    assert [type(t) for t in sampling_transforms(0.3, 5, None)] == [Temperature, TopK]
    assert [type(t) for t in sampling_transforms(1.0, None, None)] == [Temperature]


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make,value", [
    (Temperature, 0), (Temperature, 0.0), (Temperature, -1.0), (Temperature, float("nan")), (Temperature, "1"),
    (TopK, 0), (TopK, -3), (TopK, 2.0), (TopK, True), (TopK, None),
    (TopP, 0), (TopP, 0.0), (TopP, -0.2), (TopP, 1.0001), (TopP, 2), (TopP, float("nan")), (TopP, True),
    (RepetitionPenalty, 0), (RepetitionPenalty, -1.2), (RepetitionPenalty, float("nan")),
])
def test_invalid_arguments_are_value_errors(make, value):
    with pytest.raises(ValueError) as error:
        make(value)
    assert str(error.value) and "\n" not in str(error.value)


def test_top_k_with_top_p_is_a_value_error():
    with pytest.raises(ValueError, match="top_k and top_p"):
        sampling_transforms(1.0, 5, 0.9)


def test_valid_boundaries_are_accepted():
    Temperature(1e-6), TopK(1), TopP(1.0), TopP(1e-9), RepetitionPenalty(1.0), RepetitionPenalty(0.1)


# --- the sampler: distribution ---------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.0, -0.5, -1.0, -3.0])
DRAWS = 20_000
SIGMAS = 5.0


def draw_counts(scores, seed=0, draws=DRAWS):
    """Counts of `draws` tokens sampled from softmax(scores) [V], one stream advancing one draw per sample."""
    generator = torch.Generator().manual_seed(seed)
    tokens = sample(scores[None].expand(draws, -1), [generator] * draws)
    return torch.bincount(tokens, minlength=len(scores))


def within_bounds(counts, probs):
    """Every token's count within SIGMAS binomial standard deviations of draws * p (with a count of
    exactly zero where p = 0). For a correct sampler a bin misses with probability ~6e-7 at 5 sigma,
    so 8 bins fail together by chance < 1e-5; the checks below show wrong distributions fail."""
    draws = int(counts.sum())
    for count, p in zip(counts.tolist(), probs.double().tolist()):
        if p == 0:
            if count != 0:
                return False
        elif abs(count - draws * p) > SIGMAS * math.sqrt(draws * p * (1 - p)) + 1:
            return False
    return True


def renormalised(probs, keep):
    kept = torch.where(keep, probs.double(), 0.0)
    return kept / kept.sum()


def apply(transforms, logits):
    for transform in transforms:
        logits = transform(NO_TEXT, logits[None])[0]
    return logits


def test_temperature_samples_match_the_distribution():
    counts = draw_counts(apply([Temperature(0.7)], LOGITS))
    want = torch.softmax(LOGITS.double() / 0.7, -1)
    assert within_bounds(counts, want)
    assert not within_bounds(counts, torch.softmax(LOGITS.double(), -1))  # temperature ignored
    assert not within_bounds(counts, torch.softmax(LOGITS.double() / 0.8, -1))  # a slightly different one


def test_top_k_samples_match_the_renormalised_distribution():
    counts = draw_counts(apply(sampling_transforms(1.5, 3, None), LOGITS))
    probs = torch.softmax(LOGITS.double() / 1.5, -1)
    keep = torch.arange(8) < 3  # LOGITS is sorted: the 3 most likely are the first 3
    assert within_bounds(counts, renormalised(probs, keep))
    assert counts[3:].sum() == 0
    assert not within_bounds(counts, probs)  # not filtered
    assert not within_bounds(counts, renormalised(probs, torch.arange(8) < 4))  # off by one
    assert not within_bounds(counts, renormalised(torch.softmax(LOGITS.double(), -1), keep))  # no temperature


def test_top_p_samples_match_the_renormalised_nucleus():
    temperature, p = 0.7, 0.84
    probs = torch.softmax(LOGITS.double() / temperature, -1)
    # cumulative: 0.51, 0.76, 0.88, ...: the nucleus is the first 3, well away from the boundary
    assert probs.cumsum(-1)[1] < p - 0.03 and probs.cumsum(-1)[2] > p + 0.03
    counts = draw_counts(apply(sampling_transforms(temperature, None, p), LOGITS))
    assert within_bounds(counts, renormalised(probs, torch.arange(8) < 3))
    assert counts[3:].sum() == 0
    assert not within_bounds(counts, probs)
    assert not within_bounds(counts, renormalised(probs, torch.arange(8) < 2))
    # the nucleus taken before temperature (on T=1 probabilities: 0.40, 0.64, 0.79, 0.89) holds 4 tokens
    raw = torch.softmax(LOGITS.double(), -1)
    raw_nucleus = nucleus_reference(raw, p)
    assert raw_nucleus == {0, 1, 2, 3}
    assert not within_bounds(counts, renormalised(raw, torch.tensor([i in raw_nucleus for i in range(8)])))


def test_a_wrong_sampler_fails_the_bounds():
    """The check is not vacuous: a multinomial over the unfiltered distribution, or always the argmax, fails."""
    generator = torch.Generator().manual_seed(0)
    probs_k = renormalised(torch.softmax(LOGITS.double() / 1.5, -1), torch.arange(8) < 3)
    unfiltered = torch.multinomial(torch.softmax(LOGITS / 1.5, -1), DRAWS, replacement=True, generator=generator)
    assert not within_bounds(torch.bincount(unfiltered, minlength=8), probs_k)
    assert not within_bounds(torch.bincount(torch.zeros(DRAWS, dtype=torch.long), minlength=8), probs_k)
    # ...and a correct independent sampler passes it
    right = torch.multinomial(probs_k.float(), DRAWS, replacement=True, generator=generator)
    assert within_bounds(torch.bincount(right, minlength=8), probs_k)


# --- the sampler: mechanics ------------------------------------------------------------------------


@pytest.mark.parametrize("uniform", [0.0, 0.5, 1 - 2**-24, 1.0])
def test_zero_probability_tokens_are_never_chosen(monkeypatch, uniform):
    """Even with the uniform draw at its extremes (0, just below 1, and 1 itself)."""
    logits = torch.tensor([[-math.inf, 1.0, -math.inf, 2.0, 0.5, -math.inf, -math.inf]])
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.tensor(uniform))
    token = int(sample(logits, [torch.Generator()]))
    assert math.isfinite(logits[0, token])
    if uniform == 0.0:
        assert token == 1
    if uniform >= 1 - 2**-24:
        assert token == 4  # the last token with probability > 0


def test_a_single_allowed_token_is_always_chosen():
    logits = torch.full((5, V), -math.inf)
    allowed = torch.tensor([3, 50, 96, 0, 7])
    logits[torch.arange(5), allowed] = 0.0
    for seed in range(20):
        assert sample(logits, row_generators(seed, 5, torch.device("cpu"))).tolist() == allowed.tolist()


def test_each_row_draws_from_its_own_stream_once_per_step():
    logits = random_logits(3)
    together = row_generators([7, 8, 9], 3, torch.device("cpu"))
    apart = [row_generators([s], 1, torch.device("cpu")) for s in (7, 8, 9)]
    for _step in range(25):
        batch = sample(logits, together)
        for row in range(3):
            assert int(batch[row]) == int(sample(logits[row:row + 1], apart[row]))
    # one uniform draw per sample: the stream is where 25 draws leave a fresh one
    fresh = torch.Generator().manual_seed(7)
    for _ in range(25):
        torch.rand((), generator=fresh)
    assert torch.equal(together[0].get_state(), fresh.get_state())


def test_row_generators_from_int_list_tensor_and_global_seed():
    cpu = torch.device("cpu")

    def first_draws(generators):
        return [float(torch.rand((), generator=g)) for g in generators]

    fresh = [float(torch.rand((), generator=torch.Generator().manual_seed(s))) for s in (4, 5)]
    assert first_draws(row_generators(4, 2, cpu)) == [fresh[0], fresh[0]]  # an int: every row gets it
    assert first_draws(row_generators([4, 5], 2, cpu)) == fresh
    assert first_draws(row_generators(torch.tensor([4, 5]), 2, cpu)) == fresh
    torch.manual_seed(3)
    a = first_draws(row_generators(None, 3, cpu))
    torch.manual_seed(3)
    b = first_draws(row_generators(None, 3, cpu))
    assert a == b and len(set(a)) == 3  # from the global generator, a different seed per row
    with pytest.raises(ValueError, match="seed"):
        row_generators([1, 2, 3], 2, cpu)


def test_row_generators_accept_integer_like_seeds_and_reject_others():
    import numpy as np

    cpu = torch.device("cpu")
    fresh = float(torch.rand((), generator=torch.Generator().manual_seed(4)))
    for seed in (np.int64(4), torch.tensor(4), [np.int32(4)], (4,)):
        assert float(torch.rand((), generator=row_generators(seed, 1, cpu)[0])) == fresh
    row_generators(2**64 - 1, 1, cpu)  # the whole unsigned 64-bit range
    for bad in (1.5, [1.0], True, [True], "4", [None], 2**64, [-(2**63) - 1]):
        with pytest.raises(ValueError, match="seed"):
            row_generators(bad, 1, cpu)
