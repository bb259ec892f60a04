"""Speculative decoding as the commands use it (generate, --chat, lmcli chat, jobs): the flags' one
check, the draft model loaded and checked against the target's tokenizer, and the `run` that a
generate_batch call takes in place of model.generate (lmcli.generation.speculative does the work).
A job's rows speculate each as its settings say (JobSpeculation), and carry their own counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from lmcli.errors import UsageError


@dataclass(frozen=True)
class SpeculationRequest:
    """What the flags ask for: prompt lookup (draft None) or a draft model, guessing up to K tokens a pass."""

    num_draft_tokens: int
    draft: str | None = None  # --draft-model PATH|NAME
    draft_quantize: str | None = None

    @property
    def method(self) -> str:
        return "prompt lookup" if self.draft is None else f"draft model {self.draft}"


def from_flags(prompt_lookup: bool, draft_model: str | None, num_draft_tokens: int | None,
               draft_quantize: str | None = None) -> SpeculationRequest | None:
    """The flags' one check (None: no speculation); UsageError names the flag that is wrong."""
    if not prompt_lookup and draft_model is None:
        for flag, value in (("--num-draft-tokens", num_draft_tokens), ("--draft-quantize", draft_quantize)):
            if value is not None:
                raise UsageError(f"{flag} needs --prompt-lookup or --draft-model")
        return None
    from lmcli.settings.table import FLAG_NAMES, SamplingError, check_settings

    try:  # the table's rule for the pair
        check_settings({"prompt_lookup": prompt_lookup, "draft_model": draft_model is not None})
    except SamplingError as e:
        raise UsageError(e.message_for(lambda name: FLAG_NAMES.get(name, name))) from None
    if draft_quantize is not None and draft_model is None:
        raise UsageError("--draft-quantize needs --draft-model")
    if draft_model is not None:  # found and checked now, before the main model takes its time to load
        from lmcli.errors import CheckpointError, ConfigError
        from lmcli.resolve.model_ref import resolve_model

        try:
            resolve_model(draft_model)
        except (CheckpointError, ConfigError) as exc:
            raise UsageError(f"--draft-model {exc}") from None
    from lmcli.generation.speculative import DEFAULT_DRAFT_TOKENS, check_num_draft_tokens

    try:
        k = check_num_draft_tokens(DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens)
    except ValueError as exc:
        raise UsageError("--" + str(exc).replace("_", "-")) from None
    return SpeculationRequest(k, draft_model, draft_quantize)


LOADED: list[Any] = []  # the speculators (and job speculations) this process made, newest last: for a command's summary


def wrap_loaded(request: SpeculationRequest | None, loaded: tuple[Any, Any], resolved: Any,
                load: Callable[..., tuple[Any, Any]] | None = None) -> tuple[Any, Any]:
    """A command's (model, tokenizer), with the model speculating as `request` asks (None: as it is);
    `load` (lmcli.load's signature: the command's, from the layer above) loads a draft model."""
    model, tokenizer = loaded
    if request is None:
        return model, tokenizer
    LOADED.append(Speculator(request, model, tokenizer, resolved.described(), load))
    return LOADED[-1].wrap(), tokenizer


class Speculator:
    """A request made ready for one target model: the draft loaded (same device and activation dtype)
    and checked, the stats of every run it makes."""

    def __init__(self, request: SpeculationRequest, model: Any, tokenizer: Any, target_name: str,
                 load: Callable[..., tuple[Any, Any]] | None = None):
        from lmcli.generation.speculative import SpeculationStats

        if getattr(model.config, "is_encoder_decoder", False):
            raise UsageError("speculative decoding (--prompt-lookup, --draft-model) works with decoder-only "
                             "models; this one is an encoder-decoder")
        self.request, self.model = request, model
        self.stats = SpeculationStats()
        self.off_rows = 0  # job rows it was switched off for (see add)
        if request.draft is not None and load is None:
            raise ValueError("a draft model needs `load` (lmcli.load) to load it")
        self.draft = None if request.draft is None or load is None else load_draft(request, model, tokenizer,
                                                                                   target_name, load)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """model.generate's arguments -> model.generate's result, speculatively."""
        extra: dict[str, Any] = {"stats": self.stats}
        if self.draft is None:
            extra["prompt_lookup"] = self.request.num_draft_tokens
        else:
            extra.update(draft_model=self.draft, num_draft_tokens=self.request.num_draft_tokens)
        return self.model.generate(*args, **kwargs, **extra)

    def add(self, stats: Any) -> None:
        """A job row's counts, into this speculator's totals (a row switched off leaves its note)."""
        total = self.stats
        total.drafted += stats.drafted
        total.accepted += stats.accepted
        total.passes += stats.passes
        total.draft_passes += stats.draft_passes
        if not stats.enabled:
            self.off_rows += 1
            total.note = stats.note

    def wrap(self) -> SpeculatingModel:
        """The model, with generate() speculative: what rows and jobs take without knowing of it."""
        return SpeculatingModel(self)

    def summary(self) -> str:
        stats = self.stats
        if not stats.enabled:
            return f"{self.request.method}: switched off ({stats.note})"
        draft = f", {stats.draft_passes} draft passes" if self.draft is not None else ""
        rows = f"{self.off_rows} row" + ("s" if self.off_rows != 1 else "")
        off = f"; switched off for {rows} ({stats.note})" if self.off_rows else ""
        return (f"{self.request.method}: {stats.drafted} drafted, {stats.accepted} accepted "
                f"({stats.acceptance:.0%}), {stats.passes} model passes{draft}{off}")


