"""The decoding settings' fields, declared once, without torch (so `lmcli --help` stays quick).

Two dataclasses extend them: `lmcli.generation.sampling.SamplingSettings`, what generate() is given
(logit bias by token id), and `lmcli.settings.GenerationSettings`, what the user asked for (flags,
job rows, the model's defaults; logit bias as typed). The rule for each field lives in
generation/sampling.py.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_NEW_TOKENS = 128
WARPERS = ("top_k", "top_p", "min_p", "typical_p")  # settings that only apply when sampling


@dataclass(frozen=True)
class DecodingFields:
    """How many tokens to generate and how each one is chosen; None means off. Their order is the order
    in which JSON rows and `lmcli info` list them."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    min_new_tokens: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
