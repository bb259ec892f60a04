"""The key/value caches: allocated once per generate() call, written by position; rolling buffers of
exactly `sliding_window` slots for sliding-window layers; traverse_cache for casting, moving and
selecting rows; and cached decoding that equals full recomputation."""

from __future__ import annotations

import pytest
import torch
from tiny import VOCAB, left_pad, prompts, save_reference

import lmcli
from lmcli.models.cache import KVCache, ModelCache, RollingKVCache

pytestmark = pytest.mark.usefixtures("one_thread")


def capture_caches(model, monkeypatch, transform=None):
    """Make model.init_cache record (and optionally traverse) every cache it returns."""
    caches = []
    original = model.init_cache

    def init_cache(batch_size, max_length):
        cache = original(batch_size, max_length)
        if transform is not None:
            cache = model.traverse_cache(cache, transform)
        caches.append(cache)
        return cache

    monkeypatch.setattr(model, "init_cache", init_cache)
    return caches


def tensors(cache):
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


# --- shapes and kinds -----------------------------------------------------------------------------


def test_init_cache_gives_sliding_layers_a_ring_of_exactly_the_window(tiny_models):
    model = tiny_models("gemma2")  # layers: sliding (window 4), full, sliding
    config = model.config
    cache = model.init_cache(2, 20)
    assert isinstance(cache, ModelCache)
    assert [type(layer) for layer in cache.layers] == [RollingKVCache, KVCache, RollingKVCache]
    for layer, kind in zip(cache.layers, config.layer_types):
        length = config.sliding_window if kind == "sliding_attention" else 20
        assert layer.keys.shape == layer.values.shape == (2, config.num_key_value_heads, length, config.head_dim)
        assert layer.keys.dtype == model.dtype
    # A run no longer than the window needs no ring: a static buffer of the run's length.
    short = model.init_cache(1, 3)
    assert [type(layer) for layer in short.layers] == [KVCache] * 3
    assert all(layer.keys.shape[2] == 3 for layer in short.layers)


def test_a_cache_is_allocated_once_per_call(tiny_models, monkeypatch):
    model = tiny_models("mistral")
    caches = capture_caches(model, monkeypatch)
    ids = torch.stack(prompts([6, 6]))
    model.generate(ids, 12, do_sample=False)
    assert len(caches) == 1
    pointers = [t.data_ptr() for t in tensors(caches[0])]
    model.generate(ids, 12, do_sample=False, use_cache=False)
    assert len(caches) == 1  # no cache at all without use_cache
    # written in place: the buffers generation ended with are the ones allocated
    assert [t.data_ptr() for t in tensors(caches[0])] == pointers


