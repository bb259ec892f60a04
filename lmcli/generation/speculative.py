"""Speculative decoding: the same tokens as plain greedy (or the same distribution as plain sampling),
in fewer passes of the model over its weights.

At each step a row proposes up to k tokens: by prompt lookup, those that followed the latest n-gram's
previous occurrence in its prompt or its text so far; with a draft model, the draft's own choices
(speculative_draft.py). The model then reads its last token and the k guesses in one pass through the
cache; batch-invariant attention computes each query as a one-token step computes it
(models/row_attention.py), so its logits at each position are plain decoding's. Greedy keeps the longest prefix of guesses equal to its own
argmax, plus its next token after it; sampling keeps or replaces each guess by the standard rule
(speculative_sampling.py). Rejected keys and values are trimmed from the caches (rolling caches keep
`num_draft_tokens` spare slots for that). Processors see, at each verified position, the text as
plain decoding would have it there, so greedy gives token for token `generate(..., do_sample=False)`.

k adapts per row: it doubles (up to `num_draft_tokens`) after a guess is taken whole and falls to one
more than what was taken after a miss; with prompt lookup, a guess rejected whole also rests the row's
guessing for 1, then 3, 7 and at most 15 passes while the misses go on (a hit ends the rest), so text
that gives nothing to look up, or looks up the wrong thing, costs almost nothing.

A batch is decoded in shared passes where that is exact (speculative_batch.py: batch-invariant
models, prompt lookup, no sliding window), else row by row; either way each row gets what it gets
alone, which is what it gets in a plain padded batch. Processors must depend only on the text and the logits they are given (all of
lmcli's do; a structured-output mask, which follows the text step by step, switches speculation off).
Where the prompt plus max_new_tokens exceeds max_position_embeddings (the target's or the draft's),
speculation is off and the plain loop runs; `SpeculationStats.note` says why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcli import threads
from lmcli.config import eos_id_list
from lmcli.generation import loop
from lmcli.generation.sampling import LogitsProcessor, make_processor_chain, row_generators
from lmcli.generation.speculative_batch import can_decode_together, decode_together
from lmcli.generation.speculative_draft import DraftProposer, fits
from lmcli.generation.speculative_sampling import accept_or_resample, draw
from lmcli.generation.step import Step
from lmcli.settings.table import SETTINGS, SamplingError

DEFAULT_DRAFT_TOKENS = 8  # --prompt-lookup's K unless --num-draft-tokens says
LONGEST_NGRAM = 3
SHORTEST_NGRAM = 2  # single tokens recur too often by chance to be worth a guess
MAX_PAUSE = 15  # prompt lookup's longest rest after guesses wholly rejected: text that copies nothing costs little


def check_num_draft_tokens(value: Any) -> int:
    """num_draft_tokens by its rule (lmcli.settings.table's table: an integer in [1, MAX_DRAFT_TOKENS]), for the
    API and the flags; ValueError says the whole rule."""
    setting = SETTINGS["num_draft_tokens"]
    try:
        return int(setting.require(value))
    except SamplingError:
        raise ValueError(f"num_draft_tokens {setting.requirement}, got {value!r}") from None


@dataclass
class SpeculationStats:
    """What speculation did: tokens guessed, guesses the model kept, and model passes over the text."""

    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    draft_passes: int = 0
    enabled: bool = True  # False where speculation was switched off (see the module docstring)
    note: str | None = None  # why it was
    cached: int = 0  # with a given cache: the columns it holds after the call
    rows: list[SpeculationStats] = field(default_factory=list)  # each row's own (the fields above: their sums)

    def add(self, other: SpeculationStats) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.passes += other.passes
        self.draft_passes += other.draft_passes

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class NgramLookup:
    # Proposals are certain (a point mass), so sampling keeps a guess with the target's own probability.
    """Where each n-gram of a growing token list last occurred, so a guess costs a few dict reads."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens  # shared with the caller, who appends to it
        self.indexed = 0  # n-grams ending before this index (whose continuation exists) are indexed
        self.last_seen: dict[tuple[int, ...], int] = {}  # n-gram -> index just after its latest occurrence

    def propose(self, k: int) -> list[int]:
        tokens = self.tokens
        for end in range(self.indexed, len(tokens) - 1):  # index n-grams ending at `end`, continued at end + 1
            for n in range(SHORTEST_NGRAM, LONGEST_NGRAM + 1):
                if end + 1 >= n:
                    self.last_seen[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self.indexed = max(self.indexed, len(tokens) - 1)
        for n in range(LONGEST_NGRAM, SHORTEST_NGRAM - 1, -1):
            if len(tokens) >= n and (start := self.last_seen.get(tuple(tokens[-n:]))) is not None:
                return tokens[start:start + k]
        return []


def generate(model: loop.SlotModel[Any], x: torch.Tensor, max_new_tokens: int, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
             attention_mask: torch.Tensor | None = None, eos_token_id: Any = None, pad_token_id: int | None = None,
             *, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS, draft_model: Any = None, seed: Any = None,
             logits_processors: Sequence[LogitsProcessor] | None = None,
             on_token: Callable[[loop.TokenEvent], Any] | None = None, ignore_output: bool = False,
             stats: SpeculationStats | None = None, cache: Any = None, cached: int = 0) -> torch.Tensor | None:
    """`loop.generate(model, x, ...)`'s result (greedy: the same tokens; sampling: the same distribution),
    guessing up to `num_draft_tokens` a pass by prompt lookup, or with `draft_model` (same tokenizer).

    `stats`, if given, is filled in. With a batch, `on_token` is called after every row is done, with
    the steps replayed in batch shape (a row's stop still stops it; what it computed past that is dropped).

    `cache` (one row, made with `rollback=num_draft_tokens`) already holds x's first `cached` columns, as
    loop.generate_from_cache takes it (a chat); afterwards `stats.cached` says how many it holds.
    """
    if cache is not None and (x.shape[0] != 1 or not 0 <= cached < x.shape[1]):
        raise ValueError("a given cache takes one row, and cached must be less than its prompt's length")
    num_draft_tokens = check_num_draft_tokens(num_draft_tokens)
    stats = stats if stats is not None else SpeculationStats()
    mask = loop._validate_inputs(x, max_new_tokens, attention_mask)
    batch, width = x.shape
    note = _why_not(model, draft_model, width + max_new_tokens, use_cache, logits_processors)
    if note is not None:
        stats.enabled, stats.note = False, note
        ids, stats.cached = loop.generate_from_cache(
            model, x, max_new_tokens, do_sample, temperature, top_k, top_p, use_cache, attention_mask=attention_mask,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed, logits_processors=logits_processors,
            on_token=on_token, ignore_output=ignore_output, cache=cache, cached=cached)
        return None if ignore_output else ids
    chain = make_processor_chain(do_sample, temperature, top_k, top_p, logits_processors)
    eos = eos_id_list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    generators = row_generators(seed, batch, model.device) if do_sample else [None] * batch
    keep_logits = on_token is not None and batch > 1
    live = on_token if batch == 1 else None
    rows = [_Row(model, x[i].to(model.device), mask[i].to(model.device), i, batch, max_new_tokens, num_draft_tokens,
                 chain, eos, SpeculationStats(), keep_logits, live, generators[i])
            for i in range(batch)]
    if can_decode_together(model, batch, draft_model, cache, width, max_new_tokens, num_draft_tokens):
        decode_together(model, rows)  # one pass for every row's guesses
    else:
        for row in rows:
            stats.cached = row.run(draft_model, cache, cached)
    for row in rows:
        stats.add(row.stats)
    stats.rows = [row.stats for row in rows]
    if on_token is not None and batch > 1:
        _replay(rows, on_token, pad_token_id, model.device)
    if ignore_output:
        return None
    steps = max(len(row.new_tokens) for row in rows)
    ids = torch.full((batch, width + steps), pad_token_id, dtype=torch.long, device=model.device)
    ids[:, :width] = x.to(model.device)
    for i, row in enumerate(rows):
        ids[i, width:width + len(row.new_tokens)] = torch.tensor(row.new_tokens, dtype=torch.long)
    return ids


def _why_not(model: Any, draft_model: Any, total: int, use_cache: bool,
             processors: Sequence[LogitsProcessor] | None) -> str | None:
    """Why speculation is switched off for this call (None: it is on)."""
    if not use_cache:
        return "speculation needs the cache (use_cache=False)"
    if total > model.config.max_position_embeddings:
        return "the text would pass the model's context, where decoding reads a sliding view without a cache"
    if draft_model is not None and not fits(draft_model, total):
        return f"the text would pass the draft model's context ({draft_model.config.max_position_embeddings})"
    if any(getattr(p, "follows_text_step_by_step", False) for p in processors or ()):
        return "a structured-output constraint follows the text one token at a time"
    return None


class _Row:
    """One row's speculative decode, in the slot layout of the plain loop (left pads kept, masked out)."""

    def __init__(self, model: loop.SlotModel[Any], ids: torch.Tensor, mask: torch.Tensor, index: int, batch: int,
                 max_new_tokens: int, max_draft: int, chain: Any, eos: list[int], stats: SpeculationStats,
                 keep_logits: bool, on_token: Callable[[loop.TokenEvent], Any] | None,
                 generator: torch.Generator | None):
        self.model, self.index, self.batch = model, index, batch
        self.step = Step.of(model)
        self.width = ids.shape[0]
        self.total = self.width + max_new_tokens
        self.max_new_tokens, self.max_draft = max_new_tokens, max_draft
        self.chain, self.eos, self.stats = chain, set(eos), stats
        self.generator = generator  # the row's own random stream (None: greedy)
        self.ids = torch.zeros((1, self.total), dtype=torch.long, device=ids.device)  # (1, L)
        self.ids[0, :self.width] = ids
        self.slot_is_token = torch.ones((1, self.total), dtype=torch.bool, device=ids.device)  # (1, L)
        self.slot_is_token[0, :self.width] = mask
        # Processors see pads replaced by the row's first token, as in the plain loop.
        first = int(ids[int((~mask).sum())])
        self.ids[0, :self.width] = torch.where(mask, ids, torch.full_like(ids, first))
        self.tokens = ids[mask].tolist()  # the real tokens so far (prompt, then new): what lookup reads
        self.new_tokens: list[int] = []
        self.logits: list[torch.Tensor] = []  # each new token's raw logits [V], with keep_logits
        self.keep_logits = keep_logits
        self.on_token = on_token

    def run(self, draft_model: Any = None, cache: Any = None, cached: int = 0) -> int:
        """Decode the row; returns how many leading columns of its text the cache holds."""
        model, device = self.model, self.ids.device
        if cache is None:
            cache = model.init_cache(1, self.total, rollback=self.max_draft)  # type: ignore[call-arg]  # BaseModel's
        positions = loop.positions_from_mask(self.slot_is_token)  # (1, L)
        self.start(draft_model)
        # The prompt in one pass, as the plain loop feeds it; its last logits give the first token.
        logits = self.step.prefill(self.ids[:, cached:self.width], positions[:, cached:self.width],
                                   torch.arange(cached, self.width, device=device), self.slot_is_token,
                                   cache).float()  # (1, V)
        if self.first(logits[0]):
            return self.width
        while not self.done:
            threads.recheck()  # the thread count follows the load, as in the plain loop
            length = self.length
            guess, dists = self.propose()
            end = length + len(guess)
            # The newest token, then the guesses, each query as a one-token step would compute it.
            logits = self.step.forward(self.ids[:, length - 1:end], positions[:, length - 1:end],
                                       torch.arange(length - 1, end, device=device), self.slot_is_token, cache,
                                       last_only=not guess)[0, -1 - len(guess):]
            rejected = self.verify(logits.float(), guess, dists)  # (1 + len(guess), V)
            # The cache holds the newest token and every guess; keep only the guesses taken.
            if cache.trim(rejected) != rejected:  # never: the ring keeps max_draft spare slots
                raise RuntimeError(f"the cache could not trim {rejected} rejected tokens")
        return self.length - 1  # the newest token is fed with the next pass

    # The steps of a decode, shared with speculative_batch.py (which feeds many rows' guesses in one pass).

    def start(self, draft_model: Any = None) -> None:
        self.draft = DraftProposer(draft_model, self.tokens, len(self.tokens) + self.max_new_tokens, self.max_draft,
                                   self.model.config.vocab_size) if draft_model is not None else None
        self.lookup = NgramLookup(self.tokens)
        self.length, self.k, self.done = self.width, self.max_draft, False
        self.misses = self.pause = 0  # prompt lookup's guesses wholly rejected in a row; passes left unguessed

    def first(self, logits: torch.Tensor) -> bool:
        """The first new token from the prompt's last logits [V]; True when the row ends with it."""
        self.stats.passes += 1
        token = self._pick(self.width, logits)[0]
        self.ids[0, self.width] = token
        self.length = self.width + 1
        self.done = self._emit(token, logits) or len(self.new_tokens) >= self.max_new_tokens
        if self.done:
            self._finish()
        return self.done

    def propose(self) -> tuple[list[int], list[torch.Tensor] | None]:
        """This pass's guess (written into the text after the newest token) and its proposals (a draft's)."""
        room = self.max_new_tokens - len(self.new_tokens)  # the model's own token takes one
        want = min(self.k, room - 1)
        dists: list[torch.Tensor] | None = None
        if want > 0 and self.draft is None and self.pause:
            self.pause -= 1  # a guess costs a wider pass (about 1.7x a one-token pass at batch 1 here)
            want = 0
        if want <= 0:
            guess: list[int] = []
        elif self.draft is not None:
            guess, dists = self.draft.propose(want, functools.partial(self._pick_guess, self.length))
        else:
            guess = self.lookup.propose(want)
        self.ids[0, self.length:self.length + len(guess)] = torch.tensor(guess, dtype=torch.long)
        return guess, dists

    def verify(self, logits: torch.Tensor, guess: list[int], dists: list[torch.Tensor] | None) -> int:
        """The guesses kept and the model's next token, from the pass's logits [1 + len(guess), V] at the
        newest token and each guess; returns how many guesses were rejected."""
        length = self.length
        self.stats.passes += 1
        self.stats.drafted += len(guess)
        taken, stop = 0, False
        for j in range(len(guess) + 1):
            if j < len(guess):
                token, kept = self._check(length + j, logits[j], guess[j], dists[j] if dists else None)
            else:
                token, kept = self._pick(length + j, logits[j])[0], False
            stop = self._emit(token, logits[j])
            if kept and not stop:
                taken += 1
                continue
            self.ids[0, length + j] = token
            break
        self.stats.accepted += taken
        self.length += taken + 1
        if self.draft is not None:
            self.draft.keep()
        if guess:
            self.k = min(self.max_draft, 2 * self.k) if taken == len(guess) else taken + 1
            self.misses = self.misses + 1 if taken == 0 else 0
            self.pause = min(2 ** self.misses - 1, MAX_PAUSE)  # 1, 3, 7, 15 passes after each whole miss
        self.done = stop or len(self.new_tokens) >= self.max_new_tokens
        if self.done:
            self._finish()
        return len(guess) - taken

    def _finish(self) -> None:
        if self.draft is not None:
            self.stats.draft_passes += self.draft.passes

    def _scores(self, length: int, logits: torch.Tensor) -> torch.Tensor:
        """The processed scores [V] at a position with the text's first `length` columns before it."""
        context = self.ids[:, :length] if self.chain.needs_history else self.ids[:, :0]
        if self.batch > 1:  # processors may keep per-row settings: give them the whole batch's shape
            context = context.expand(self.batch, -1)
            return self.chain(context, logits.expand(self.batch, -1).clone())[self.index]
        return self.chain(context, logits[None].clone())[0]

    def _pick(self, length: int, logits: torch.Tensor, write: bool = False) -> tuple[int, torch.Tensor | None]:
        """The token plain decoding chooses at a position (argmax, or a draw from the row's stream), and
        the probabilities it was drawn from (None: greedy). `write`: put it in the text (a draft's guess)."""
        scores = self._scores(length, logits)
        if self.generator is None:
            token, probs = int(scores.argmax()), None
        else:
            probs = torch.softmax(scores.float(), dim=-1)
            token = draw(probs, self.generator)
        if write:
            self.ids[0, length] = token
        return token, probs

    def _pick_guess(self, length: int, j: int, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft's j-th guess after the text's first `length` columns, written into the text."""
        return self._pick(length + j, logits, write=True)

    def _check(self, length: int, logits: torch.Tensor, guess: int, q: torch.Tensor | None) -> tuple[int, bool]:
        """The token at a guessed position and whether it is the guess (greedy: the argmax is; sampling:
        the acceptance rule against the guess's proposal q, None for a certain one)."""
        if self.generator is None:
            token = int(self._scores(length, logits).argmax())
            return token, token == guess
        p = torch.softmax(self._scores(length, logits).float(), dim=-1)
        return accept_or_resample(p, guess, q, self.generator)

    def _emit(self, token: int, logits: torch.Tensor) -> bool:
        """Record a new token; True when the row ends with it."""
        self.new_tokens.append(token)
        self.tokens.append(token)
        if self.keep_logits:
            self.logits.append(logits)
        stop = token in self.eos
        if self.on_token is not None:
            device = logits.device
            n = len(self.new_tokens)
            event = loop.TokenEvent(n - 1, torch.tensor([token], device=device), torch.tensor([stop], device=device),
                                    torch.tensor([n], device=device), logits[None])
            asked = self.on_token(event)
            if asked is not None and bool(torch.as_tensor(asked).any()):
                stop = True
        return stop


def _replay(rows: list[_Row], on_token: Callable[[loop.TokenEvent], Any], pad_token_id: int,
            device: torch.device) -> None:
    """Call `on_token` step by step as the plain loop would for the whole batch; a row it stops is cut there."""
    batch = len(rows)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    vocab = rows[0].logits[0].shape[-1]
    for step in range(max(len(row.new_tokens) for row in rows)):
        tokens = torch.full((batch,), pad_token_id, dtype=torch.long, device=device)
        logits = torch.zeros((batch, vocab), device=device)
        for i, row in enumerate(rows):
            if not finished[i] and step < len(row.new_tokens):
                tokens[i] = row.new_tokens[step]
                logits[i] = row.logits[step]
        lengths += (~finished).long()
        finished |= torch.tensor([t in row.eos for t, row in zip(tokens.tolist(), rows)], device=device) & ~finished
        asked = on_token(loop.TokenEvent(step, tokens, finished.clone(), lengths.clone(), logits))
        if asked is not None:
            finished |= torch.as_tensor(asked, dtype=torch.bool, device=device).expand(batch)
        for i, row in enumerate(rows):
            if finished[i]:
                del row.new_tokens[step + 1:]
        if bool(finished.all()):
            break
