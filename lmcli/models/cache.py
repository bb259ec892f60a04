"""Key/value caches, allocated once per generate() call and written in place by slot.

A slot is a column of the left-padded token sequence. `KVCache` keeps every slot up to `max_length`;
`RollingKVCache` keeps the last `window` slots in a ring buffer, so memory does not grow with the text.
Both return the keys a query chunk may need plus each key's slot; the attention mask does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from lmcli.config import SLIDING, ModelConfig


class CachedModel(Protocol):
    """What a cache is shaped from (lmcli.models.base.BaseModel is one)."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...


class KVCache:
    def __init__(self, batch_size: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (B, nkv, L, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               end: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write k, v [B, nkv, T, hd] at `slots` [T]; return keys, values, key slots up to the last one.

        `end` (the last slot + 1) may be passed by callers that know it, to spare a device sync."""
        self.keys.index_copy_(2, slots, k.to(self.keys.dtype))
        self.values.index_copy_(2, slots, v.to(self.values.dtype))
        if end is None:
            end = int(slots[-1]) + 1
        key_slots = torch.arange(end, device=slots.device)
        return self.keys[:, :, :end].to(k.dtype), self.values[:, :, :end].to(v.dtype), key_slots

    def traverse(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)


class RollingKVCache:
    """A ring of `window` slots; slot s lives at index s % window."""

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.window = window
        shape = (batch_size, num_kv_heads, window, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (B, nkv, W, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = torch.full((window,), -1, dtype=torch.long, device=device)  # -1: empty

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               end: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if slots.numel() == 1:
            # One new token: it only needs the window ending at itself, which the ring holds after writing.
            self._write(k, v, slots)
            return self.keys.to(k.dtype), self.values.to(v.dtype), self.slots.clone()
        # A chunk: earlier queries may need keys that later tokens of the chunk evict, so attend over
        # ring + chunk, then keep only the last `window` tokens.
        keys = torch.cat([self.keys.to(k.dtype), k], dim=2)  # (B, nkv, W + T, hd)
        values = torch.cat([self.values.to(v.dtype), v], dim=2)
        key_slots = torch.cat([self.slots, slots])
        keep = slice(-self.window, None)
        self._write(k[:, :, keep], v[:, :, keep], slots[keep])
        return keys, values, key_slots

    def _write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        index = slots % self.window
        self.keys.index_copy_(2, index, k.to(self.keys.dtype))
        self.values.index_copy_(2, index, v.to(self.values.dtype))
        self.slots.index_copy_(0, index, slots)

    def traverse(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.slots = self.slots.to(self.keys.device)  # per-slot bookkeeping follows the data


LayerCache = KVCache | RollingKVCache


class ModelCache:
    """One cache per layer: rolling for sliding-window layers whose window is shorter than the run."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers

    @classmethod
    def for_model(cls, model: CachedModel, batch_size: int, max_length: int) -> ModelCache:
        config = model.config
        layers: list[LayerCache] = []
        for layer_type in config.layer_types:
            window = config.sliding_window if layer_type == SLIDING else None
            if window is not None and window < max_length:
                layers.append(RollingKVCache(batch_size, config.num_key_value_heads, window, config.head_dim,
                                             model.dtype, model.device))
            else:
                layers.append(KVCache(batch_size, config.num_key_value_heads, max_length, config.head_dim,
                                      model.dtype, model.device))
        return cls(layers)

    def traverse(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ModelCache:
        for layer in self.layers:
            layer.traverse(fn)
        return self

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))
