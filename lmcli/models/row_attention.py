"""Attention that gives each query the same numbers whatever batch or prefill chunk it is computed in.

Batched attention over a left-padded batch reduces each query's scores over all the batch's key
columns, masked ones included, and torch's CPU kernels split and order those reductions by the
number of columns, queries and rows: measured here, a query's output changed with the padding in
front of its row, with the keys after it (a prefill chunk sees fewer than the whole prompt) and with
the number of queries in the call. So this path calls attention per row, on that row's own keys in
slot order, never on another row's padding: once per query on exactly its keys (the call is then
the same alone, in any batch and in any chunking, so its result is too), or, in bfloat16 without a
window, once per row in a form measured to give each query the same numbers (`row_plans`). In that
form each query is its own batch entry, which torch's kernel computes on its own; so a decode step's
rows (one query each) go in one call of the whole step, each entry on its own row's keys
(`joined_plan`, `attend_joined`): the same numbers, one call a layer instead of one a row.

Cost: a call per row (or per row and query) where the batched path makes one per layer, but for the
decode steps of bfloat16 models (see the README's "Batch-invariant numerics").

Where the native kernel is built (models/native_attention.py: one call a layer, invariant by
construction, linear in memory), `Attention` and the compiled programs' `attend_rows` use it instead;
these calls are then the fallback (no compiler, `LMCLI_ATTENTION=torch`, a dtype it does not take).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KEY_BLOCK = 32  # keys of a row call are padded (masked) to a multiple of this; see `row_plans`


@dataclass(frozen=True)
class RowCall:
    """One attention call for row `row`: its queries `queries` (indices t) on keys `keys` (indices into
    the layer's keys, in slot order; with a mask, padded to its width by repeating the last), with an
    additive mask (queries, padded keys), or None: all visible."""

    row: int
    queries: list[int]
    keys: torch.Tensor
    mask: torch.Tensor | None


def row_plans(key_slots: torch.Tensor, query_slots: torch.Tensor, slot_is_token: torch.Tensor,
              window: int | None, dtype: torch.dtype, one_call_per_row: bool) -> list[RowCall]:
    """The calls that attend every real query of every row: key_slots [S] (-1: empty), query_slots [T],
    slot_is_token [B, S_total]. Shared by the layers of one type (they have the same key slots).

    `one_call_per_row` (bfloat16, no window): all of a row's queries in one call on its keys from its
    first one, padded with masked keys to a multiple of KEY_BLOCK, the queries as the call's batch (each
    its own rep query-head rows: with them as rows of one matrix, torch's CPU kernel blocked them by
    their number, and a query prefilled among 11 came out one rounding away from the same query alone);
    measured on torch's CPU kernel, a query's output is then the same whatever the number of queries or
    of padded keys in the call (not so at other key counts, nor in float32). Otherwise one call per
    query, on exactly its keys. So a speculative verify pass of several queries gives each the numbers
    a one-token step gives it (tests/test_speculative.py checks this on the default model)."""
    slots = key_slots.cpu()
    queries = query_slots.cpu()
    is_token = slot_is_token.cpu()
    calls = []
    for row in range(is_token.shape[0]):
        valid = (slots >= 0) & is_token[row, slots.clamp(min=0)]  # (S,)
        index = torch.nonzero(valid).flatten()
        index = index[torch.argsort(slots[index], stable=True)]  # slot order (a ring keeps its own order)
        ordered = slots[index]
        real = [t for t in range(len(queries)) if is_token[row, queries[t]]]  # pad queries are never read
        if not real:
            continue
        if one_call_per_row:
            end = int(torch.searchsorted(ordered, queries[real].max(), right=True))
            padded = -(-end // KEY_BLOCK) * KEY_BLOCK
            key_slot = torch.full((padded,), torch.iinfo(torch.long).max)
            key_slot[:end] = ordered[:end]
            allowed = key_slot[None, :] <= queries[real][:, None]  # (Q, padded): causal; padding never
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
            keys = index[torch.arange(padded).clamp(max=end - 1)]  # padding: masked copies of the last key
            calls.append(RowCall(row, real, keys.to(key_slots.device), mask.to(key_slots.device)))
            continue
        for t in real:
            q = int(queries[t])
            end = int(torch.searchsorted(ordered, q, right=True))
            start = int(torch.searchsorted(ordered, q - window, right=True)) if window is not None else 0
            calls.append(RowCall(row, [t], index[start:end].to(key_slots.device), None))
    return calls


@dataclass(frozen=True)
class JoinedCall:
    """Every real query of a step in ONE attention call, each query its own batch entry: entry i is query
    `queries[i]` of row `rows[i]` on that row's keys `index[i]` (indices into the layer's keys, in slot
    order, padded with masked copies of the row's last key to P, a multiple of KEY_BLOCK), `mask` [N, 1,
    1, P] 0 or -inf. torch's CPU kernel computes each batch entry on its own, and a query's numbers do
    not follow the number of queries or of padded keys (see `row_plans`), so an entry gets exactly the
    numbers of its row's own call, in one call where `row_plans` makes one a row."""

    rows: torch.Tensor  # [N] long
    queries: torch.Tensor  # [N] long
    index: torch.Tensor  # [N, P] long
    mask: torch.Tensor  # [N, 1, 1, P]
    whole: bool  # every row's one query, and T == 1: q and the output are the call's as they are
    # (batch stride, head stride) of the layers' keys -> the rows `_gather` reads: made once a step
    flat: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)


