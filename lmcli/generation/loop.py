"""Plain generation: the whole batch in step from its prompt to its last token, with stopping and
streaming. The scheduler of `model.generate`; the others (continuous batching, speculation) sit beside
it, and all of them run the model through the one decoding step (step.py).

Slots are the columns of the left-padded sequence [B, prompt_len + max_new_tokens]; `slot_is_token`
marks which hold real tokens, and each token's position is counted within its own row, so a padded
row computes exactly what it computes alone (models/slots.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcli import threads
from lmcli.config import eos_id_list
from lmcli.generation.sampling import LogitsProcessor, make_processor_chain, make_sampler
from lmcli.generation.step import Step
from lmcli.models.slots import CacheT, ModelShape, SlotModel, positions_from_mask

__all__ = ["CacheT", "ModelShape", "SlotModel", "TokenEvent", "generate", "generate_from_cache",
           "history_capacity", "positions_from_mask"]


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


def generate(model: SlotModel[Any], x: torch.Tensor, max_new_tokens: int, do_sample: bool, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
             attention_mask: torch.Tensor | None = None, eos_token_id: Any = None, pad_token_id: int | None = None,
             *, seed: Any = None, logits_processors: Sequence[LogitsProcessor] | None = None,
             on_token: Callable[[TokenEvent], Any] | None = None, ignore_output: bool = False) -> torch.Tensor | None:
    """Prompt ids [B, T] (left-padded, with `attention_mask`) -> [B, T + n]; `model.generate` calls this.

    The contract (return value, seeds, EOS and padding, caches, hooks) is the README's "generate()" section.
    """
    ids, _ = generate_from_cache(
        model, x, max_new_tokens, do_sample, temperature, top_k, top_p, use_cache, attention_mask, eos_token_id,
        pad_token_id, seed=seed, logits_processors=logits_processors, on_token=on_token, ignore_output=ignore_output,
    )
    return None if ignore_output else ids


def generate_from_cache(model: SlotModel[CacheT], x: torch.Tensor, max_new_tokens: int, do_sample: bool,
                        temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                        use_cache: bool = True, attention_mask: torch.Tensor | None = None, eos_token_id: Any = None,
                        pad_token_id: int | None = None, *, seed: Any = None,
                        logits_processors: Sequence[LogitsProcessor] | None = None,
                        on_token: Callable[[TokenEvent], Any] | None = None, ignore_output: bool = False,
                        cache: CacheT | None = None, cached: int = 0) -> tuple[torch.Tensor, int]:
    """generate(), continuing from `cache`, which already holds the keys and values of x's first `cached`
    columns (from an earlier call over the same leading ids; a chat keeps its conversation this way).
    Without a cache one is allocated. Returns the ids as generate() returns them (with `ignore_output`,
    the history it kept) and how many leading columns of the text (x, then the new tokens) the cache
    now holds. A given cache must have room for x and max_new_tokens, up to max_position_embeddings."""
    mask = _validate_inputs(x, max_new_tokens, attention_mask)
    if not 0 <= cached < x.shape[1] or (cached and cache is None):
        raise ValueError(f"cached must be in [0, {x.shape[1]}) and needs a cache, got {cached}")
    # Built (and validated) once, before any work: the loop only calls them.
    chain = make_processor_chain(do_sample, temperature, top_k, top_p, logits_processors)
    eos = eos_id_list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0

    device = model.device
    batch, prompt_len = x.shape
    total = prompt_len + max_new_tokens
    max_positions = model.config.max_position_embeddings
    capacity = history_capacity(prompt_len, max_new_tokens, max_positions, ignore_output and not chain.needs_history)
    ids = torch.full((batch, capacity), pad_token_id, dtype=torch.long, device=device)  # (B, L)
    ids[:, :prompt_len] = x.to(device)
    slot_is_token = torch.ones((batch, capacity), dtype=torch.bool, device=device)  # (B, L)
    slot_is_token[:, :prompt_len] = mask.to(device)
    # Processors see each row's pads replaced by its first token, which is already in the text, so
    # a row's set of seen tokens (e.g. for a repetition penalty) is the same alone or in a batch.
    first_token = ids.gather(1, (~slot_is_token[:, :prompt_len]).sum(-1, keepdim=True))  # (B, 1)
    eos_tensor = torch.tensor(eos, dtype=torch.long, device=device)
    choose = make_sampler(do_sample, seed, batch, device)

    model_step = Step.of(model)
    parallel = getattr(model, "tensor_parallel", None)  # see lmcli.distributed
    if cache is None and use_cache:
        cache = model.init_cache(batch, min(total, max_positions))
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    length = prompt_len  # columns written so far
    # `cached`: columns whose keys/values are in the cache

    for step in range(max_new_tokens):
        threads.recheck(fresh=step == 0)  # the thread count follows the load (a clock read unless it is time to look)
        if cache is not None and length <= max_positions:
            # Feed only what the cache does not hold yet: the whole prompt first, then one token.
            slots = torch.arange(cached, length, device=device)
            positions = positions_from_mask(slot_is_token[:, :length])[:, cached:length]
            run = model_step.prefill if step == 0 else model_step.decode
            logits = run(ids[:, cached:length], positions, slots, slot_is_token, cache)
            cached = length
        else:
            # Past max_position_embeddings the model sees only the last max_positions tokens,
            # recomputed without the cache at every step.
            start = max(0, length - max_positions)
            window_is_token = slot_is_token[:, start:length]
            logits = model_step.decode(ids[:, start:length], positions_from_mask(window_is_token),
                                    torch.arange(length - start, device=device), window_is_token, None)
        logits = logits.float()  # (B, V)

        # Only processors that read the text so far get it; the others get an empty view.
        context = ids[:, :0]  # (B, 0)
        if chain.needs_history:
            context = torch.where(slot_is_token[:, :length], ids[:, :length], first_token)  # (B, length)
        next_token = choose(chain(context, logits))  # (B,)

        next_token = torch.where(finished, torch.full_like(next_token, pad_token_id), next_token)
        if parallel is not None:
            next_token = parallel.share_tokens(next_token)  # tensor parallel: every rank takes rank 0's
        if step + 1 < max_new_tokens:
            chain.chosen(next_token)  # before the next forward pass, which a processor may work beside
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

    return ids[:, :length], cached
