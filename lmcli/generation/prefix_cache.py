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

Its second tier is on disk (io/prompt_blocks.py), so a later run starts where an earlier one stopped: a
block or a whole prompt's tail missing here is looked for there (by the hash chain of its ids from the
start of the prompt, under a key of everything that changes the numbers: `numerics_key`), checked whole,
compared token for token, and kept here too; a block kept here is written there. `prefix_cache_for`
gives one by default, in the lmcli cache directory's `prompts/` (LMCLI_PROMPT_CACHE: another directory,
or `off`; LMCLI_PROMPT_CACHE_SIZE: its bound, 2 GiB unless given).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmcli.errors import UsageError
from lmcli.io import prompt_blocks
from lmcli.io.prompt_blocks import BlockStore, Shape, chain
from lmcli.io.sizes import parse_size
from lmcli.models.cache import KVCache, ModelCache
from lmcli.paths import prompt_cache_dir

BLOCK = 16  # tokens per block: a prompt reuses the longest run of whole blocks it shares, then a tail
DEFAULT_MAX_BYTES = 128 * 2**20
PREFIX_CACHE_ENV = "LMCLI_PREFIX_CACHE"  # "1" or "0": overrides prefix_cache_for's choice


def prefix_cache_for(model: Any) -> PrefixCache | None:
    """A prefix cache for a job's rows where reusing a prefix leaves every row's tokens exactly as
    computing its whole prompt makes them, else None: on the batch-invariant path, whose attention
    gives a query the same numbers in any prefill chunk (models/row_attention.py; checked on the
    default model's 118-token chat prompt prefilled from token 16, 96, 112 and 117 against one piece).
    LMCLI_PREFIX_CACHE=1 or 0 overrides the choice. Its disk tier: `disk_store_for`."""
    choice = os.environ.get(PREFIX_CACHE_ENV, "")
    exact = model.numerics.batch_invariant  # what the load chose (kernels/numerics.py)
    if not (choice == "1" or (exact and choice != "0")):
        return None
    return PrefixCache(disk=disk_store_for(model), vocab=getattr(model.config, "vocab_size", None))


def disk_store_for(model: Any) -> BlockStore | None:
    """The disk tier for `model`'s blocks, or None: turned off, or a model whose checkpoint is unknown
    (one not made by lmcli.load has no fingerprint to key its blocks by)."""
    directory = prompt_cache_dir()
    if directory is None:  # turned off: the key (code digest, adapters' numbers) is not worth computing
        return None
    key = numerics_key(model)
    if key is None:
        return None
    size = os.environ.get(prompt_blocks.SIZE_ENV, "").strip()
    try:
        max_bytes = parse_size(size) if size else prompt_blocks.DEFAULT_MAX_BYTES
    except ValueError as e:
        raise UsageError(f"{prompt_blocks.SIZE_ENV}={size!r}: {e}") from None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return BlockStore(directory, digest, max_bytes, verbose=os.environ.get(prompt_blocks.VERBOSE_ENV) == "1")


# lmcli's code that computes a prefix's keys and values (globs under the package), the C++ kernels' sources
# too: a block written by other code is stale.
CODE = ("models/*.py", "kernels/*.py", "native/*.py", "native/csrc/*", "generation/step.py",
        "generation/prefix_cache.py", "io/prompt_blocks.py")


