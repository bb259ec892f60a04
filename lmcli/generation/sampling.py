"""Token choice: one small class per logits transform, applied in a fixed order, and per-row RNGs.

Every transform has the uniform call `(input_ids [B, S], logits [B, V]) -> logits [B, V]` and checks
its argument once, in __init__, with a message that says what to pass instead.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Temperature:
    def __init__(self, temperature: float):
        if not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r} (use do_sample=False for greedy)")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.temperature


class TopK:
    """Keep the k most likely tokens."""

    def __init__(self, top_k: int):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
        self.top_k = top_k

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, logits.shape[-1])
        kth_best = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
        return logits.masked_fill(logits < kth_best, float("-inf"))


class TopP:
    """Nucleus: the smallest set of most likely tokens whose total probability is >= p."""

    def __init__(self, top_p: float):
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        self.top_p = float(top_p)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the least likely tokens while what they add up to stays within 1 - p; keep the best one.
        drop_sorted = cumulative <= 1 - self.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        return logits.masked_fill(drop, float("-inf"))


class RepetitionPenalty:
    """Discourage tokens already in the text: positive logits are divided by the penalty, negative ones
    multiplied (penalty > 1 discourages, < 1 encourages)."""

    def __init__(self, penalty: float):
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {penalty!r}")
        self.penalty = float(penalty)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        seen = torch.gather(logits, 1, input_ids)
        seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return logits.scatter(1, input_ids, seen)


def sampling_transforms(temperature: float, top_k: int | None, top_p: float | None) -> list[LogitsProcessor]:
    """The built-in sampling steps in their fixed order, validated."""
    if top_k is not None and top_p is not None:
        raise ValueError("top_k and top_p cannot be used together; pass one of them")
    transforms: list[LogitsProcessor] = [Temperature(temperature)]
    if top_k is not None:
        transforms.append(TopK(top_k))
    if top_p is not None:
        transforms.append(TopP(top_p))
    return transforms


def row_generators(seed: Any, batch_size: int, device: torch.device) -> list[torch.Generator]:
    """One RNG per row, so a row's samples do not depend on the rest of the batch.

    `seed`: an int (every row gets it), one value per row (list or tensor), or None (drawn from torch's
    global generator, so torch.manual_seed still makes the call reproducible).
    """
    if isinstance(seed, torch.Tensor):
        seed = seed.tolist()  # a 0-d tensor becomes one int
    if seed is None:
        seeds = torch.randint(0, 2**62, (batch_size,)).tolist()
    elif _is_int(seed):
        seeds = [int(seed)] * batch_size
    else:
        try:
            seeds = list(seed)
        except TypeError:
            seeds = [seed]
        if not all(_is_int(s) for s in seeds):
            raise ValueError(f"seed must be an int or one int per row, got {seed!r}")
        seeds = [int(s) for s in seeds]
        if len(seeds) != batch_size:
            raise ValueError(f"seed has {len(seeds)} values but the batch has {batch_size} rows")
    generators = []
    for value in seeds:
        if not -(2**63) <= value < 2**64:
            raise ValueError(f"seed {value} is out of range (use an integer from 0 to 2**64-1)")
        generator = torch.Generator(device=device)
        generator.manual_seed(value)
        generators.append(generator)
    return generators


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def sample(logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Draw one token per row from softmax(logits) [B, V] -> [B], one uniform number per row and step.

    Inverse-CDF sampling consumes exactly one draw per step, so a row's stream advances the same way
    alone or in a batch, and zero-probability tokens can never be chosen.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # (B, V)
    cdf = probs.cumsum(dim=-1)
    uniform = torch.stack([torch.rand((), generator=g, device=logits.device) for g in generators])  # (B,)
    threshold = (uniform * cdf[:, -1])[:, None]  # (B, 1)
    chosen = torch.searchsorted(cdf, threshold, right=True)  # (B, 1): first token whose cdf exceeds it
    # Rounding can put the threshold at the very top: fall back to the last token with probability > 0.
    last_possible = torch.searchsorted(cdf, cdf[:, -1:].contiguous())
    return torch.minimum(chosen, last_possible).squeeze(-1)