# --- rolling buffers -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mistral", "mixtral", "qwen2-window", "gemma2", "gemma3_text"])
def test_rolling_cache_memory_does_not_grow_with_the_text(tiny_models, monkeypatch, case):
    model = tiny_models(case)
    window = model.config.sliding_window
    sliding = [i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"]
    caches = capture_caches(model, monkeypatch)
    (prompt,) = prompts([3])
    sizes = {}
    for multiple in (1, 3, 6):
        new = multiple * window - len(prompt)
        out = model.generate(prompt[None], new, do_sample=False)
        assert out.shape[1] == multiple * window
        cache = caches[-1]
        sizes[multiple] = [cache.layers[i].keys.nbytes + cache.layers[i].values.nbytes for i in sliding]
        if multiple > 1:
            for i in sliding:
                ring = cache.layers[i]
                assert ring.keys.shape[2] == window
                # it holds the last `window` slots fed (the last generated token is never fed back)
                fed = out.shape[1] - 1
                assert sorted(ring.slots.tolist()) == list(range(fed - window, fed))
    assert sizes[1] == sizes[3] == sizes[6]
    if len(sliding) == len(model.config.layer_types):  # every layer slides: the whole cache is constant
        assert len({caches[0].nbytes(), caches[1].nbytes(), caches[2].nbytes()}) == 1


def test_rolling_buffer_keeps_the_last_window_slots():
    torch.manual_seed(0)
    window, B, H, D = 4, 2, 3, 5
    ring = RollingKVCache(B, H, window, D, torch.float32, torch.device("cpu"))
    written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (k, v)

    def check(keys, values, slots, query_slots):
        for index, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(keys[:, :, index], written[slot][0])
                assert torch.equal(values[:, :, index], written[slot][1])
        live = sorted(s for s in slots.tolist() if s >= 0)
        last = int(query_slots[-1])
        # every key a query of this update may attend to (the window ending at each query) is there
        needed = {s for q in query_slots.tolist() for s in range(max(0, q - window + 1), q + 1)}
        assert needed <= set(live) and max(live) == last

    chunk = torch.arange(7)  # a prefill longer than the window
    k, v = torch.randn(B, H, 7, D), torch.randn(B, H, 7, D)
    written.update({s: (k[:, :, i], v[:, :, i]) for i, s in enumerate(chunk.tolist())})
    check(*ring.update(k, v, chunk), chunk)
    assert sorted(ring.slots.tolist()) == [3, 4, 5, 6]
    for slot in range(7, 7 + 3 * window):
        k, v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
        written[slot] = (k[:, :, 0], v[:, :, 0])
        keys, values, slots = ring.update(k, v, torch.tensor([slot]))
        assert keys.shape[2] == window  # a single token attends over the ring alone
        check(keys, values, slots, torch.tensor([slot]))
        assert sorted(ring.slots.tolist()) == list(range(slot - window + 1, slot + 1))


def test_static_cache_writes_by_slot():
    torch.manual_seed(0)
    cache = KVCache(1, 2, 10, 4, torch.float32, torch.device("cpu"))
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    keys, values, slots = cache.update(k, v, torch.arange(3))
    assert torch.equal(keys, k) and torch.equal(values, v) and slots.tolist() == [0, 1, 2]
    k2, v2 = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    keys, values, slots = cache.update(k2, v2, torch.tensor([3]))
    assert torch.equal(keys, torch.cat([k, k2], 2)) and torch.equal(values, torch.cat([v, v2], 2))
    assert slots.tolist() == [0, 1, 2, 3]
    assert cache.keys.shape[2] == 10  # allocated once for the whole run


# --- cached decoding equals recomputation ----------------------------------------------------------


@pytest.mark.parametrize("case", ["gpt2", "llama", "mistral", "mixtral", "qwen2-window", "gemma2", "gemma3_text"])
def test_cached_logits_equal_full_recomputation(tiny_models, case):
    """Every step's logits, for a left-padded batch whose prompts are shorter and longer than the window."""
    model = tiny_models(case)
    ids, mask = left_pad(prompts([2, 9, 6], seed=2))
    runs = {}
    for use_cache in (True, False):
        events: list[torch.Tensor] = []
        out = model.generate(ids, 14, do_sample=False, attention_mask=mask, use_cache=use_cache,
                             on_token=lambda e, events=events: events.append(e.logits.clone()))
        runs[use_cache] = out, torch.stack(events)
    assert runs[True][0].tolist() == runs[False][0].tolist()
    torch.testing.assert_close(runs[True][1], runs[False][1], atol=1e-4, rtol=0)


# --- traverse_cache --------------------------------------------------------------------------------


def test_traverse_cache_applies_fn_to_every_batched_tensor(tiny_models):
    model = tiny_models("gemma2")
    cache = model.init_cache(3, 20)
    before = cache.nbytes()
    seen = []

    def to_double(t):
        seen.append(t.shape)
        return t.to(torch.float64)

    assert model.traverse_cache(cache, to_double) is cache
    assert len(seen) == 2 * len(cache.layers)  # keys and values of every layer
    assert all(t.dtype == torch.float64 for t in tensors(cache))
    assert cache.nbytes() == 2 * before
    rolling = [layer for layer in cache.layers if isinstance(layer, RollingKVCache)]
    assert rolling and all(layer.slots.dtype == torch.long for layer in rolling)  # bookkeeping, not data

    model.traverse_cache(cache, lambda t: t[[2, 0]])  # select / reorder rows
    assert all(t.shape[0] == 2 for t in tensors(cache))

    model.traverse_cache(cache, lambda t: t.to("meta"))  # move: per-slot bookkeeping follows the data
    assert all(t.device.type == "meta" for t in tensors(cache))
    assert all(layer.slots.device.type == "meta" for layer in rolling)


@pytest.mark.parametrize("case", ["mistral", "gemma2"])
def test_generation_runs_with_a_traversed_cache(tiny_models, monkeypatch, case):
    model = tiny_models(case)
    ids, mask = left_pad(prompts([3, 9], seed=3))
    plain = model.generate(ids, 12, do_sample=False, attention_mask=mask)
    # float64 holds float32 keys exactly: the very same tokens
    caches = capture_caches(model, monkeypatch, lambda t: t.to(torch.float64))
    assert model.generate(ids, 12, do_sample=False, attention_mask=mask).tolist() == plain.tolist()
    assert all(t.dtype == torch.float64 for t in tensors(caches[-1]))
    # bfloat16 keys and values: runs, stays bfloat16, and (rounded keys) still writes valid tokens
    caches = capture_caches(model, monkeypatch, lambda t: t.to(torch.bfloat16))
    out = model.generate(ids, 12, do_sample=True, attention_mask=mask, seed=[1, 2])
    assert out.shape == plain.shape and ((out >= 0) & (out < VOCAB)).all()
    assert all(t.dtype == torch.bfloat16 for t in tensors(caches[-1]))


def test_a_half_precision_model_caches_in_its_own_dtype(tmp_path):
    save_reference("gemma2", tmp_path)
    model, _ = lmcli.load(tmp_path, dtype=torch.bfloat16, device="cpu")
    cache = model.init_cache(2, 20)
    assert {t.dtype for t in tensors(cache)} == {torch.bfloat16}
    ids, mask = left_pad(prompts([3, 9], seed=4))
    for do_sample in (False, True):
        out = model.generate(ids, 12, do_sample, attention_mask=mask, seed=[1, 2])
        assert out.shape == (2, ids.shape[1] + 12) and ((out >= 0) & (out < VOCAB)).all()


# --- trimming: a rollback equals never having fed the tokens ---------------------------------------


def feed(model, cache, ids, slot_is_token, start, end):
    """Logits [B, end - start, V] for columns start..end-1, with the cache holding columns before start."""
    from lmcli.generation.loop import positions_from_mask

    positions = positions_from_mask(slot_is_token[:, :end])[:, start:end]
    return model.forward_slots(ids[:, start:end], positions, torch.arange(start, end), slot_is_token, cache)


@pytest.mark.parametrize(("case", "rollback", "draft"), [
    ("llama", 0, 4),  # static: any number of tokens
    ("mistral", 0, 1),  # a ring of exactly the window: the one slot the next write reuses
    ("gemma2", 3, 4),  # rings with 3 spare slots beside a static layer
])
def test_trim_then_feed_equals_a_fresh_run_of_the_shorter_text(tiny_models, case, rollback, draft):
    """A draft fed token by token, trimmed, then other tokens fed (a chunk, then one): every logit equals
    a fresh cache fed the shorter text, and the model without a cache."""
    model = tiny_models(case)
    ids, mask = left_pad(prompts([7, 10], seed=3))
    width = ids.shape[1]
    (draft_ids, other_ids) = (torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(n))
                              for n in (draft, 3))
    length = width + max(draft, 3)
    slot_is_token = torch.cat([mask.bool(), torch.ones(2, length - width, dtype=torch.bool)], 1)
    drafted = torch.cat([ids, draft_ids, torch.zeros(2, length - width - draft, dtype=torch.long)], 1)
    other = torch.cat([ids, other_ids, torch.zeros(2, length - width - 3, dtype=torch.long)], 1)
    max_length = 24
    window = model.config.sliding_window
    with torch.inference_mode():
        cache = model.init_cache(2, max_length, rollback=rollback)
        if window is not None:
            assert any(isinstance(layer, RollingKVCache) for layer in cache.layers)
        feed(model, cache, drafted, slot_is_token, 0, width)
        for column in range(width, width + draft):
            feed(model, cache, drafted, slot_is_token, column, column + 1)
        assert cache.is_trimmable() and cache.trimmable() >= draft
        assert cache.trim(draft) == draft
        trimmed = torch.cat([feed(model, cache, other, slot_is_token, width, width + 2),
                             feed(model, cache, other, slot_is_token, width + 2, width + 3)], 1)

        fresh_cache = model.init_cache(2, max_length, rollback=rollback)
        feed(model, fresh_cache, other, slot_is_token, 0, width)
        fresh = torch.cat([feed(model, fresh_cache, other, slot_is_token, width, width + 2),
                           feed(model, fresh_cache, other, slot_is_token, width + 2, width + 3)], 1)
        uncached = model(other[:, :width + 3], slot_is_token[:, :width + 3].long())[:, width:]
    assert torch.equal(trimmed, fresh)
    torch.testing.assert_close(trimmed, uncached, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("window", "spare"), [(4, 0), (4, 3), (5, 1)])