def numerics_key(model: Any) -> dict[str, Any] | None:
    """Everything that changes the numbers a prefix's keys and values hold: the checkpoint's fingerprint
    (weights, config, tokenizer), the dtypes, the load's kernel plan and invariance, the CPU and its
    instruction set, torch, and lmcli's model, kernel (C++ included) and step code (`CODE`). The thread
    count only where rows are not batch-invariant: on that path a row's numbers are the same at any
    thread count (the step changes it as the load moves, threads.recheck, and chunked prefill is exact
    across it)."""
    resolved = getattr(model, "resolved", None)
    fingerprint = getattr(resolved, "fingerprint", None)
    if not isinstance(fingerprint, str):
        return None
    from lmcli import threads
    from lmcli.io.fingerprint import source_digest
    from lmcli.machine import cpu_model_and_flags

    numerics = model.numerics
    choices = {name: [choice.kind, choice.dtype, choice.kernel, choice.large_rows]
               for name, choice in sorted(numerics.kernel_choices.items())}
    return {
        "format": prompt_blocks.FORMAT, "fingerprint": fingerprint, "dtype": str(model.dtype),
        "activation_dtype": str(numerics.activation_dtype), "batch_invariant": numerics.batch_invariant,
        "kernels": choices, "cpu": cpu_model_and_flags()[0], "isa": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "device": str(model.device),
        "code": source_digest(CODE),
        "kernel_env": {name: os.environ.get(name, "") for name in ("LMCLI_KERNEL", "LMCLI_FAST_KERNELS", "LMCLI_NATIVE")},
        "threads": "any" if numerics.batch_invariant else threads.signature(),
        "lora": _adapters_digest(model),
    }


def _adapters_digest(model: Any) -> str | None:
    """The command's LoRA adapters (kernels/lora.py) change every key and value a row without its own
    adapter computes: a digest of their names, order, scales and every number, or None without any."""
    adapters = getattr(model, "lora", None)
    if adapters is None:
        return None
    digest = hashlib.sha256(repr((adapters.names, adapters.merged)).encode())
    for adapter in adapters.files:
        for name, target in sorted(adapter.targets.items()):
            digest.update(f"{adapter.name}/{name}/{target.scale!r}/{adapter.rope_permuted}".encode())
            for tensor in (target.a, target.b):
                digest.update(tensor.detach().contiguous().float().numpy().tobytes())
    return digest.hexdigest()


def single_run(model: Any, prefix: PrefixCache, ids: list[int]) -> Callable[..., torch.Tensor]:
    """A stand-in for `model.generate` (generate_batch's `run`) for one row whose prompt is `ids`: its
    cache holds every slot of every layer (a sliding-window layer's too, masked to its window, as a job's
    rows are prefilled: continuous.py), takes the longest prefix `prefix` holds (from memory or disk),
    computes the rest, and gives its blocks back to `prefix`. On the batch-invariant path (where
    prefix_cache_for gives a cache) the tokens are those of a run with no cache."""

    def run(x: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
        from lmcli.generation.loop import generate_from_cache

        n = len(ids)
        capacity = min(n + max_new_tokens, model.config.max_position_embeddings)
        with torch.inference_mode():
            cache = model.init_cache(1, capacity, rollback=capacity)  # (no ring: every slot kept)
            cached = prefix.restore(ids, cache)
            prefix.stats.requested += n
            prefix.stats.computed += n - cached
            out, _ = generate_from_cache(model, x, max_new_tokens, cache=cache, cached=cached, **kwargs)
            prefix.store(ids, cache, n)
        return out

    return run


@dataclass
class PrefixStats:
    requested: int = 0  # prompt tokens to prefill
    computed: int = 0  # of those, computed (the rest came from the cache)
    evicted: int = 0  # entries dropped to stay within the bound
    from_memory: int = 0  # tokens restored from entries this process held
    from_disk: int = 0  # tokens restored from entries read from the disk tier


KV = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) per layer, each (nkv, n, hd)


@dataclass
class _Entry:
    begin: int  # the slot of its first token (its tokens are its key's ids from there)
    kv: KV
    size: int  # bytes counted against the bound
    logits: torch.Tensor | None = None  # a tail's: the prompt's last logits [1, V] float32
    from_disk: bool = False  # read from the disk tier and not yet used


