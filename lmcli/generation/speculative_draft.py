"""A draft model for speculative decoding: a smaller (or more heavily quantized) model with the same
tokenizer guesses the next k tokens, one cheap pass each, and the target checks them in one pass.

The draft reads the row's real tokens (no padding) through its own cache. After the target's check
the draft's cache is trimmed back to the text both agree on, so the next guess continues from there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lmcli.generation.step import Step

if TYPE_CHECKING:
    from lmcli.io.tokenizer import Tokenizer


class DraftMismatch(ValueError):
    """The draft's tokenizer is not the target's: its tokens would mean other text."""


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, target_name: str, draft_name: str) -> None:
    """Raise DraftMismatch (one line naming both models) unless the two tokenizers have the same
    vocabulary (every piece at the same id) and the same special tokens."""
    def differ(what: str) -> DraftMismatch:
        return DraftMismatch(f"the draft model {draft_name} has another {what} than {target_name}; "
                             "a draft must share the target's tokenizer")

    target_vocab = target.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft.backend.get_vocab(with_added_tokens=True)
    if target_vocab != draft_vocab:
        return_size = len(target_vocab) != len(draft_vocab)
        raise differ(f"vocabulary ({len(draft_vocab)} tokens against {len(target_vocab)})" if return_size
                     else "vocabulary (pieces at different ids)")
    for what in ("bos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(target, what) != getattr(draft, what):
            raise differ(what.replace("_id", "").replace("_", " "))
    if set(target.eos_token_ids) != set(draft.eos_token_ids) or target.special_ids != draft.special_ids:
        raise differ("set of special tokens")


def fits(draft: Any, length: int) -> bool:
    """Whether the draft can read a text of `length` tokens (its own context)."""
    return length <= draft.config.max_position_embeddings


class DraftProposer:
    """Guesses for one row from the draft model, which reads `tokens` (the row's real tokens, shared
    with the row, which appends to them) through its own cache of `total` slots."""

    def __init__(self, draft: Any, tokens: list[int], total: int, max_draft: int, vocab_size: int):
        self.draft, self.tokens, self.vocab_size = draft, tokens, vocab_size
        self.step = Step.of(draft)
        device = draft.device
        self.cache = draft.init_cache(1, total, rollback=max_draft)
        self.slot_is_token = torch.ones((1, total), dtype=torch.bool, device=device)  # (1, L)
        self.slots = torch.arange(total, device=device)  # slot = position: the draft sees no padding
        self.fed = 0  # tokens whose keys and values the draft's cache holds
        self.passes = 0

    def _logits(self, ids: list[int]) -> torch.Tensor:
        """The draft's logits [V_target] after feeding `ids` (the tokens from `fed` on)."""
        start, end = self.fed, self.fed + len(ids)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.slots.device)
        positions = self.slots[None, start:end]
        logits = self.step.decode(input_ids, positions, self.slots[start:end], self.slot_is_token,
                                  self.cache)[0].float()  # (V_draft,)
        self.fed, self.passes = end, self.passes + 1
        if logits.shape[0] >= self.vocab_size:  # padded embedding rows past the tokenizer's: never chosen
            return logits[:self.vocab_size]
        return torch.cat([logits, logits.new_full((self.vocab_size - logits.shape[0],), float("-inf"))])

    def propose(self, k: int, pick: Callable[[int, torch.Tensor], tuple[int, torch.Tensor | None]]
                ) -> tuple[list[int], list[torch.Tensor] | None]:
        """Up to k guesses; `pick(j, logits)` chooses the j-th from the draft's logits and returns it with
        the distribution it was drawn from (None for a greedy choice)."""
        guesses: list[int] = []
        dists: list[torch.Tensor] = []
        for j in range(k):
            logits = self._logits(self.tokens[self.fed:] + guesses[j - 1:j] if j else self.tokens[self.fed:])
            token, dist = pick(j, logits)
            guesses.append(token)
            if dist is not None:
                dists.append(dist)
        return guesses, (dists if len(dists) == len(guesses) else None)

    def keep(self) -> None:
        """After the target's check: forget what the draft read past the text the row now has."""
        valid = min(self.fed, len(self.tokens) - 1)  # the newest token is fed with the next guess
        if self.cache.trim(self.fed - valid) != self.fed - valid:  # never: the ring keeps max_draft spare slots
            raise RuntimeError("the draft's cache could not be trimmed")
        self.fed = valid
