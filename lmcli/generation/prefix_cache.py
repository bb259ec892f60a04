"""Keys and values of prompt prefixes, computed once and reused by every row that starts the same way.

Rows of a job often begin with the same tokens: the chat template and a system message, or a few-shot
header; and a job that samples several answers to one question repeats a whole prompt. The cache keeps
the keys and values of prompts in blocks of BLOCK tokens, each keyed by all the token ids from the start
of the prompt to the block's end (so a block is only ever reused after the very same tokens), and each
prompt's last partial block (its *tail*, under the blocks before it) with the logits its last token
gave. A prompt reuses its longest run of whole blocks, then as many tokens as it shares with a block
or tail that continues them; a prompt seen before reuses all of it and its logits, and computes nothing. Its memory is
bounded (`max_bytes` of keys, values and logits); the least recently used entry goes first.

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

BLOCK = 16  # tokens per block: a prompt reuses the longest run of whole blocks it shares, then a tail
DEFAULT_MAX_BYTES = 128 * 2**20
PREFIX_CACHE_ENV = "LMCLI_PREFIX_CACHE"  # "1" or "0": overrides prefix_cache_for's choice


def prefix_cache_for(model: Any) -> PrefixCache | None:
    """A prefix cache for a job's rows where reusing a prefix leaves every row's tokens exactly as
    computing its whole prompt makes them, else None: on the batch-invariant path, whose attention
    gives a query the same numbers in any prefill chunk (models/row_attention.py; checked on the
    default model's 118-token chat prompt prefilled from token 16, 96, 112 and 117 against one piece).
    LMCLI_PREFIX_CACHE=1 or 0 overrides the choice."""
    choice = os.environ.get(PREFIX_CACHE_ENV, "")
    exact = model.numerics.batch_invariant  # what the load chose (kernels/numerics.py)
    return PrefixCache() if choice == "1" or (exact and choice != "0") else None


@dataclass
class PrefixStats:
    requested: int = 0  # prompt tokens to prefill
    computed: int = 0  # of those, computed (the rest came from the cache)
    evicted: int = 0  # entries dropped to stay within the bound


KV = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) per layer, each (nkv, n, hd)


@dataclass
class _Entry:
    begin: int  # the slot of its first token (its tokens are its key's ids from there)
    kv: KV
    size: int  # bytes counted against the bound
    logits: torch.Tensor | None = None  # a tail's: the prompt's last logits [1, V] float32


class PrefixCache:
    """Blocks and tails of keys and values by token ids, least recently used dropped first."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, block: int = BLOCK):
        if max_bytes < 0 or block < 1:
            raise ValueError(f"a prefix cache needs max_bytes >= 0 and block >= 1, got {max_bytes}, {block}")
        self.max_bytes = max_bytes
        self.block = block
        self.bytes = 0
        self.stats = PrefixStats()
        # ("block", ids to the block's end) or ("tail", the whole prompt's ids) -> entry
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], _Entry] = OrderedDict()
        # the ids before an entry -> the entries that continue them (where a prompt that leaves the
        # blocks it shares part-way through one looks for the rest)
        self._children: dict[tuple[int, ...], set[tuple[str, tuple[int, ...]]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def logits(self, ids: list[int]) -> torch.Tensor | None:
        """The last logits [1, V] of exactly the prompt `ids`, if it was stored (a copy: the caller's)."""
        entry = self._entries.get(("tail", tuple(ids)))
        return None if entry is None or entry.logits is None else entry.logits.clone()

    def restore(self, ids: list[int], cache: ModelCache, whole: bool = False) -> int:
        """Fill the one-row `cache` with the longest cached prefix of `ids` and return its length; it
        leaves at least one token to compute (whose logits choose the first new token) unless `whole`
        (the caller has the prompt's logits from `logits`)."""
        found = self._find(ids, cache, whole)
        if not found:
            return 0
        parts: list[KV] = []  # each entry's keys and values that count, in order (slots 0, 1, ...)
        for key, length in found:
            self._entries.move_to_end(key)
            parts.append([(keys[:, :length], values[:, :length]) for keys, values in self._entries[key].kv])
        # One write per layer of the entries joined (a prompt's blocks one by one cost a write per block and layer).
        joined = [(torch.cat([part[layer][0] for part in parts], dim=1), torch.cat([part[layer][1] for part in parts], dim=1))
                  for layer in range(len(cache.layers))]
        length = joined[0][0].shape[1]
        _place(cache, joined, torch.arange(length, device=cache.layers[0].keys.device))
        return length

    def longest(self, ids: list[int], cache: ModelCache, whole: bool = False) -> int:
        """What `restore` would fill, without filling it (nor counting it as a use)."""
        return sum(length for _, length in self._find(ids, cache, whole))

    def _find(self, ids: list[int], cache: ModelCache, whole: bool) -> list[tuple[tuple[str, tuple[int, ...]], int]]:
        """The entries of the longest cached prefix of `ids`, in order, each with how many of its tokens count."""
        limit = len(ids) - (0 if whole else 1)  # tokens it may fill
        found: list[tuple[tuple[str, tuple[int, ...]], int]] = []
        reused = 0
        while reused + self.block <= limit:
            key = ("block", tuple(ids[:reused + self.block]))
            entry = self._entries.get(key)
            if entry is None or not _fits(entry.kv, cache):
                break
            found.append((key, self.block))
            reused += self.block
        best, best_key = 0, None
        for child in self._children.get(tuple(ids[:reused]), ()):
            shared = _common_length(child[1][reused:], ids[reused:limit])
            if shared > best and _fits(self._entries[child].kv, cache):
                best, best_key = shared, child
        if best_key is not None:
            found.append((best_key, best))
        return found

    def store(self, ids: list[int], cache: ModelCache, length: int, logits: torch.Tensor | None = None) -> None:
        """Keep the whole blocks of the first `length` tokens that are not kept yet; with the prompt's
        last `logits` [1, V] (then `length` is all of `ids`), its tail too. Only a cache whose every layer
        keeps every slot (KVCache, slot s at index s) is read; a ring's is not what its slots say."""
        if not all(isinstance(layer, KVCache) for layer in cache.layers):
            return
        for end in range(self.block, length + 1, self.block):
            key = ("block", tuple(ids[:end]))
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            if not self._add(key, _Entry(end - self.block, _copy(cache, end - self.block, end), 0)):
                return
        if logits is None or length != len(ids):
            return
        key = ("tail", tuple(ids))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        begin = length // self.block * self.block
        self._add(key, _Entry(begin, _copy(cache, begin, length), 0, logits.float().clone()))

    def _add(self, key: tuple[str, tuple[int, ...]], entry: _Entry) -> bool:
        """Keep `entry` within the bound, dropping the least recently used; False if it alone is too big."""
        entry.size = _bytes(entry.kv)  # and its logits: the tensors (a key's ids are bounded by the entries)
        if entry.logits is not None:
            entry.size += entry.logits.numel() * entry.logits.element_size()
        if entry.size > self.max_bytes:
            return False
        while self.bytes + entry.size > self.max_bytes:
            self._evict()
        self._entries[key] = entry
        self._children.setdefault(key[1][:entry.begin], set()).add(key)
        self.bytes += entry.size
        return True

    def _evict(self) -> None:
        key, entry = self._entries.popitem(last=False)
        self.bytes -= entry.size
        self.stats.evicted += 1
        siblings = self._children[key[1][:entry.begin]]
        siblings.discard(key)
        if not siblings:
            del self._children[key[1][:entry.begin]]


def _copy(cache: ModelCache, begin: int, end: int) -> KV:
    return [(layer.keys[0, :, begin:end].clone(), layer.values[0, :, begin:end].clone()) for layer in cache.layers]


def _place(cache: ModelCache, kv: KV, slots: torch.Tensor) -> None:
    for layer, (keys, values) in zip(cache.layers, kv):
        layer.place(0, keys, values, slots)


def _bytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def _common_length(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _fits(entry: KV, cache: ModelCache) -> bool:
    """An entry made for this model's layers (a stale or foreign one is never used)."""
    return len(entry) == len(cache.layers) and all(
        isinstance(layer, KVCache) and keys.shape[0] == layer.keys.shape[1] and keys.shape[2] == layer.keys.shape[3]
        and keys.dtype == layer.keys.dtype for layer, (keys, _) in zip(cache.layers, entry)
    )
