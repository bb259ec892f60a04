"""Speculative sampling's acceptance rule: a guessed token is kept or replaced so that the token that
comes out is distributed exactly as the target model's own sampling distribution p.

A guess g drawn from a proposal q is kept with probability min(1, p(g) / q(g)); otherwise the token
is drawn from the residual max(0, p - q), normalised. Summed over g this gives p exactly. Prompt
lookup proposes one token for certain (q is a point mass at g): g is then kept with probability p(g),
else the token is drawn from p without g.

Each draw takes its uniform numbers from the row's own generator, so a row's result depends only on
its seed and its text.
"""

from __future__ import annotations

import torch


def uniform(generator: torch.Generator, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the (unnormalised, non-negative) weights `probs` [V], by inverse CDF."""
    cdf = probs.double().cumsum(-1)  # (V,) double: the residual's small masses keep their share
    threshold = uniform(generator, probs.device) * float(cdf[-1])
    chosen = int(torch.searchsorted(cdf, torch.tensor([threshold], dtype=cdf.dtype, device=cdf.device), right=True))
    # Rounding can put the threshold at the very top: take the last token with weight > 0.
    return min(chosen, int(torch.nonzero(probs > 0).max()))


def accept_or_resample(p: torch.Tensor, guess: int, q: torch.Tensor | None,
                       generator: torch.Generator) -> tuple[int, bool]:
    """The token at a guessed position and whether it is the guess: p [V] the target's probabilities,
    q [V] the proposal's (None: the guess was certain, a point mass)."""
    proposed = 1.0 if q is None else float(q[guess])
    if proposed > 0 and uniform(generator, p.device) * proposed < float(p[guess]):
        return guess, True
    if q is None:
        residual = p.clone()
        residual[guess] = 0
    else:
        residual = (p - q).clamp(min=0)
    if not bool((residual > 0).any()):  # p == q up to rounding: the guess was kept with probability ~1
        residual = p
    return draw(residual, generator), False