def load_draft(request: SpeculationRequest, model: Any, tokenizer: Any, target_name: str,
               load: Callable[..., tuple[Any, Any]]) -> Any:
    """The draft model for `model`, loaded by `load` (lmcli.load, which sits above this layer): on its
    device, in its activation dtype; UsageError (exit 2) when its tokenizer is not the target's."""
    from lmcli.generation.speculative_draft import DraftMismatch, check_same_tokenizer

    draft, draft_tokenizer = load(request.draft, device=model.device, dtype=model.dtype,
                                        quantize=request.draft_quantize)
    if getattr(draft.config, "is_encoder_decoder", False):
        raise UsageError(f"--draft-model {request.draft}: an encoder-decoder cannot draft for a decoder-only model")
    if draft_tokenizer is None or tokenizer is None:
        raise UsageError(f"--draft-model {request.draft}: both models need a tokenizer to compare")
    try:
        check_same_tokenizer(tokenizer, draft_tokenizer, target_name, str(request.draft))
    except DraftMismatch as exc:
        raise UsageError(str(exc)) from None
    draft_size, target_size = _weight_bytes(draft), _weight_bytes(model)
    if draft_size >= target_size:  # a pass of the draft then costs about what it saves
        import sys

        sys.stderr.write(f"warning: the draft model {request.draft} reads {draft_size >> 20} MiB of weights a token, "
                         f"no less than the model's {target_size >> 20} MiB: speculation will be slower\n")
    return draft


