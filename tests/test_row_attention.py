"""Batch-invariant attention (models/row_attention.py) against attention called on each query's own keys.

The reference here is built from the layout alone, query by query, with plain Python: the keys a query
sees (its row's tokens up to its slot, in slot order), copied out contiguous, and one
`F.scaled_dot_product_attention` call for that query alone on one thread: in bfloat16 without a window,
those keys padded with zero keys to a multiple of KEY_BLOCK under an additive -inf mask (the form
`row_plans` documents as giving a query the same numbers in any call), else exactly those keys.
Each path must give every real query exactly those numbers, whatever the other rows, the columns it
does not read (stale, huge or NaN), the thread count and the way the plan joins or splits the calls.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from lmcli.models.cache import KVCache
from lmcli.models.compiled_step import decode_plan
from lmcli.models.row_attention import (
    KEY_BLOCK,
    JoinedCall,
    attend_by_row,
    attend_gathered,
    attend_joined,
    joined_plan,
    row_plans,
)

NKV, REP, HD = 3, 3, 64  # the default model's heads: 9 query heads on 3 kv heads, head size 64
SCALE = HD**-0.5


def _reference(q, keys, values, key_slots, query_slots, is_token, window, padded):
    """(B, nkv, rep * T, hd): each real query alone on its own keys; pad queries 0."""
    B, _, width, _ = q.shape
    T = width // REP
    by_query = q.view(B, NKV, REP, T, HD)
    out = torch.zeros_like(by_query)
    slots = key_slots.tolist()
    with _threads(1):
        for b in range(B):
            for t, slot in enumerate(query_slots.tolist()):
                if not is_token[b, slot]:
                    continue
                seen = sorted((s, i) for i, s in enumerate(slots)
                              if 0 <= s <= slot and is_token[b, s] and (window is None or s > slot - window))
                index = torch.tensor([i for _, i in seen])
                k = keys[b, :, index].contiguous()[None]  # (1, nkv, n, hd)
                v = values[b, :, index].contiguous()[None]
                query = by_query[b, :, :, t].contiguous()[None]  # (1, nkv, rep, hd)
                mask = None
                if padded:
                    width_keys = -(-len(seen) // KEY_BLOCK) * KEY_BLOCK
                    k = torch.cat([k, k.new_zeros(1, NKV, width_keys - len(seen), HD)], dim=2)
                    v = torch.cat([v, v.new_zeros(1, NKV, width_keys - len(seen), HD)], dim=2)
                    mask = torch.zeros(1, 1, 1, width_keys, dtype=q.dtype)
                    mask[..., len(seen):] = float("-inf")
                got = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=SCALE)
                out[b, :, :, t] = got[0]
    return out.view(B, NKV, width, HD)


class _threads:
    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def _layout(rng: random.Random, batch: int, end: int, queries: int, kind: str) -> torch.Tensor:
    """slot_is_token [B, end]: each row's tokens as continuous batching places them (consecutive columns
    ending at the step's last), or with holes (a left-padded batch's prompts), or ending early (a pad query)."""
    is_token = torch.zeros(batch, end, dtype=torch.bool)
    for b in range(batch):
        start = rng.randrange(0, end - queries + 1)
        if kind == "holes" and b % 2:
            is_token[b, start:] = torch.rand(end - start, generator=torch.Generator().manual_seed(b)) < 0.7
            is_token[b, end - queries:] = True
        elif kind == "early" and b == 0:
            is_token[b, start:end - 1] = True  # its last query is a pad
        else:
            is_token[b, start:] = True
    return is_token


def _cached_step(batch: int, end: int, queries: int, dtype: torch.dtype, shift: int):
    """A KVCache with room beyond `end`, its columns holding stale values, shifted back by `shift` (as
    continuous batching moves every row), then written at the step's query slots: q, and the keys,
    values and key slots attention gets (copies, for `_poison`)."""
    length = end + 40
    cache = KVCache(batch, NKV, length, HD, dtype, torch.device("cpu"))
    with torch.inference_mode():
        cache.keys.normal_().mul_(4)
        cache.values.normal_()
        cache.slots.copy_(torch.arange(length))
        if shift:
            cache.shift(-shift)
    query_slots = torch.arange(end - queries, end)
    k = (torch.randn(batch, NKV, queries, HD) * 3).to(dtype)
    v = torch.randn(batch, NKV, queries, HD).to(dtype)
    keys, values, key_slots = cache.update(k, v, query_slots, end)
    q = (torch.randn(batch, NKV, REP * queries, HD) * 2).to(dtype)
    return q, keys.clone(), values.clone(), key_slots, query_slots


def _poison(keys: torch.Tensor, values: torch.Tensor, is_token: torch.Tensor, value: float) -> None:
    """Write `value` into every column a row holds no token of: no query may read it."""
    hidden = ~is_token[:, None, :keys.shape[2], None]  # (B, 1, S, 1)
    keys.masked_fill_(hidden, value)
    values.masked_fill_(hidden, value)


CASES = [  # batch, end, queries per row, layout, poison
    (8, 150, 1, "consecutive", float("nan")),
    (8, 333, 1, "holes", 3e38),
    (3, 97, 1, "early", float("nan")),
    (1, 31, 1, "consecutive", 0.0),
    (5, 600, 1, "consecutive", float("inf")),
    (4, 90, 5, "consecutive", float("nan")),  # a verify pass or prefill chunk: several queries a row
    (2, 70, 17, "holes", 3e38),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_bfloat16_rows_get_their_own_calls_numbers(case, threads):
    batch, end, queries, kind, poison = case
    rng = random.Random(end * 7 + queries)
    torch.manual_seed(end)
    is_token = _layout(rng, batch, end, queries, kind)
    q, keys, values, key_slots, query_slots = _cached_step(batch, end, queries, torch.bfloat16, rng.choice([0, 3]))
    _poison(keys, values, is_token, poison)
    want = _reference(q, keys, values, key_slots, query_slots, is_token, None, padded=True)
    joined = joined_plan(key_slots, query_slots, is_token, torch.bfloat16, NKV * HD)
    with _threads(threads):
        if queries == 1:
            assert isinstance(joined, JoinedCall)  # a decode step: one call for all its rows
            assert torch.equal(attend_joined(q, keys, values, joined, SCALE, REP), want)
        else:
            assert joined is None  # a row of several queries keeps its own call
        plans = row_plans(key_slots, query_slots, is_token, None, torch.bfloat16, True)
        assert torch.equal(attend_by_row(q, keys, values, plans, SCALE, None, REP), want)
        # Keys in no cache's layout (not whole rows on a grid): the joined call's other gather.
        if joined is not None:
            odd = keys.transpose(2, 3).contiguous().transpose(2, 3)
            assert torch.equal(attend_joined(q, odd, values, joined, SCALE, REP), want)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_compiled_steps_gathered_rows_get_their_own_calls_numbers(threads):
    """attend_gathered (the compiled programs' attention): rows of one query each, as decode_plan plans them."""
    rng = random.Random(5)
    torch.manual_seed(5)
    batch, end = 6, 200
    is_token = _layout(rng, batch, end, 1, "holes")
    q, keys, values, key_slots, query_slots = _cached_step(batch, end, 1, torch.bfloat16, 0)
    _poison(keys, values, is_token, 50.0)  # finite: decode_plan pads with a column the row may not hold
    want = _reference(q, keys, values, key_slots, query_slots, is_token, None, padded=True)
    index, mask = decode_plan(is_token, end, torch.bfloat16)
    nh_q = q.view(batch, NKV, REP, 1, HD).reshape(batch, NKV * REP, 1, HD)  # (B, nh, T, hd)
    with _threads(threads):
        got = attend_gathered(nh_q, keys, values, index, mask, SCALE)  # (B, T, nh * hd)
    assert torch.equal(got, want.reshape(batch, NKV * REP, HD).reshape(batch, 1, NKV * REP * HD))


@pytest.mark.parametrize("window", [None, 24])
def test_float32_and_windowed_queries_get_their_own_keys_exactly(window):
    rng = random.Random(11)
    torch.manual_seed(11)
    batch, end, queries = 4, 120, 3
    dtype = torch.float32 if window is None else torch.bfloat16
    is_token = _layout(rng, batch, end, queries, "holes")
    q, keys, values, key_slots, query_slots = _cached_step(batch, end, queries, dtype, 2)
    _poison(keys, values, is_token, float("nan"))
    want = _reference(q, keys, values, key_slots, query_slots, is_token, window, padded=False)
    plans = row_plans(key_slots, query_slots, is_token, window, dtype, False)
    with _threads(2):
        assert torch.equal(attend_by_row(q, keys, values, plans, SCALE, None, REP), want)


def test_a_step_too_wide_to_gather_keeps_a_call_per_row(monkeypatch):
    """Past JOIN_LIMIT the joined call's copies would be too big: the plan says so, and row calls remain."""
    from lmcli.models import row_attention

    rng = random.Random(3)
    is_token = _layout(rng, 4, 100, 1, "consecutive")
    key_slots, query_slots = torch.arange(100), torch.tensor([99])
    plan = joined_plan(key_slots, query_slots, is_token, torch.bfloat16, NKV * HD)
    assert plan is not None
    monkeypatch.setattr(row_attention, "JOIN_LIMIT", plan.index.numel() * NKV * HD - 1)  # one element short
    assert joined_plan(key_slots, query_slots, is_token, torch.bfloat16, NKV * HD) is None
