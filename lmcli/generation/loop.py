"""The one generation loop: prefill, decode steps, stopping and streaming.

Slots are the columns of the left-padded sequence [B, prompt_len + max_new_tokens]; `slot_is_token`
marks which hold real tokens, and each token's position is counted within its own row, so a padded
row computes exactly what it computes alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmcli.config import eos_id_list
from lmcli.generation.sampling import row_generators, sample, sampling_transforms
from lmcli.models.layers import positions_from_mask


@dataclass
class TokenEvent:
    """What `on_token` receives after each step (all tensors batched)."""

    step: int
    token_id: torch.Tensor  # [B] long: the token just written (pad_token_id for finished rows)
    finished: torch.Tensor  # [B] bool: the row has stopped (EOS, or finished by on_token)
    length: torch.Tensor  # [B] long: tokens generated so far in the row; frozen once finished
    logits: torch.Tensor  # [B, V]: the model's raw logits for this step


def _validate_inputs(x: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.long, torch.int, torch.int32):
        raise ValueError("x must be an integer tensor of token ids shaped [batch, prompt_len]")
    if x.shape[1] == 0:
        raise ValueError("x has no prompt tokens; every row needs at least one (e.g. BOS)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if attention_mask is None:
        return torch.ones_like(x, dtype=torch.bool)
    if attention_mask.shape != x.shape:
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)} but x has {list(x.shape)}")
    mask = attention_mask.bool()
    if (mask[:, :-1] & ~mask[:, 1:]).any():
        raise ValueError("attention_mask has padding after a token (right padding); pad prompts on the left")
    if not mask[:, -1].all():
        raise ValueError("attention_mask has a row with no tokens")
    return mask


def history_capacity(prompt_len: int, max_new_tokens: int, max_positions: int, trim: bool) -> int:
    """Columns of token history to allocate. All of them normally; with `trim` (ignore_output and no
    processors, which would need the whole text) only what the model can still see, plus a window of
    room so the history is shifted once every max_positions steps rather than at every step."""
    total = prompt_len + max_new_tokens
    return min(total, max(prompt_len, max_positions) + max_positions) if trim else total


def generate(model, x: torch.Tensor, max_new_tokens: int, do_sample: bool, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
             attention_mask: torch.Tensor | None = None, eos_token_id=None, pad_token_id: int | None = None,
             *, seed=None, logits_processors=None, on_token: Callable[[TokenEvent], Any] | None = None,
             ignore_output: bool = False) -> torch.Tensor | None:
    """Prompt ids [B, T] (left-padded, with `attention_mask`) -> [B, T + n]; `model.generate` calls this.

    The contract (return value, seeds, EOS and padding, caches, hooks) is the README's "generate()" section.
    """
    mask = _validate_inputs(x, max_new_tokens, attention_mask)
    transforms = sampling_transforms(temperature, top_k, top_p) if do_sample else []
    processors = list(logits_processors or [])
    eos = eos_id_list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0

    device = model.device
    batch, prompt_len = x.shape
    total = prompt_len + max_new_tokens
    max_positions = model.config.max_position_embeddings
    capacity = history_capacity(prompt_len, max_new_tokens, max_positions, ignore_output and not processors)
    ids = torch.full((batch, capacity), pad_token_id, dtype=torch.long, device=device)  # (B, L)
    ids[:, :prompt_len] = x.to(device)
    slot_is_token = torch.ones((batch, capacity), dtype=torch.bool, device=device)  # (B, L)
    slot_is_token[:, :prompt_len] = mask.to(device)
    # Processors see each row's pads replaced by its first token, which is already in the text, so
    # a row's set of seen tokens (e.g. for a repetition penalty) is the same alone or in a batch.
    first_token = ids.gather(1, (~slot_is_token[:, :prompt_len]).sum(-1, keepdim=True))  # (B, 1)
    eos_tensor = torch.tensor(eos, dtype=torch.long, device=device)
    generators = row_generators(seed, batch, device) if do_sample else []

    cache = model.init_cache(batch, min(total, max_positions)) if use_cache else None
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    length = prompt_len  # columns written so far
    cached = 0  # columns whose keys/values are in the cache

    for step in range(max_new_tokens):
        if cache is not None and length <= max_positions:
            # Feed only what the cache does not hold yet: the whole prompt first, then one token.
            slots = torch.arange(cached, length, device=device)
            positions = positions_from_mask(slot_is_token[:, :length])[:, cached:length]
            logits = model.forward_slots(ids[:, cached:length], positions, slots, slot_is_token, cache, last_only=True)
            cached = length
        else:
            # Past max_position_embeddings the model sees only the last max_positions tokens,
            # recomputed without the cache at every step.
            start = max(0, length - max_positions)
            window_is_token = slot_is_token[:, start:length]
            logits = model.forward_slots(
                ids[:, start:length], positions_from_mask(window_is_token),
                torch.arange(length - start, device=device), window_is_token, None, last_only=True,
            )
        logits = logits[:, -1].float()  # (B, V)

        scores = logits
        # Only processors read the text so far; the built-in transforms get an empty view.
        context = ids[:, :0]  # (B, 0)
        if processors:
            context = torch.where(slot_is_token[:, :length], ids[:, :length], first_token)  # (B, length)
        if do_sample:
            for transform in transforms:
                scores = transform(context, scores)
            for processor in processors:
                scores = processor(context, scores)
            next_token = sample(scores, generators)
        else:
            for processor in processors:
                scores = processor(context, scores)
            next_token = scores.argmax(dim=-1)  # (B,)

        next_token = torch.where(finished, torch.full_like(next_token, pad_token_id), next_token)
        if length == capacity:
            # Only with a trimmed history (ignore_output), and only past max_position_embeddings,
            # where the cache is no longer used and slots are window-relative: keep the last window.
            ids[:, :max_positions] = ids[:, length - max_positions:length].clone()
            slot_is_token[:, :max_positions] = slot_is_token[:, length - max_positions:length].clone()
            length = max_positions
        ids[:, length] = next_token
        length += 1
        lengths += (~finished).long()
        if eos:
            finished |= torch.isin(next_token, eos_tensor)
        if on_token is not None:
            stop_rows = on_token(TokenEvent(step, next_token, finished.clone(), lengths.clone(), logits))
            if stop_rows is not None:
                finished |= torch.as_tensor(stop_rows, dtype=torch.bool, device=device).expand(batch)
        if bool(finished.all()):
            break

    return None if ignore_output else ids[:, :length]