def _weight_bytes(model: Any) -> int:
    """What a pass reads: parameters and buffers (quantized weights are buffers)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


class SpeculatingModel:
    """A model whose generate() is its Speculator's run; everything else is the model's own."""

    def __init__(self, speculator: Speculator):
        self.speculator = speculator

    def __getattr__(self, name: str) -> Any:
        return getattr(self.speculator.model, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.speculator.run(*args, **kwargs)


class JobSpeculation:
    """A job's rows, each speculating as its settings say (`prompt_lookup`, `draft_model`, `num_draft_tokens`:
    the flags' choice unless the row makes its own). Rows that do not speculate go to the plain model (and
    so to continuous batching); those that do run apart (`apart`), and each result carries its own counts
    (`RowResult.speculation`); the job's totals, per method, are what `--stats` prints."""

    def __init__(self, model: Any, tokenizer: Any):
        flagged = getattr(model, "speculator", None)  # SpeculatingModel: --prompt-lookup or --draft-model
        self.model = flagged.model if flagged is not None else model  # plain generate()
        self.tokenizer = tokenizer
        self.draft_speculator = flagged if flagged is not None and flagged.draft is not None else None
        self.lookup: Speculator | None = flagged if flagged is not None and flagged.draft is None else None
        self.batch_size = 1
        if flagged is not None:
            LOADED.append(self)  # the job's summary is this one's

    def apart(self, rows: Iterable[Any], done: Callable[[Any], None], failed: Callable[[Any, Exception], None],
              errors: tuple[type[Exception], ...], batch_size: int = 1) -> Iterator[Any]:
        """Of PreparedRows, those that do not speculate; those that do are generated on the way (`done`),
        up to `batch_size` of one kind together where their passes can be shared exactly (see
        generation/speculative_batch.py), else each by itself; a failed call's unfinished rows are retried
        alone, and a row that fails alone is `failed(row, error)`."""
        waiting: dict[tuple, list[Any]] = {}
        self.batch_size = batch_size
        for row in rows:
            if not row.settings.speculates():
                yield row
                continue
            key = self._kind(row)
            if key is None:
                self._run_isolating([row], done, failed, errors)
                continue
            waiting.setdefault(key, []).append(row)
            if len(waiting[key]) >= batch_size:
                self._run_isolating(waiting.pop(key), done, failed, errors)
        for group in waiting.values():  # the input is over: the rest of each kind
            self._run_isolating(group, done, failed, errors)

    def _kind(self, row: Any) -> tuple | None:
        """What rows must share to go together (one generate call, the same length so that none decodes past
        its own end), or None where a row goes alone: a draft model (a cache per row), stop strings (a
        row's stop is seen only after the call), or a model whose rows cannot share passes exactly."""
        from lmcli.generation.speculative import DEFAULT_DRAFT_TOKENS
        from lmcli.generation.speculative_batch import can_decode_together

        settings = row.settings
        k = settings.num_draft_tokens or DEFAULT_DRAFT_TOKENS
        if settings.draft_model or settings.stop or not can_decode_together(
                self.model, max(2, self.batch_size), None, None, len(row.prompt_ids), settings.max_new_tokens, k):
            return None
        return settings.batch_key(), settings.max_new_tokens

    def _run_isolating(self, group: list[Any], done: Callable[[Any], None], failed: Callable[[Any, Exception], None],
                       errors: tuple[type[Exception], ...]) -> None:
        finished: list[Any] = []
        try:
            self.run_rows(group, done, finished)
        except errors as e:
            ended = {id(result.row) for result in finished}
            left = [row for row in group if id(row) not in ended]
            if len(group) == 1:
                for row in left:
                    failed(row, e)
                return
            for row in left:
                self._run_isolating([row], done, failed, errors)

    def run_rows(self, rows: list[Any], on_done: Callable[[Any], None], finished: list[Any] | None = None) -> None:
        """Generate speculating rows of one kind in one call; `on_done(result)` gets each with its own counts
        once the call returns (after it is added to `finished`)."""
        from lmcli.generation.rows import generate_batch
        from lmcli.generation.speculative import DEFAULT_DRAFT_TOKENS, SpeculationStats

        settings = rows[0].settings
        speculator = self._speculator(settings.draft_model)
        stats = SpeculationStats()
        k = settings.num_draft_tokens or DEFAULT_DRAFT_TOKENS
        extra: dict[str, Any] = {"stats": stats}
        if speculator.draft is None:
            extra["prompt_lookup"] = k
        else:
            extra.update(draft_model=speculator.draft, num_draft_tokens=k)
        finished = [] if finished is None else finished
        ended: list[Any] = []

        def run(*args: Any, **kwargs: Any) -> Any:
            return self.model.generate(*args, **kwargs, **extra)

        try:
            generate_batch(self.model, self.tokenizer, rows, on_done=ended.append, run=run)
        finally:  # the counts are whole only when the call is over (a row ends inside its last pass)
            # Each row's own counts; switched off, the call's note for each.
            per_row = stats.rows if len(stats.rows) == len(rows) else [stats] * len(rows)
            for row_stats in per_row:
                speculator.add(row_stats)
            for result in ended:
                place = next(i for i, row in enumerate(rows) if row is result.row)
                result.speculation = row_counts(speculator.request.method, per_row[place])
                finished.append(result)
                on_done(result)

    def _speculator(self, draft: bool) -> Speculator:
        if draft:
            if self.draft_speculator is None:  # settings/generation_settings.py refuses a row's "draft_model" without the flag
                raise RuntimeError("a row asked for the draft model, but none was loaded")
            return self.draft_speculator
        if self.lookup is None:  # a row asked for prompt lookup without the flag
            from lmcli.generation.speculative import DEFAULT_DRAFT_TOKENS

            self.lookup = Speculator(SpeculationRequest(DEFAULT_DRAFT_TOKENS), self.model, self.tokenizer, "")
            if self not in LOADED:
                LOADED.append(self)
        return self.lookup

    def summary(self) -> str:
        """A line per method the job used, with its totals over the rows."""
        return "\n".join(s.summary() for s in (self.draft_speculator, self.lookup) if s is not None)


def row_counts(method: str, stats: Any) -> dict[str, Any]:
    """A row's speculation as its output row records it."""
    if not stats.enabled:
        return {"method": method, "off": stats.note}
    counts = {"method": method, "drafted": stats.drafted, "accepted": stats.accepted, "passes": stats.passes}
    if stats.draft_passes:
        counts["draft_passes"] = stats.draft_passes
    return counts