class PrefixCache:
    """Blocks and tails of keys and values by token ids, least recently used dropped first."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, block: int = BLOCK, disk: BlockStore | None = None,
                 vocab: int | None = None):
        if max_bytes < 0 or block < 1:
            raise ValueError(f"a prefix cache needs max_bytes >= 0 and block >= 1, got {max_bytes}, {block}")
        self.max_bytes = max_bytes
        self.block = block
        self.disk = disk  # the second tier (io/prompt_blocks.py), or None
        self.vocab = vocab  # the width of a tail's logits, which a disk entry must have
        self.unusable: str | None = None  # why a cache offered could not take the blocks (said by --stats)
        self.bytes = 0
        self.stats = PrefixStats()
        # ("block", ids to the block's end) or ("tail", the whole prompt's ids) -> entry
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], _Entry] = OrderedDict()
        # the ids before an entry -> the entries that continue them (where a prompt that leaves the
        # blocks it shares part-way through one looks for the rest)
        self._children: dict[tuple[int, ...], set[tuple[str, tuple[int, ...]]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def logits(self, ids: list[int], cache: ModelCache | None = None) -> torch.Tensor | None:
        """The last logits [1, V] of exactly the prompt `ids`, if it was stored (a copy: the caller's);
        given the `cache` it would fill, also from the disk tier."""
        key = ("tail", tuple(ids))
        entry = self._entries.get(key)
        if entry is None and cache is not None and self._disk_usable(cache) and self.vocab is not None:
            begin = len(ids) // self.block * self.block
            link = chain(self._link(ids, begin), ids[begin:], b"tail")
            found = self.disk.load(link, ids, begin, _shapes(cache, len(ids) - begin), self.vocab)  # type: ignore[union-attr]
            if found is not None and found.logits is not None:
                entry = _Entry(begin, _pairs(found.tensors), 0, found.logits, from_disk=True)
                if not self._add(key, entry):
                    entry = None
        return None if entry is None or entry.logits is None else entry.logits.clone()

    def _disk_usable(self, cache: ModelCache) -> bool:
        return self.disk is not None and all(isinstance(layer, KVCache) for layer in cache.layers)

    def _link(self, ids: list[int], end: int) -> bytes:
        """The hash chain over the whole blocks of ids[:end] (end a multiple of the block)."""
        link = self.disk.key_digest.encode() if self.disk is not None else b""
        for begin in range(0, end, self.block):
            link = chain(link, ids[begin:begin + self.block])
        return link

    def restore(self, ids: list[int], cache: ModelCache, whole: bool = False) -> int:
        """Fill the one-row `cache` with the longest cached prefix of `ids` and return its length; it
        leaves at least one token to compute (whose logits choose the first new token) unless `whole`
        (the caller has the prompt's logits from `logits`)."""
        found = self._find(ids, cache, whole)
        if not found:
            return 0
        parts: list[KV] = []  # each entry's keys and values that count, in order (slots 0, 1, ...)
        for key, length in found:
            if key not in self._entries:  # dropped to make room for a later one (a prefix past the bound)
                break
            self._entries.move_to_end(key)
            entry = self._entries[key]
            if entry.from_disk:
                self.stats.from_disk += length
                entry.from_disk = False
            else:
                self.stats.from_memory += length
            parts.append([(keys[:, :length], values[:, :length]) for keys, values in entry.kv])
        return _place(cache, parts)

    def longest(self, ids: list[int], cache: ModelCache, whole: bool = False) -> int:
        """What `restore` would fill, without filling it (nor counting it as a use)."""
        return sum(length for _, length in self._find(ids, cache, whole))

    def _find(self, ids: list[int], cache: ModelCache, whole: bool) -> list[tuple[tuple[str, tuple[int, ...]], int]]:
        """The entries of the longest cached prefix of `ids`, in order, each with how many of its tokens count."""
        limit = len(ids) - (0 if whole else 1)  # tokens it may fill
        found: list[tuple[tuple[str, tuple[int, ...]], int]] = []
        reused = 0
        disk = self._disk_usable(cache)
        link = self._link(ids, 0)
        held = 0  # bytes of the entries found so far: one read from disk must not evict them
        block_bytes = sum(shape.nbytes for shape in _shapes(cache, self.block)) if disk else 0
        while reused + self.block <= limit:
            key = ("block", tuple(ids[:reused + self.block]))
            link = chain(link, ids[reused:reused + self.block]) if disk else link
            entry = self._entries.get(key)
            if entry is None and disk and held + 2 * block_bytes <= self.max_bytes:
                entry = self._from_disk(key, link, reused, cache)
            if entry is None or not _fits(entry.kv, cache):
                break
            if disk:
                self.disk.used(link)  # type: ignore[union-attr]
            found.append((key, self.block))
            held += entry.size
            reused += self.block
        best, best_key = 0, None
        for child in self._children.get(tuple(ids[:reused]), ()):
            shared = _common_length(child[1][reused:], ids[reused:limit])
            if shared > best and _fits(self._entries[child].kv, cache):
                best, best_key = shared, child
        if best_key is not None:
            found.append((best_key, best))
        return found

    def _from_disk(self, key: tuple[str, tuple[int, ...]], link: bytes, begin: int, cache: ModelCache) -> _Entry | None:
        """The block `key` from the disk tier, kept here too; None if it is not there (or fails a check)."""
        assert self.disk is not None
        found = self.disk.load(link, key[1], begin, _shapes(cache, self.block))
        if found is None:
            return None
        entry = _Entry(begin, _pairs(found.tensors), 0, from_disk=True)
        return entry if self._add(key, entry) else None

    def store(self, ids: list[int], cache: ModelCache, length: int, logits: torch.Tensor | None = None) -> None:
        """Keep the whole blocks of the first `length` tokens that are not kept yet (here, and on disk);
        with the prompt's last `logits` [1, V] (then `length` is all of `ids`), its tail too. Only a cache
        whose every layer keeps every slot (KVCache, slot s at index s) is read; a ring's is not what its
        slots say (the caller says so: `unusable`)."""
        if not all(isinstance(layer, KVCache) for layer in cache.layers):
            self.unusable = "a sliding-window layer's cache is a ring"
            return
        disk = self.disk
        link = self._link(ids, 0)
        for end in range(self.block, length + 1, self.block):
            key = ("block", tuple(ids[:end]))
            link = chain(link, ids[end - self.block:end]) if disk is not None else link
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            kv = _copy(cache, end - self.block, end)
            if disk is not None:
                disk.save(link, ids[:end], end - self.block, [t for pair in kv for t in pair])
            if not self._add(key, _Entry(end - self.block, kv, 0)):
                return
        if logits is None or length != len(ids):
            return
        key = ("tail", tuple(ids))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        begin = length // self.block * self.block
        kv = _copy(cache, begin, length)
        if disk is not None:
            disk.save(chain(link, ids[begin:], b"tail"), ids, begin, [t for pair in kv for t in pair], logits)
        self._add(key, _Entry(begin, kv, 0, logits.float().clone()))

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


def _shapes(cache: ModelCache, length: int) -> list[Shape]:
    """What a block of `length` tokens of this cache's layers holds: each layer's keys, then values."""
    shapes = []
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):  # (B, nkv, L, hd)
            shapes.append(Shape(tensor.dtype, (tensor.shape[1], length, tensor.shape[3])))
    return shapes


def _pairs(tensors: list[torch.Tensor]) -> KV:
    return [(tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)]


def _place(cache: ModelCache, parts: list[KV]) -> int:
    """Write the entries' keys and values, in order, at slots 0, 1, ... of the one-row `cache` (every layer a
    KVCache, slot s at index s: _fits), each as a slice copy; the length written. (KVCache.place's
    index_copy_ took 1 s for the default model's 2048 bfloat16 tokens; slices take a few ms.)"""
    length = 0
    with torch.inference_mode():
        for part in parts:
            n = part[0][0].shape[1]
            for layer, (keys, values) in zip(cache.layers, part):  # keys, values: (nkv, n, hd)
                layer.keys[0, :, length:length + n].copy_(keys)
                layer.values[0, :, length:length + n].copy_(values)
            length += n
        for layer in cache.layers:
            layer.slots[:length] = torch.arange(length, device=layer.slots.device)
    return length


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