def test_a_ring_can_be_trimmed_exactly_as_far_as_it_keeps_the_next_window(window, spare):
    """trimmable() is how many tokens (any count up to it) can be forgotten with every key the next query
    needs still held, found here by trying each count; trim() forgets no more than that."""
    ring = RollingKVCache(1, 1, window, 2, torch.float32, torch.device("cpu"), spare=spare)
    k = torch.zeros(1, 1, 1, 2)
    for length in range(1, 3 * (window + spare)):
        ring.update(k, k, torch.tensor([length - 1]))
        held = set(ring.slots.tolist()) - {-1}
        assert held == set(range(max(0, length - window - spare), length))

        def can_forget(n, held=held, length=length):
            start = length - n  # the next query's slot
            return n <= length and set(range(max(0, start - window + 1), start)) <= held

        expected = 0  # trimming is by any count up to trimmable(): the first count that cannot, less one
        while expected < length and can_forget(expected + 1):
            expected += 1
        assert ring.trimmable() == expected and ring.is_trimmable() == (expected > 0)
    copy = RollingKVCache(1, 1, window, 2, torch.float32, torch.device("cpu"), spare=spare)
    copy.slots = ring.slots.clone()
    assert copy.trim(expected + 5) == expected
    assert sorted(set(copy.slots.tolist()) - {-1}) == sorted(s for s in held if s < length - expected)
    assert copy.trimmable() == 0 or spare > 0  # a ring of exactly the window: once, then not again


def test_a_static_cache_trims_whatever_it_holds():
    cache = KVCache(1, 1, 10, 2, torch.float32, torch.device("cpu"))
    assert not cache.is_trimmable() and cache.trim(3) == 0
    cache.update(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2), torch.arange(6))
    assert cache.trimmable() == 6
    assert cache.trim(2) == 2 and cache.trimmable() == 4
    assert cache.trim(9) == 4 and not cache.is_trimmable()
    with torch.inference_mode():  # as generate() makes them; a chat trims later, outside inference mode
        made = KVCache(1, 1, 10, 2, torch.float32, torch.device("cpu"))
        made.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), torch.arange(3))
    assert made.trim(1) == 1 and made.trimmable() == 2
