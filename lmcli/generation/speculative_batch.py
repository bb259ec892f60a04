"""Prompt lookup for a padded batch in shared passes: each pass feeds every row its newest token and
its own guesses (a ragged chunk: the columns after a row's guesses are masked out for it), so the
weights are read once for all the rows instead of once per row.

A row's rejected guesses cannot be trimmed from a cache the other rows share; their columns are masked
out of the row instead (`slot_is_token`), so a row's keys lie spread over the columns, in order, with
their own positions. Row attention (models/row_attention.py) gathers each row's keys by that mask, so a
row's queries meet exactly the keys of its single run, in the same order; with kernels that give a row
the same numbers at any row count (the load's Numerics.batch_invariant) every logit is the single run's, and so is
every token (greedy) or draw (the row's own stream). Hence only there, and without sliding-window
layers (a window is counted in columns there, which the gaps would stretch), and for prompt lookup (a
draft model keeps a cache per row); elsewhere speculative.py decodes the rows one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcli import threads
from lmcli.config import SLIDING
from lmcli.generation import loop
from lmcli.generation.step import Step

MAX_SHARED_CACHE_BYTES = 1 << 30  # the shared cache's bound: its columns hold every rejected guess too


def can_decode_together(model: Any, batch: int, draft_model: Any, cache: Any, width: int = 1,
                        max_new_tokens: int = 1, max_draft: int = 1) -> bool:
    """Whether a speculative call's rows may share passes exactly (see the module docstring), in a cache
    of at most MAX_SHARED_CACHE_BYTES (else they go one by one, each in a cache it trims)."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ()
    able = (batch > 1 and draft_model is None and cache is None and hasattr(model, "forward_slots")
            and Step.of(model).numerics.batch_invariant and SLIDING not in layer_types
            and getattr(model, "_compiled_decode", None) is None)  # a compiled step is checked on plain columns
    if not able:
        return False
    per_column = 2 * len(layer_types) * config.num_key_value_heads * config.head_dim  # keys and values
    size = per_column * torch.empty((), dtype=model.dtype).element_size() * batch * capacity(width, max_new_tokens,
                                                                                              max_draft)
    return size <= MAX_SHARED_CACHE_BYTES


def capacity(width: int, max_new_tokens: int, max_draft: int) -> int:
    """Columns the shared cache needs: each pass takes at most 1 + max_draft of them and makes at least
    one token for every row still going."""
    return width + max_new_tokens * (1 + max_draft)


def decode_together(model: Any, rows: Sequence[Any]) -> None:
    """Decode speculative.generate's rows (its `_Row`s: one padded width, prompt lookup) in shared passes."""
    device = rows[0].ids.device
    batch, width = len(rows), rows[0].width
    max_new, max_draft = rows[0].max_new_tokens, rows[0].max_draft
    columns = capacity(width, max_new, max_draft)
    cache = model.init_cache(batch, columns)
    step = Step.of(model)
    slot_is_token = torch.zeros(batch, columns, dtype=torch.bool, device=device)  # (B, C)
    positions = torch.zeros(batch, columns, dtype=torch.long, device=device)  # (B, C)
    prompt_mask = torch.cat([row.slot_is_token[:, :width] for row in rows])  # (B, W)
    slot_is_token[:, :width] = prompt_mask
    positions[:, :width] = loop.positions_from_mask(prompt_mask)
    pads = [width - int(row.slot_is_token[0, :width].sum()) for row in rows]
    for row in rows:
        row.start()
    prompts = torch.cat([row.ids[:, :width] for row in rows])  # (B, W)
    logits = step.prefill(prompts, positions[:, :width], torch.arange(width, device=device), slot_is_token,
                          cache).float()  # (B, V)
    for i, row in enumerate(rows):
        row.first(logits[i])
    column = width
    while not all(row.done for row in rows):
        threads.recheck()
        going = [i for i, row in enumerate(rows) if not row.done]
        proposed = {i: rows[i].propose() for i in going}
        chunk = 1 + max(len(proposed[i][0]) for i in going)
        feed = torch.zeros(batch, chunk, dtype=torch.long, device=device)  # (B, T)
        slot_is_token[:, column:column + chunk] = False
        for i in going:
            row, guess = rows[i], proposed[i][0]
            fed = 1 + len(guess)
            feed[i, :fed] = row.ids[0, row.length - 1:row.length + len(guess)]
            slot_is_token[i, column:column + fed] = True
            newest = row.length - 1 - pads[i]  # the newest token's position in its own row
            positions[i, column:column + chunk] = torch.arange(newest, newest + chunk, device=device)
        slots = torch.arange(column, column + chunk, device=device)
        logits = step.forward(feed, positions[:, column:column + chunk], slots, slot_is_token, cache,
                              last_only=chunk == 1).float()  # (B, T, V)
        for i in going:
            guess, dists = proposed[i]
            rejected = rows[i].verify(logits[i, -chunk:][:1 + len(guess)], guess, dists)
            taken = len(guess) - rejected
            slot_is_token[i, column + 1 + taken:column + chunk] = False  # its rejected guesses leave its text
        column += chunk