JOIN_LIMIT = 1 << 24  # the most elements (entries x keys x key width) a joined call gathers, per tensor


def joined_plan(key_slots: torch.Tensor, query_slots: torch.Tensor, slot_is_token: torch.Tensor,
                dtype: torch.dtype, key_width: int) -> JoinedCall | None:
    """The `one_call_per_row` calls of `row_plans` as one call (key_slots [S], -1 empty; query_slots [T];
    slot_is_token [B, S_total]), where every row has at most one real query (a decode step) and the
    gathered keys (`key_width` elements each) stay under JOIN_LIMIT; else None. A row of several queries
    keeps its own call: its queries share its keys there without a copy."""
    slots, queries, is_token = key_slots.cpu(), query_slots.cpu(), slot_is_token.cpu()
    real = is_token[:, queries]  # (B, T): pad queries are never read
    if bool((real.sum(-1) > 1).any()):
        return None
    rows, where = torch.nonzero(real, as_tuple=True)  # (N,), (N,)
    if rows.numel() == 0:
        return None
    valid = (slots >= 0)[None] & is_token[:, slots.clamp(min=0)]  # (B, S)
    order = torch.argsort(torch.where(valid, slots, torch.iinfo(torch.long).max), dim=-1, stable=True)  # slot order
    query = queries[where]  # (N,) slot of each entry's query
    seen = (valid[rows] & (slots[None] <= query[:, None])).sum(-1)  # (N,) keys each query sees
    padded = -(-max(int(seen.max()), 1) // KEY_BLOCK) * KEY_BLOCK
    if rows.numel() * padded * key_width > JOIN_LIMIT:
        return None
    position = torch.arange(padded)[None]  # (1, P)
    last = (seen - 1).clamp(min=0)[:, None]  # padding repeats the query's last key, finite as the row's own are
    index = order[rows[:, None], position.minimum(last)]  # (N, P)
    mask = torch.zeros((rows.numel(), padded), dtype=dtype).masked_fill_(position >= seen[:, None], float("-inf"))
    device = key_slots.device
    whole = rows.numel() == is_token.shape[0] and queries.numel() == 1
    return JoinedCall(rows.to(device), where.to(device), index.to(device), mask[:, None, None].to(device), whole)


def attend_joined(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: JoinedCall, scale: float,
                  rep: int) -> torch.Tensor:
    """q (B, nkv, rep * T, hd), k and v (B, nkv, S, hd) -> (B, nkv, rep * T, hd) as `attend_by_row` gives
    it, in the one call `call` (pad queries stay 0)."""
    B, nkv, width, hd = q.shape
    by_query = q.view(B, nkv, rep, width // rep, hd)
    with _one_thread(q.device):  # the copies too: small, and a busy second core makes a 2-thread op wait
        query = q if call.whole else by_query[call.rows, :, :, call.queries]  # (N, nkv, rep, hd)
        keys, values = _gather(k, call), _gather(v, call)  # (N, nkv, P, hd) each
        got = F.scaled_dot_product_attention(query, keys, values, attn_mask=call.mask, scale=scale)  # (N, nkv, rep, hd)
        if call.whole:
            return got
        out = torch.zeros_like(by_query)
        out[call.rows, :, :, call.queries] = got
    return out.view(B, nkv, width, hd)


def _gather(k: torch.Tensor, call: JoinedCall) -> torch.Tensor:
    """k (B, nkv, S, hd) -> each entry's keys (N, nkv, P, hd), contiguous. A cache's keys are whole rows
    of hd elements on a grid (a slice of a (B, nkv, L, hd) buffer), so one index_select of those rows;
    advanced indexing (ten times slower) for any other layout."""
    B, nkv, S, hd = k.shape
    N, P = call.index.shape
    step_b, step_h, step_s, step_d = k.stride()
    if step_d != 1 or step_s != hd or step_b % hd or step_h % hd:
        return k[call.rows[:, None], :, call.index].transpose(1, 2).contiguous()
    rows = ((B - 1) * step_b + (nkv - 1) * step_h) // hd + S  # the grid's rows up to k's last
    grid = k.as_strided((rows, hd), (hd, 1))  # (rows, hd), from k's first element
    flat = call.flat.get((step_b, step_h))
    if flat is None:
        heads = torch.arange(nkv, device=k.device) * (step_h // hd)  # (nkv,)
        flat = (call.rows * (step_b // hd))[:, None, None] + heads[None, :, None] + call.index[:, None, :]  # (N, nkv, P)
        flat = call.flat[(step_b, step_h)] = flat.flatten()
    return grid.index_select(0, flat).view(N, nkv, P, hd)


def attend_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: list[RowCall], scale: float,
                  softcap: float | None, rep: int) -> torch.Tensor:
    """q (B, nkv, rep * T, hd) (the query heads sharing a kv head as rows), k and v (B, nkv, S, hd)
    -> (B, nkv, rep * T, hd), each query attending to its planned keys only."""
    with _one_thread(q.device):
        return _attend_by_row(q, k, v, calls, scale, softcap, rep)


@contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """torch's CPU attention kernel rounds a call differently with the number of threads sharing its
    heads (measured: a decode call of 3 kv heads on 2 threads parts from the same call on 1, 3 or 4), and
    lmcli's thread count follows the load; so each row's calls run on one thread, and a row's numbers do
    not depend on the load (a toggle costs well under a microsecond; the calls are small)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _attend_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: list[RowCall], scale: float,
                   softcap: float | None, rep: int) -> torch.Tensor:
    B, nkv, rows, hd = q.shape
    T = rows // rep
    by_query = q.view(B, nkv, rep, T, hd)
    out = torch.zeros_like(by_query)  # pad queries stay 0
    for call in calls:
        b, n = call.row, len(call.queries)
        if call.mask is not None:  # the row's queries as a batch of n, each its own rep rows (see row_plans)
            # The keys padded to the mask's width with masked copies of the row's last one (row_plans).
            keys = k[b:b + 1].index_select(2, call.keys).expand(n, -1, -1, -1)  # (n, nkv, padded, hd)
            values = v[b:b + 1].index_select(2, call.keys).expand(n, -1, -1, -1)
            query = by_query[b, :, :, call.queries].permute(2, 0, 1, 3)  # (n, nkv, rep, hd)
            got = F.scaled_dot_product_attention(query, keys, values, attn_mask=call.mask[:, None, None], scale=scale)
            out[b, :, :, call.queries] = got.permute(1, 2, 0, 3)  # (nkv, rep, n, hd)
            continue
        where = call.queries[0] if n == 1 else torch.tensor(call.queries, device=q.device)
        query = by_query[b, :, :, where].reshape(1, nkv, rep * n, hd)
        keys = k[b:b + 1].index_select(2, call.keys)  # (1, nkv, s, hd)
        values = v[b:b + 1].index_select(2, call.keys)
        if softcap is None:
            got = F.scaled_dot_product_attention(query, keys, values, scale=scale)
        else:
            scores = (query @ keys.transpose(-2, -1)) * scale  # (1, nkv, rep, s)
            scores = torch.tanh(scores / softcap) * softcap
            got = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values
        out[b, :, :, where] = got.view(nkv, rep, n, hd) if n > 1 else got.view(nkv, rep, hd)
    return out.view(B, nkv, rows, hd)


def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The one-call-per-row path (`row_plans` with `one_call_per_row`) with the plan as tensors, for a
    one-token step or a chunk of T queries of rows without pad queries: q (B, nh, T, hd), k and v
    (B, nkv, S, hd), `index` [B, P] each row's keys in slot order (P a multiple of KEY_BLOCK), `mask`
    [B, T, 1, P] 0 for the keys each query sees, -inf for the rest -> (B, T, nh * hd). One call per row,
    the row's queries as its batch, as `attend_by_row` makes (one call for all rows when T is 1, as
    `attend_joined` makes); masked keys add exactly nothing."""
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    if T == 1:  # a one-token step: its rows in one call, each its own batch entry (see JoinedCall)
        every = torch.arange(B, device=q.device)
        call = JoinedCall(every, torch.zeros_like(every), index, mask, True)
        got = F.scaled_dot_product_attention(q.reshape(B, nkv, nh // nkv, hd), _gather(k, call), _gather(v, call),
                                             attn_mask=mask, scale=scale)  # (B, nkv, rep, hd)
        return got.reshape(B, 1, nh * hd)
    rows = []
    for b in range(B):
        query = q[b].reshape(nkv, nh // nkv, T, hd).permute(2, 0, 1, 3)  # (T, nkv, rep, hd): heads sharing a kv head
        keys, values = k[b:b + 1].index_select(2, index[b]), v[b:b + 1].index_select(2, index[b])  # (1, nkv, P, hd)
        got = F.scaled_dot_product_attention(query, keys.expand(T, -1, -1, -1), values.expand(T, -1, -1, -1),
                                             attn_mask=mask[b][:, None], scale=scale)  # (T, nkv, rep, hd)
        rows.append(got.reshape(T, nh * hd))
    return torch.stack(rows)  # (B, T, nh * hd)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """`attend_gathered` on one thread, as one op that a compiled program does not look into: the compiled
    steps (models/compiled_step.py, compiled_prefill.py) call it back through torch's dispatcher, so their
    attention is this very code under the one-thread rule, and a row's numbers do not follow the thread
    count there either."""
    return torch.ops.lmcli.attend_rows(q, k, v, index, mask, scale)


def _attend_rows_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    from lmcli.models import native_attention

    if native_attention.isa() is not None:  # the eager path's kernel, so a program's numbers are eager's
        visible = (mask[:, :, 0] == 0).sum(-1)  # (B, T): each query's keys are a prefix of its row's index
        plan = native_attention.NativePlan(index.cpu().contiguous(), torch.zeros_like(visible).cpu(),
                                           visible.cpu().contiguous())
        got = native_attention.attend(q, k, v, plan, scale, None)
        if got is not None:
            return got
    with _one_thread(q.device):
        return attend_gathered(q, k, v, index, mask, scale)


def _attend_rows_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1] * q.shape[3]))  # (B, T, nh * hd): what export traces


# A plain library op, not torch.library.custom_op: that one imports torch._dynamo (and inductor, 70 MB and
# seconds) at its first call, in every process that runs a program.
_LIBRARY = torch.library.Library("lmcli", "DEF")
_LIBRARY.define("attend_rows(Tensor q, Tensor k, Tensor v, Tensor index, Tensor mask, float scale) -> Tensor")
_LIBRARY.impl("attend_rows", _attend_rows_kernel, "CPU")
_LIBRARY.impl("attend_rows", _attend_rows_kernel, "CUDA")
_LIBRARY.impl("attend_rows", _attend_rows_shape, "Meta")
