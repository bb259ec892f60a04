"""Attention that gives each query the same numbers whatever batch or prefill chunk it is computed in.

Batched attention over a left-padded batch reduces each query's scores over all the batch's key
columns, masked ones included, and torch's CPU kernels split and order those reductions by the
number of columns, queries and rows: measured here, a query's output changed with the padding in
front of its row, with the keys after it (a prefill chunk sees fewer than the whole prompt) and with
the number of queries in the call. So this path calls attention once per row and query, on exactly
that query's keys (its own row's tokens up to itself, within the window) in slot order and without
a mask: the call is the same alone, in any batch and in any chunking, so its result is too.

Cost: one call per row and query where the batched path makes one per layer; small for decoding
(one query per row), more for long prefills (see the README's "Batch-invariant numerics").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class QueryKeys:
    """For one row: (query index, key indices in slot order) for each of its real queries."""

    row: int
    queries: list[tuple[int, torch.Tensor]]


def row_plans(key_slots: torch.Tensor, query_slots: torch.Tensor, slot_is_token: torch.Tensor,
              window: int | None) -> list[QueryKeys]:
    """Which keys each real query of each row attends to: key_slots [S] (-1: empty), query_slots [T],
    slot_is_token [B, S_total]. Shared by the layers of one type (they have the same key slots)."""
    slots = key_slots.cpu()
    queries = query_slots.cpu().tolist()
    is_token = slot_is_token.cpu()
    plans = []
    for row in range(is_token.shape[0]):
        filled = slots >= 0
        valid = filled & is_token[row, slots.clamp(min=0)]  # (S,)
        index = torch.nonzero(valid).flatten()
        index = index[torch.argsort(slots[index], stable=True)]  # slot order (a ring keeps its own order)
        ordered = slots[index]
        chosen = []
        for t, q in enumerate(queries):
            if not is_token[row, q]:
                continue  # a pad query: its output is never read
            end = int(torch.searchsorted(ordered, q, right=True))
            start = int(torch.searchsorted(ordered, q - window, right=True)) if window is not None else 0
            chosen.append((t, index[start:end].to(key_slots.device)))
        plans.append(QueryKeys(row, chosen))
    return plans


def attend_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plans: list[QueryKeys], scale: float,
                  softcap: float | None, rep: int) -> torch.Tensor:
    """q (B, nkv, rep * T, hd) (the query heads sharing a kv head as rows), k and v (B, nkv, S, hd)
    -> (B, nkv, rep * T, hd), each query attending to its planned keys only."""
    B, nkv, rows, hd = q.shape
    T = rows // rep
    by_query = q.view(B, nkv, rep, T, hd)
    out = torch.zeros_like(by_query)  # pad queries stay 0
    for plan in plans:
        b = plan.row
        for t, index in plan.queries:
            query = by_query[b:b + 1, :, :, t].contiguous()  # (1, nkv, rep, hd)
            keys = k[b:b + 1].index_select(2, index)  # (1, nkv, s, hd)
            values = v[b:b + 1].index_select(2, index)
            if softcap is None:
                got = F.scaled_dot_product_attention(query, keys, values, scale=scale)
            else:
                scores = (query @ keys.transpose(-2, -1)) * scale  # (1, nkv, rep, s)
                scores = torch.tanh(scores / softcap) * softcap
                got = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values
            out[b, :, :, t] = got[0]
    return out.view(B, nkv, rows, hd)
