"""Keys and values of prompt prefixes, computed once and reused by every row that starts the same way.

Rows of a job often begin with the same tokens: the chat template and a system message, or a few-shot
header. The cache keeps the keys and values of such prefixes in blocks of BLOCK tokens, each keyed by
all the token ids from the start of the prompt to the block's end (so a block is only ever reused after
the very same tokens). Its memory is bounded (`max_bytes`); the least recently used block goes first.

Entries come from one-row caches whose every layer holds every slot (continuous.py prefills rows so);
what a prefix's keys are does not depend on what follows it, so a row that reuses them and computes
only the rest gets the logits it gets computing all of its prompt (on the batch-invariant path, where
prefilling in chunks is exact; see models/row_attention.py).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from lmcli.models.cache import KVCache, ModelCache

BLOCK = 16  # tokens per entry: a prompt reuses the longest run of whole blocks it shares
DEFAULT_MAX_BYTES = 128 * 2**20
PREFIX_CACHE_ENV = "LMCLI_PREFIX_CACHE"  # "1" or "0": overrides prefix_cache_for's choice


def prefix_cache_for(model: Any) -> PrefixCache | None:
    """A prefix cache for a job's rows where reusing a prefix leaves every row's tokens exactly as
    computing its whole prompt makes them, else None: on the batch-invariant path, whose attention
    gives a query the same numbers in any prefill chunk (models/row_attention.py; checked on the
    default model's 118-token chat prompt prefilled from token 16, 96, 112 and 117 against one piece).
    LMCLI_PREFIX_CACHE=1 or 0 overrides the choice."""
    choice = os.environ.get(PREFIX_CACHE_ENV, "")
    exact = bool(getattr(model, "batch_invariant", False))
    return PrefixCache() if choice == "1" or (exact and choice != "0") else None


@dataclass
class PrefixStats:
    requested: int = 0  # prompt tokens to prefill
    computed: int = 0  # of those, computed (the rest came from the cache)
    evicted: int = 0  # blocks dropped to stay within the bound


class PrefixCache:
    """Blocks of keys and values by token ids: [(keys, values) per layer, each (nkv, BLOCK, hd)]."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, block: int = BLOCK):
        if max_bytes < 0 or block < 1:
            raise ValueError(f"a prefix cache needs max_bytes >= 0 and block >= 1, got {max_bytes}, {block}")
        self.max_bytes = max_bytes
        self.block = block
        self.bytes = 0
        self.stats = PrefixStats()
        self._blocks: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def restore(self, ids: list[int], cache: ModelCache) -> int:
        """Fill the one-row `cache` with the longest cached prefix of `ids`, leaving at least one token to
        compute (its logits choose the first new token); returns that prefix's length."""
        reused = 0
        end = self.block
        while end < len(ids):
            entry = self._blocks.get(tuple(ids[:end]))
            if entry is None or not _fits(entry, cache):
                break
            self._blocks.move_to_end(tuple(ids[:end]))
            slots = torch.arange(end - self.block, end, device=cache.layers[0].keys.device)
            for layer, (keys, values) in zip(cache.layers, entry):
                layer.place(0, keys, values, slots)
            reused = end
            end += self.block
        return reused

    def store(self, ids: list[int], cache: ModelCache, length: int) -> None:
        """Keep the whole blocks of the first `length` tokens that are not kept yet."""
        for end in range(self.block, length + 1, self.block):
            key = tuple(ids[:end])
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            begin = end - self.block
            entry = [(layer.keys[0, :, begin:end].clone(), layer.values[0, :, begin:end].clone())
                     for layer in cache.layers]
            size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in entry)
            if size > self.max_bytes:
                return
            while self.bytes + size > self.max_bytes:
                self._evict()
            self._blocks[key] = entry
            self.bytes += size

    def _evict(self) -> None:
        _, entry = self._blocks.popitem(last=False)
        self.bytes -= sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in entry)
        self.stats.evicted += 1


def _fits(entry: list[tuple[torch.Tensor, torch.Tensor]], cache: ModelCache) -> bool:
    """An entry made for this model's layers (a stale or foreign one is never used)."""
    return len(entry) == len(cache.layers) and all(
        isinstance(layer, KVCache) and keys.shape[0] == layer.keys.shape[1] and keys.shape[2] == layer.keys.shape[3]
        and keys.dtype == layer.keys.dtype for layer, (keys, _) in zip(cache.layers, entry)
    )
