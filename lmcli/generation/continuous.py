"""Continuous batching of job rows: up to `batch_size` rows in flight, a finished row's place refilled
at once by the next row, each row with its own settings, seed, stop strings and constraint.

The batch is the loop's slot layout (loop.py) kept running: a cache of `capacity` columns shared by the
rows, `slot_is_token` [B, capacity] saying which columns hold each row's tokens, and each token's
position counted within its own row. A row enters by being prefilled alone, in a one-row cache (reusing
a cached prefix of its prompt, prefix_cache.py), exactly as a single run prefills it; its keys are then
copied into a free row of the batch, at the columns that end where the batch's next column begins,
and it decodes with the others from the next step. On the batch-invariant path (the load's
Numerics.batch_invariant, kernels/numerics.py: attention per row on that row's own keys in slot order, kernels that give a row the same numbers at
any row count) a row's keys, logits and tokens are then those of its single run, whatever column it
started at and whoever its neighbours are; each row chooses its tokens with its own processors and
its own random stream, as `generate_batch` would for that row alone.

Columns only move forward: when the batch's next column reaches `capacity`, every row's columns move
left by the start of the oldest row in flight (ModelCache.shift), so `capacity` need only be the
longest row's length plus room; a row whose prompt is longer than the columns behind the next one
moves them right first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from lmcli import threads
from lmcli.generation.loop import TokenEvent
from lmcli.generation.prefix_cache import PrefixCache
from lmcli.generation.row_choice import RowChooser
from lmcli.generation.rows import (
    BatchPolicy,
    PreparedRow,
    RowResult,
    batch_policy,
    finish_row,
    logprob_steps,
    new_result,
    take_token,
)
from lmcli.generation.sampling import ProcessorChain, make_processor_chain, make_sampler
from lmcli.generation.step import Step
from lmcli.kernels import lora
from lmcli.models.cache import KVCache, ModelCache

SCHEDULER_ENV = "LMCLI_JOB_SCHEDULER"  # "continuous" or "batches": overrides use_continuous's choice
PREFILL_CHUNK = 512  # prompt tokens per prefill call: bounds the activations of a long prompt
MIN_CAPACITY = 256


def use_continuous(model: Any) -> bool:
    """Whether a job runs its rows continuously (else in planned batches, rows.plan_batches): by default
    on decoder-only models whose rows are batch-invariant (only there is a row's text exactly its single
    run's); never with a model split over ranks (--tp), whose ranks decode in step, nor with speculation
    (lmcli.generation.speculative_setup.SpeculatingModel), whose generate() this scheduler would bypass."""
    choice = os.environ.get(SCHEDULER_ENV, "")
    able = (hasattr(model, "forward_slots") and not getattr(model.config, "is_encoder_decoder", False)
            and getattr(model, "tensor_parallel", None) is None and getattr(model, "speculator", None) is None)
    if choice == "batches" or not able:
        return False
    return choice == "continuous" or Step.of(model).numerics.batch_invariant


@dataclass
class ContinuousStats:
    """What a continuous run did: rows, decode steps and how full the batch was, prefill reuse."""

    batch_size: int = 0
    rows: int = 0
    steps: int = 0  # batched decode steps
    busy: int = 0  # rows in flight, summed over the steps
    shifts: int = 0  # times the columns were moved
    alone: int = 0  # rows run by themselves (too long for the batch's columns, or no new tokens)
    prefill_requested: int = 0
    prefill_computed: int = 0
    prefix_evicted: int = 0  # prefix-cache blocks dropped to stay within its bound
    from_disk: int = 0  # prompt tokens restored from the prefix cache's disk tier
    from_memory: int = 0  # and from its memory
    prompt_cache: str = ""  # where the prefix cache keeps blocks (console.prompt_cache_state)
    decode_seconds: float = 0.0  # wall time in the batched steps (their forwards and token choice)

    @property
    def occupancy(self) -> float:
        return self.busy / max(1, self.steps * self.batch_size)

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "steps": self.steps, "occupancy": round(self.occupancy, 4),
                "shifts": self.shifts, "rows_alone": self.alone, "prefill_requested": self.prefill_requested,
                "prefill_computed": self.prefill_computed, "prefix_evicted": self.prefix_evicted,
                "prefill_from_disk": self.from_disk, "prefill_from_memory": self.from_memory,
                "decode_seconds": round(self.decode_seconds, 3)}


@dataclass
class _Row:
    """A row in flight: its result so far, how it chooses tokens, and its text (prompt + new tokens)."""

    result: RowResult
    policy: BatchPolicy
    chain: ProcessorChain
    choose: Callable[[torch.Tensor], torch.Tensor]
    text: torch.Tensor  # [prompt + max_new_tokens] long
    length: int  # tokens of `text` so far
    start: int = 0  # the batch column of its first token
    step: int = 0
    prompt_cache: ModelCache | None = None  # its prefilled prompt, until placed in the batch


@dataclass
class _Batch:
    cache: ModelCache
    slot_is_token: torch.Tensor  # [B, capacity] bool
    rows: list[_Row | None]
    column: int = 0  # the next column to write
    capacity: int = 0
    feed: list[int] = field(default_factory=list)  # each row's token to feed next


class ContinuousRun:
    """Runs rows through one continuous batch. `on_done(result)` gets each row the moment it finishes;
    `alone(row)` runs a row that does not fit the batch by itself (generate_batch, same tokens)."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, *, on_done: Callable[[RowResult], None],
                 alone: Callable[[PreparedRow], None], prefix_cache: PrefixCache | None = None,
                 prefill_chunk: int = PREFILL_CHUNK):
        self.model, self.tokenizer = model, tokenizer
        self.step = Step.of(model)  # the one decoding step (step.py), with the load's numerics
        self.batch_size = batch_size
        self.on_done, self.alone = on_done, alone
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.stats = ContinuousStats(batch_size=batch_size)
        self.batch: _Batch | None = None
        self.chooser = RowChooser()

    # --- admission ----------------------------------------------------------------------------------

    def run(self, rows: Iterable[PreparedRow], isolate: Callable[[list[PreparedRow]], None],
            errors: tuple[type[BaseException], ...] = (ValueError, RuntimeError)) -> None:
        """Every row, `batch_size` at a time in flight. A row that fails to start (e.g. its constraint),
        or the rows in flight when a batched step fails, go to `isolate`, which runs them one by one so
        that only a bad row fails (and none is lost); the batch then starts afresh."""
        pending: Iterator[PreparedRow] = iter(rows)
        with torch.inference_mode(), contextlib.closing(self.chooser):
            while True:
                for row in self._take(pending):
                    try:
                        self._admit(row)
                    except errors:
                        isolate([row])
                if self.batch is None or not any(self.batch.rows):
                    if self._exhausted:
                        return
                    continue
                started = _now()
                try:
                    self._step()
                except errors:
                    stranded = [live.result.row for live in self.batch.rows if live is not None]
                    self.batch = None
                    isolate(stranded)
                self.stats.decode_seconds += _now() - started

    _exhausted = False

    def _take(self, pending: Iterator[PreparedRow]) -> list[PreparedRow]:
        """As many rows as there are free places (all of them before the batch exists, to size it)."""
        free = self.batch_size if self.batch is None else sum(live is None for live in self.batch.rows)
        taken: list[PreparedRow] = []
        while len(taken) < free and not self._exhausted:
            row = next(pending, None)
            if row is None:
                self._exhausted = True
            else:
                taken.append(row)
        if self.batch is None and taken:
            self.batch = self._new_batch(max(self._need(row) for row in taken))
        return taken

    def _need(self, row: PreparedRow) -> int:
        """Columns a row takes: its prompt and all its new tokens but the last (never fed)."""
        return len(row.prompt_ids) + row.settings.max_new_tokens - 1

    def _new_batch(self, need: int) -> _Batch:
        max_positions = self.model.config.max_position_embeddings
        capacity = min(max_positions, max(MIN_CAPACITY, 2 * need))
        cache = self.model.init_cache(self.batch_size, capacity)
        slot_is_token = torch.zeros(self.batch_size, capacity, dtype=torch.bool, device=self.model.device)
        return _Batch(cache, slot_is_token, [None] * self.batch_size, capacity=capacity, feed=[0] * self.batch_size)

    def _admit(self, row: PreparedRow) -> None:
        assert self.batch is not None
        max_positions = self.model.config.max_position_embeddings
        self.stats.rows += 1
        if (row.settings.max_new_tokens == 0 or self._need(row) >= self.batch.capacity
                or len(row.prompt_ids) + row.settings.max_new_tokens > max_positions):
            self.stats.alone += 1
            self.alone(row)  # no token to make, or past what the batch's columns (or the model) hold
            return
        live, logits = self._prefill(row)
        if self._choose(live, logits):
            return  # finished at its first token: it never joins the batch
        self._place(live)

    def _prefill(self, row: PreparedRow) -> tuple[_Row, torch.Tensor]:
        """The row's prompt in a one-row cache of full layers, as its single run computes it; the last
        logits [1, V]."""
        model, config = self.model, self.model.config
        ids = row.prompt_ids
        n = len(ids)
        device = model.device
        one = ModelCache([KVCache(1, config.num_key_value_heads, n, config.head_dim, model.dtype, device)
                          for _ in config.layer_types])
        # A row with adapters of its own (kernels/lora.py) computes other keys for the same tokens: it
        # neither reuses nor stores prefixes (the others share the command's adapters, or none).
        prefix_cache = self.prefix_cache if row.settings.lora is None else None
        known = prefix_cache.logits(ids, one) if prefix_cache is not None else None  # a prompt seen before
        cached = prefix_cache.restore(ids, one, whole=known is not None) if prefix_cache is not None else 0
        self.stats.prefill_requested += n
        self.stats.prefill_computed += n - cached
        x = torch.tensor([ids], dtype=torch.long, device=device)  # (1, n)
        is_token = torch.ones(1, n, dtype=torch.bool, device=device)
        logits = known  # (1, V)
        if cached < n:
            slots = torch.arange(cached, n, device=device)
            with lora.routed(lora.routing_for(model, [row.settings.lora])):
                logits = self.step.prefill(x[:, cached:], slots[None], slots, is_token, one, self.prefill_chunk)
        assert logits is not None
        logits = logits.float()
        if prefix_cache is not None:
            prefix_cache.store(ids, one, n, logits)
        policy = batch_policy(model, self.tokenizer, [row], n)
        chain = make_processor_chain(policy.do_sample, 1.0, None, None, policy.processors)
        choose = make_sampler(policy.do_sample, [row.seed] if policy.do_sample else None, 1, device)
        text = torch.empty(n + row.settings.max_new_tokens, dtype=torch.long, device=device)
        text[:n] = x[0]
        result = new_result(self.tokenizer, row, _now())
        return _Row(result, policy, chain, choose, text, n, prompt_cache=one), logits

    def _choose(self, live: _Row, logits: torch.Tensor) -> bool:
        """The row's next token from its logits [1, V], as its single run chooses it; True when it ends."""
        return self._record(live, _token(live, logits), logits)

    def _record(self, live: _Row, token: torch.Tensor, logits: torch.Tensor) -> bool:
        """Record the row's chosen token [1] (its logprobs, text and stop checks; its end); True when it ends."""
        result = live.result
        if result.logprobs is not None and result.row.settings.logprobs is not None:
            event = TokenEvent(live.step, token, torch.zeros(1, dtype=torch.bool), torch.ones(1), logits)
            result.logprobs.append(logprob_steps(self.tokenizer, event, result.row.settings.logprobs)(0))
        live.step += 1
        value = int(token)
        live.text[live.length] = value
        live.length += 1
        reason = take_token(result, value, live.policy.stop_at_eos, None)
        if reason is None:
            return False
        finish_row(result, reason, None, self.on_done, live.chain.end_row(0))
        return True

    def _place(self, live: _Row) -> None:
        """Put a prefilled row into a free batch row, its prompt in the columns before the next one."""
        batch = self.batch
        assert batch is not None
        n = live.length - 1  # its prompt (its first new token is fed at the next step)
        busy = any(other is not None for other in batch.rows)
        if batch.column < n:
            if busy:
                self._shift(n - batch.column)
            else:
                batch.slot_is_token.zero_()
                batch.column = n
        place = batch.rows.index(None)
        start = batch.column - n
        assert live.prompt_cache is not None
        batch.cache.place(place, live.prompt_cache, start)
        live.prompt_cache = None
        batch.slot_is_token[place].zero_()
        batch.slot_is_token[place, start:batch.column] = True
        live.start = start
        batch.rows[place] = live
        batch.feed[place] = int(live.text[n])

    def _shift(self, d: int) -> None:
        """Move every row's columns by `d` (left when negative)."""
        batch = self.batch
        assert batch is not None
        batch.cache.shift(d)
        moved = torch.zeros_like(batch.slot_is_token)
        if d > 0:
            moved[:, d:] = batch.slot_is_token[:, :-d]
        else:
            moved[:, :d] = batch.slot_is_token[:, -d:]
        batch.slot_is_token.copy_(moved)
        batch.column += d
        for live in batch.rows:
            if live is not None:
                live.start += d
        self.stats.shifts += 1

    def _shrink(self) -> None:
        """With no row left to start, drop the batch's free places once a quarter of it is free: the
        rows still in flight stop paying for the empty ones at every step."""
        batch = self.batch
        assert batch is not None
        keep = [place for place, live in enumerate(batch.rows) if live is not None]
        if len(batch.rows) - len(keep) < max(1, len(batch.rows) // 4):
            return
        index = torch.tensor(keep, device=self.model.device)
        batch.cache.traverse(lambda tensor: tensor.index_select(0, index))
        batch.slot_is_token = batch.slot_is_token.index_select(0, index)
        batch.rows = [batch.rows[place] for place in keep]
        batch.feed = [batch.feed[place] for place in keep]

    # --- decoding -----------------------------------------------------------------------------------

    def _step(self) -> None:
        """One token for every row in flight; rows that end leave their place free."""
        threads.recheck()  # the thread count follows the load (a clock read unless it is time to look)
        batch = self.batch
        assert batch is not None
        if self._exhausted:
            self._shrink()
        if batch.column >= batch.capacity:
            self._shift(-min(live.start for live in batch.rows if live is not None))
        device = self.model.device
        column = batch.column
        busy = [live is not None for live in batch.rows]
        batch.slot_is_token[:, column] = torch.tensor(busy, device=device)
        positions = torch.tensor([[column - live.start if live is not None else 0] for live in batch.rows],
                                 device=device)  # (B, 1)
        feed = torch.tensor(batch.feed, dtype=torch.long, device=device)[:, None]  # (B, 1)
        # A free place's output is never read: it takes whatever costs least (the command's adapters).
        choices = [live.result.row.settings.lora if live is not None else None for live in batch.rows]
        with lora.routed(lora.routing_for(self.model, choices)):
            logits = self.step.decode(feed, positions, torch.tensor([column], device=device), batch.slot_is_token,
                                      batch.cache).float()  # (B, V)
        batch.column += 1
        self.stats.steps += 1
        self.stats.busy += sum(busy)
        # The rows choose side by side where they may (row_choice.py); what they share (the results,
        # the output, a constraint's masks) is then updated here, in the rows' order.
        places = [place for place, live in enumerate(batch.rows) if live is not None]
        rows = [live for live in batch.rows if live is not None]
        tokens = self.chooser.run([partial(_token, live, logits[place:place + 1]) for place, live in zip(places, rows)],
                                  [live.chain.same_on_any_thread for live in rows])
        for place, live, token in zip(places, rows, tokens):
            if self._record(live, token, logits[place:place + 1]):
                batch.rows[place] = None
            else:
                batch.feed[place] = int(live.text[live.length - 1])


def _token(live: _Row, logits: torch.Tensor) -> torch.Tensor:
    """The row's next token [1] from its logits [1, V], by its own processors and random stream; touches
    nothing but the row's chain and sampler (so it may run on a worker thread)."""
    context = live.text[None, :live.length] if live.chain.needs_history else live.text[None, :0]
    return live.choose(live.chain(context, logits))


def _now() -> float:
    import time

    return time.perf_counter()
