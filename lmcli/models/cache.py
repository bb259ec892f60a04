"""Key/value caches, allocated once per generate() call and written in place by slot.

A slot is a column of the left-padded token sequence. `KVCache` keeps every slot up to `max_length`;
`RollingKVCache` keeps the last `window` slots in a ring buffer, so memory does not grow with the text.
Both return the keys a query chunk may need plus each key's slot; the attention mask does the rest.

Caches say what they can do: `trimmable()` is how many of the last slots written can be forgotten so
that the cache equals one that never saw them (a rollback: chat going back in the text, speculative
decoding rejecting a draft), `is_trimmable()` whether that is any, and `trim(n)` forgets that many.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from lmcli.config import SLIDING
from lmcli.models.slots import ModelShape


class CachedModel(ModelShape, Protocol):
    """What a cache is shaped from (lmcli.models.base.BaseModel is one)."""

    @property
    def dtype(self) -> torch.dtype: ...


def _held_length(slots: torch.Tensor) -> int:
    """Slots 0..n-1 were written (some may since have been forgotten): n, from a slot record (-1: empty)."""
    return int(slots.max()) + 1 if slots.numel() else 0


def _forget(slots: torch.Tensor, n: int) -> None:
    """Mark the last `n` slots written as empty: the mask then hides them and no later read returns them."""
    if n:
        with torch.inference_mode():  # in place (the tensor keeps its address), also for one made under inference
            slots.masked_fill_(slots >= _held_length(slots) - n, -1)


class _SlotCache:
    """What both caches share: keys and values [B, nkv, slots, hd] and a record of the slot each holds."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor  # [slots] long: the slot held at each index, -1 for none

    def trimmable(self) -> int:
        raise NotImplementedError

    def is_trimmable(self) -> bool:
        return self.trimmable() > 0

    def trim(self, n: int) -> int:
        """Forget up to `n` of the last slots written (no more than `trimmable()`); returns how many."""
        n = max(0, min(n, self.trimmable()))
        _forget(self.slots, n)
        return n

    def traverse(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.slots = self.slots.to(self.keys.device)  # per-slot bookkeeping follows the data

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the rows `rows` [R] (long, any order, repeats allowed) as the new batch: row i becomes old
        row rows[i]. Beam search (generation/beams.py) reorders its beams this way, and first repeats
        each input's row once per beam. The slot record is shared by all rows, so it stays."""
        self.keys = self.keys.index_select(0, rows)  # (R, nkv, L, hd)
        self.values = self.values.index_select(0, rows)

    # Continuous batching (generation/continuous.py): rows enter and leave a running batch's slots.

    def _index(self, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _keeps(self, slots: torch.Tensor) -> torch.Tensor:
        """Which of `slots` (after a shift) this cache can hold."""
        raise NotImplementedError

    def shift(self, d: int) -> None:
        """Move every slot by `d` (slot s becomes s + d, for all rows); what falls outside is forgotten.
        In place: the tensors keep their addresses."""
        with torch.inference_mode():
            for tensor in (self.keys, self.values):
                tensor.copy_(torch.roll(tensor, d, dims=2))
            held = torch.roll(self.slots, d)
            moved = held + d
            self.slots.copy_(torch.where((held >= 0) & (moved >= 0) & self._keeps(moved), moved, -1))

    def place(self, row: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write one row's keys and values [nkv, n, hd] at `slots` [n] (ascending; the other rows keep theirs)."""
        keep = slice(-self.keys.shape[2], None)  # a ring keeps only the last `capacity`
        slots, keys, values = slots[keep], keys[:, keep], values[:, keep]
        index = self._index(slots)
        with torch.inference_mode():
            self.keys[row].index_copy_(1, index, keys.to(self.keys.dtype))
            self.values[row].index_copy_(1, index, values.to(self.values.dtype))
            self.slots.index_copy_(0, index, slots)


class KVCache(_SlotCache):
    """Every slot up to `max_length`; slot s lives at index s. Trimming moves the write position back."""

    def __init__(self, batch_size: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (B, nkv, L, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # Which slots hold keys (-1: none): read only by trim, so the write position can move back.
        self.slots = torch.full((max_length,), -1, dtype=torch.long, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               end: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write k, v [B, nkv, T, hd] at `slots` [T]; return keys, values, key slots up to the last one.

        `end` (the last slot + 1) may be passed by callers that know it, to spare a device sync."""
        self.keys.index_copy_(2, slots, k.to(self.keys.dtype))
        self.values.index_copy_(2, slots, v.to(self.values.dtype))
        self.slots.index_copy_(0, slots, slots)
        if end is None:
            end = int(slots[-1]) + 1
        key_slots = torch.arange(end, device=slots.device)
        return self.keys[:, :, :end].to(k.dtype), self.values[:, :, :end].to(v.dtype), key_slots

    def trimmable(self) -> int:
        """All it holds: later writes overwrite slot by slot, and the causal mask hides what lies after."""
        return _held_length(self.slots)

    def _index(self, slots: torch.Tensor) -> torch.Tensor:
        return slots

    def _keeps(self, slots: torch.Tensor) -> torch.Tensor:
        return slots < self.keys.shape[2]



class RollingKVCache(_SlotCache):
    """A ring of `window + spare` slots; slot s lives at index s % capacity.

    A query needs only the `window` keys ending at itself, so the ring evicts what lies before; the
    `spare` slots keep that many more, which is how far back it can be trimmed (see `trimmable`)."""

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, spare: int = 0):
        self.window = window
        self.capacity = window + spare
        shape = (batch_size, num_kv_heads, self.capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (B, nkv, C, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = torch.full((self.capacity,), -1, dtype=torch.long, device=device)  # -1: empty

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               end: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if slots.numel() == 1:
            # One new token: it only needs the window ending at itself, which the ring holds after writing.
            self._write(k, v, slots)
            return self.keys.to(k.dtype), self.values.to(v.dtype), self.slots.clone()
        # A chunk: earlier queries may need keys that later tokens of the chunk evict, so attend over
        # ring + chunk, then keep only the last `capacity` tokens.
        keys = torch.cat([self.keys.to(k.dtype), k], dim=2)  # (B, nkv, C + T, hd)
        values = torch.cat([self.values.to(v.dtype), v], dim=2)
        key_slots = torch.cat([self.slots, slots])
        keep = slice(-self.capacity, None)
        self._write(k[:, :, keep], v[:, :, keep], slots[keep])
        return keys, values, key_slots

    def _index(self, slots: torch.Tensor) -> torch.Tensor:
        return slots % self.capacity

    def _keeps(self, slots: torch.Tensor) -> torch.Tensor:
        return slots >= 0

    def _write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        index = slots % self.capacity
        self.keys.index_copy_(2, index, k.to(self.keys.dtype))
        self.values.index_copy_(2, index, v.to(self.values.dtype))
        self.slots.index_copy_(0, index, slots)

    def trimmable(self) -> int:
        """How many of the last slots can be forgotten while the ring still holds the window before the
        new end: the next query at slot p needs slots p - window + 1 .. p - 1. All of them while nothing
        has been evicted; else the spare slots plus one (the slot the next write reuses)."""
        held = self.slots[self.slots >= 0]
        if held.numel() == 0:
            return 0
        oldest, length = int(held.min()), int(held.max()) + 1
        if oldest == 0:
            return length
        return max(0, length - self.window + 1 - oldest)



LayerCache = KVCache | RollingKVCache


class ModelCache:
    """One cache per layer: rolling for sliding-window layers whose window is shorter than the run."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers

    @classmethod
    def for_model(cls, model: CachedModel, batch_size: int, max_length: int, rollback: int = 0) -> ModelCache:
        """`rollback`: how many tokens a caller means to be able to trim (a ring keeps that many spare slots)."""
        config = model.config
        layers: list[LayerCache] = []
        for layer_type in config.layer_types:
            window = config.sliding_window if layer_type == SLIDING else None
            if window is not None and window + rollback < max_length:
                layers.append(RollingKVCache(batch_size, config.num_key_value_heads, window, config.head_dim,
                                             model.dtype, model.device, spare=rollback))
            else:
                layers.append(KVCache(batch_size, config.num_key_value_heads, max_length, config.head_dim,
                                      model.dtype, model.device))
        return cls(layers)

    def trimmable(self) -> int:
        """How many of the last tokens every layer can forget (the least of the layers')."""
        return min((layer.trimmable() for layer in self.layers), default=0)

    def is_trimmable(self) -> bool:
        return self.trimmable() > 0

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens in every layer, or as many as all can (`trimmable()`); returns how
        many. The caller then feeds from the shorter text (e.g. `cached=` of generate_from_cache)."""
        n = max(0, min(n, self.trimmable()))
        for layer in self.layers:
            layer.trim(n)
        return n

    def traverse(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ModelCache:
        for layer in self.layers:
            layer.traverse(fn)
        return self

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row i of every layer becomes old row rows[i] (see _SlotCache.select_rows)."""
        for layer in self.layers:
            layer.select_rows(rows)

    def shift(self, d: int) -> None:
        """Move every slot of every row by `d` (see _SlotCache.shift)."""
        for layer in self.layers:
            layer.shift(d)

    def place(self, row: int, source: ModelCache, offset: int) -> None:
        """Copy a one-row cache's keys (full layers, slots from 0) into `row`, slot s at s + offset."""
        for layer, held in zip(self.layers, source.layers):
            slots = held.slots[held.slots >= 0]
            layer.place(row, held.keys[0, :, slots], held.values[0, :, slots], slots + offset)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))
