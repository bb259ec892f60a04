"""Token choice: one small class per logits transform, the one factory that builds a chain of them,
and per-row RNGs.

Every transform has the uniform call `(input_ids [B, S], logits [B, V]) -> logits [B, V]` and checks
its argument once, in __init__, by its setting's rule in lmcli.settings.table (the table of settings), so
the CLI, job rows and generate() name a setting in their own words from `SamplingError.setting`.

One road builds chains: `SamplingSettings.policy`, for settings (greedy is `temperature == 0`, as the
CLI and job rows say it) and for generate()'s own temperature/top_k/top_p (`sampling_transforms`,
where greedy is `do_sample=False`). The order is transformers': logit bias, repetition penalty,
(presence and frequency penalties, which transformers lacks), n-gram blocking, minimum new tokens;
then, when sampling, temperature, top-k, top-p, min-p and typical-p. A penalty therefore acts on the
raw logits, before truncation. A structured-output constraint (`RowConstraints`: each row its own, or
none) comes first, so that truncation chooses among allowed tokens only.

Processors may keep per-row state (a constraint's matcher): such a processor has `end_row(row)`, which
drops the row's state when it ends and returns what went wrong with it (None: nothing), and
`follows_text_step_by_step` when it must see every token as it is chosen (speculation then stays off).
Constrained and free rows share a chain: a free row's state is empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lmcli.generation.nucleus import TopP as TopP  # top-p, exact at a fraction of the sort's cost
from lmcli.settings.table import (
    SETTINGS,
    DecodingFields,
    check_logit_bias_ids,
    check_number,
    check_settings,
    check_truncation,
    is_int,
)
from lmcli.settings.table import SamplingError as SamplingError  # raised by every processor below

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_temperature(value: Any) -> float:
    """Sampling temperature as generate() takes it (greedy is do_sample=False, not temperature 0)."""
    return check_number("temperature", value, lambda v: v > 0, "must be > 0 (use do_sample=False for greedy)")


# ----------------------------------------------------------------------------- warpers (sampling only)


class Temperature:
    needs_history = False
    same_on_any_thread = True

    def __init__(self, temperature: float):
        self.temperature = check_temperature(temperature)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        scaled = logits / self.temperature
        if self.temperature < 1 and bool(torch.isposinf(scaled).any()):
            # So small a temperature overflows (1e-45: 10 / t is past float32's range, and softmax of
            # inf is nan); its limit keeps the best tokens alone. Shifted by the best logit first, in
            # float64, the best tokens are 0 and the rest far below (or -inf).
            wide = logits.double()
            scaled = ((wide - wide.amax(dim=-1, keepdim=True)) / self.temperature).to(logits.dtype)
        return scaled


class TopK:
    """Keep the k most likely tokens."""

    needs_history = False
    same_on_any_thread = True

    def __init__(self, top_k: int):
        self.top_k = SETTINGS["top_k"].require(top_k)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, logits.shape[-1])
        kth_best = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
        return logits.masked_fill(logits < kth_best, float("-inf"))


class MinP:
    """Keep the tokens at least `min_p` times as likely as the most likely one (so the cut adapts:
    strict when the model is sure, loose when it is not)."""

    needs_history = False
    same_on_any_thread = True

    def __init__(self, min_p: float):
        self.min_p = SETTINGS["min_p"].require(min_p)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        probs = logits.softmax(dim=-1)  # (B, V)
        floor = self.min_p * probs.amax(dim=-1, keepdim=True)  # (B, 1); the best token always passes
        return logits.masked_fill(probs < floor, float("-inf"))


class TypicalP:
    """Locally typical sampling: rank tokens by how far their surprise (-log p) is from the
    distribution's entropy, and keep the closest ones until their probability adds up to `typical_p`."""

    needs_history = False
    same_on_any_thread = False  # the entropy's sum over the row splits across torch's threads

    def __init__(self, typical_p: float):
        self.typical_p = SETTINGS["typical_p"].require(typical_p)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        log_probs = logits.log_softmax(dim=-1)  # (B, V)
        entropy = -(log_probs.exp() * log_probs).nansum(dim=-1, keepdim=True)  # (B, 1); -inf * 0 is nan
        distance = (-log_probs - entropy).abs()
        sorted_distance, order = torch.sort(distance, dim=-1)  # most typical first
        cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)  # (B, V)
        # The cut is the first token at which the mass reaches typical_p; tokens exactly as typical as
        # it stay too, so tied tokens are kept or dropped together.
        cut = (cumulative < self.typical_p).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)  # (B, 1)
        return logits.masked_fill(distance > sorted_distance.gather(-1, cut), float("-inf"))


# ----------------------------------------------------------------------------- processors (greedy too)


class RepetitionPenalty:
    """Discourage tokens already in the text: positive logits are divided by the penalty, negative ones
    multiplied (penalty > 1 discourages, < 1 encourages)."""

    same_on_any_thread = True

    def __init__(self, penalty: float):
        self.penalty = SETTINGS["repetition_penalty"].require(penalty)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        seen = torch.gather(logits, 1, input_ids)
        seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return logits.scatter(1, input_ids, seen)


def _generated_counts(input_ids: torch.Tensor, prompt_length: int, vocab_size: int) -> torch.Tensor:
    """How often each token occurs after the prompt: [B, S] -> [B, V] float."""
    generated = input_ids[:, prompt_length:]
    counts = torch.zeros(input_ids.shape[0], vocab_size, device=input_ids.device)
    return counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=counts.dtype))


class _OccurrencePenalty:
    """OpenAI's penalties on tokens the model has already generated (the prompt does not count):
    subtract `penalty` times `_amount(counts)`. Columns before `prompt_length` are the prompt."""

    setting: ClassVar[str]
    same_on_any_thread = True

    def __init__(self, penalty: float, prompt_length: int = 0):
        self.penalty = SETTINGS[self.setting].require(penalty)
        self.prompt_length = prompt_length

    @staticmethod
    def _amount(counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        counts = _generated_counts(input_ids, self.prompt_length, logits.shape[-1])  # (B, V)
        return logits - self.penalty * self._amount(counts).to(logits.dtype)


class PresencePenalty(_OccurrencePenalty):
    """Subtract `penalty` once from every token already generated (presence_penalty)."""

    setting = "presence_penalty"

    @staticmethod
    def _amount(counts: torch.Tensor) -> torch.Tensor:
        return counts > 0


class FrequencyPenalty(_OccurrencePenalty):
    """Subtract `penalty` for each time a token has been generated (frequency_penalty)."""

    setting = "frequency_penalty"

    @staticmethod
    def _amount(counts: torch.Tensor) -> torch.Tensor:
        return counts


class NoRepeatNGram:
    """Never complete an n-gram that already occurs in the text (prompt included).

    `pad_counts` (one per row) says how many leading columns of each row are left padding, so that a
    row in a padded batch blocks exactly the n-grams it blocks alone.
    """

    same_on_any_thread = True

    def __init__(self, ngram_size: int, pad_counts: Sequence[int] | torch.Tensor | None = None):
        self.ngram_size = SETTINGS["no_repeat_ngram_size"].require(ngram_size)
        self.pad_counts = None if pad_counts is None else torch.as_tensor(pad_counts, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        n = self.ngram_size
        length = input_ids.shape[1]
        if length < n:
            return logits  # not one whole n-gram yet (and none would end at the next token)
        windows = input_ids.unfold(1, n, 1)  # (B, length - n + 1, n)
        if n == 1:
            ends_like_text = torch.ones(windows.shape[:2], dtype=torch.bool, device=input_ids.device)
        else:
            last = input_ids[:, length - n + 1:]  # (B, n - 1): what the next token would extend
            ends_like_text = (windows[..., :-1] == last[:, None, :]).all(dim=-1)  # (B, W)
        if self.pad_counts is not None:
            starts = torch.arange(windows.shape[1], device=input_ids.device)
            ends_like_text &= starts[None, :] >= self.pad_counts.to(input_ids.device)[:, None]
        rows, which = ends_like_text.nonzero(as_tuple=True)
        banned = torch.zeros_like(logits, dtype=torch.bool)
        banned[rows, windows[rows, which, -1]] = True
        return logits.masked_fill(banned, float("-inf"))


class MinNewTokens:
    """Forbid the end-of-sequence tokens until `min_new_tokens` tokens have been generated after the
    first `prompt_length` columns."""

    same_on_any_thread = True

    def __init__(self, prompt_length: int, min_new_tokens: int, eos_token_ids: Iterable[int]):
        self.prompt_length = prompt_length
        self.min_new_tokens = SETTINGS["min_new_tokens"].require(min_new_tokens)
        self.eos_token_ids = sorted({int(i) for i in eos_token_ids})

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] - self.prompt_length >= self.min_new_tokens or not self.eos_token_ids:
            return logits
        eos = torch.tensor(self.eos_token_ids, device=logits.device)
        return logits.index_fill(1, eos, float("-inf"))


class LogitBias:
    """Add a fixed bias to chosen tokens' logits ({token id: bias}); -100 all but bans a token."""

    needs_history = False
    same_on_any_thread = True

    def __init__(self, bias: Mapping[int, float]):
        self.bias = check_logit_bias_ids(bias)
        self._vector: torch.Tensor | None = None  # (V,), built at the first call, when V is known

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self._vector is None or self._vector.shape[0] != logits.shape[-1]:
            check_logit_bias_ids(self.bias, logits.shape[-1])
            vector = torch.zeros(logits.shape[-1], dtype=logits.dtype)
            vector[list(self.bias)] = torch.tensor(list(self.bias.values()), dtype=logits.dtype)
            self._vector = vector
        return logits + self._vector.to(device=logits.device, dtype=logits.dtype)


# ----------------------------------------------------------------------------- a model's own rules
# generation_config.json's rules (lmcli.model_defaults: ModelDefaults.rules), as transformers' processors
# of the same names apply them. `input_ids` is the whole text so far (an encoder-decoder's: its decoder's).


class ForcedBOS:
    """forced_bos_token_id: the first token after a one-token text (a decoder's start) is this one
    (ForcedBOSTokenLogitsProcessor)."""

    same_on_any_thread = True

    def __init__(self, token_id: int):
        self.token_id = token_id

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != 1:
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[:, self.token_id] = 0
        return forced


class ForcedEOS:
    """forced_eos_token_id: the token at `max_length` (the text's last column) is one of these
    (ForcedEOSTokenLogitsProcessor)."""

    same_on_any_thread = True

    def __init__(self, max_length: int, token_ids: Iterable[int]):
        self.max_length = max_length
        self.token_ids = sorted({int(i) for i in token_ids})

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.max_length - 1:
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[:, self.token_ids] = 0
        return forced


class BadWords:
    """bad_words_ids: token sequences never generated: a one-token entry is never chosen, a longer one's
    last token is banned where the text ends with the rest. An entry that is just an EOS token is dropped
    (NoBadWordsLogitsProcessor)."""

    same_on_any_thread = True

    def __init__(self, sequences: Iterable[Sequence[int]], eos_token_ids: Iterable[int] = ()):
        eos = {int(i) for i in eos_token_ids}
        kept = [tuple(int(t) for t in s) for s in sequences if not (len(s) == 1 and int(s[0]) in eos)]
        self.single = sorted({s[0] for s in kept if len(s) == 1})
        self.longer = [s for s in kept if len(s) > 1]

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        banned = torch.zeros_like(logits, dtype=torch.bool)  # (B, V)
        banned[:, self.single] = True
        for sequence in self.longer:
            prefix = torch.tensor(sequence[:-1], device=input_ids.device)
            if prefix.numel() > input_ids.shape[1]:
                continue
            rows = (input_ids[:, input_ids.shape[1] - prefix.numel():] == prefix).all(dim=-1)  # (B,)
            banned[:, sequence[-1]] |= rows
        return logits.masked_fill(banned, float("-inf"))


class SuppressTokens:
    """suppress_tokens, and begin_suppress_tokens at `begin_index` only (the text's width when the first
    new token is chosen): never these tokens (SuppressTokens[AtBegin]LogitsProcessor)."""

    same_on_any_thread = True

    def __init__(self, token_ids: Iterable[int], begin_index: int | None = None):
        self.token_ids = sorted({int(i) for i in token_ids})
        self.begin_index = begin_index

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.begin_index is not None and input_ids.shape[-1] != self.begin_index:
            return logits
        return logits.index_fill(1, torch.tensor(self.token_ids, dtype=torch.long, device=logits.device),
                                 float("-inf"))


def rule_processors(rules: Mapping[str, Any], prompt_length: int, max_length: int,
                    eos_token_ids: Iterable[int]) -> list[LogitsProcessor]:
    """A model's rules (ModelDefaults.rules) as processors, in transformers' order; `prompt_length` is the
    text's width before the first new token (an encoder-decoder's: 1), `max_length` its width after the last."""
    out: list[LogitsProcessor] = []
    if rules.get("bad_words_ids"):
        out.append(BadWords(rules["bad_words_ids"], eos_token_ids))
    if rules.get("forced_bos_token_id") is not None:
        out.append(ForcedBOS(rules["forced_bos_token_id"]))
    if rules.get("forced_eos_token_id") is not None:
        forced = rules["forced_eos_token_id"]
        out.append(ForcedEOS(max_length, forced if isinstance(forced, (list, tuple)) else [forced]))
    if rules.get("suppress_tokens"):
        out.append(SuppressTokens(rules["suppress_tokens"]))
    if rules.get("begin_suppress_tokens"):
        begin = prompt_length if prompt_length > 1 or rules.get("forced_bos_token_id") is None else prompt_length + 1
        out.append(SuppressTokens(rules["begin_suppress_tokens"], begin))
    return out


# ----------------------------------------------------------------------------- the chain and the sampler


class ProcessorChain:
    """Processors applied in order. `needs_history`: some processor reads the text (input_ids), so the
    loop must keep all of it; a plain callable is assumed to. `same_on_any_thread`: every processor
    gives the same numbers whatever torch's thread count and keeps no state shared with another row's
    chain, so a row's chain may run on a worker thread (row_choice.py); a plain callable is assumed not."""

    def __init__(self, processors: Iterable[LogitsProcessor]):
        self.processors = list(processors)
        self.needs_history = any(getattr(p, "needs_history", True) for p in self.processors)
        self.same_on_any_thread = all(getattr(p, "same_on_any_thread", False) for p in self.processors)
        # Processors that want each step's chosen tokens before the next forward pass (a constraint's
        # masks are built meanwhile); see ConstraintMask.chosen.
        hooks = (getattr(p, "chosen", None) for p in self.processors)
        self._told: list[Callable[[torch.Tensor], None]] = [hook for hook in hooks if callable(hook)]

    def chosen(self, tokens: torch.Tensor) -> None:
        """The tokens [B] just chosen, before the model runs on them."""
        for tell in self._told:
            tell(tokens)

    def end_row(self, row: int) -> str | None:
        """Batch row `row` has ended: see `end_row`."""
        return end_row(self.processors, row)

    def __bool__(self) -> bool:
        return bool(self.processors)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """input_ids: the text [B, S] (empty, [B, 0], when no processor needs it)."""
        for processor in self.processors:
            logits = processor(input_ids, logits)
        return logits


def end_row(processors: Iterable[LogitsProcessor], row: int) -> str | None:
    """Batch row `row` has ended (EOS, a stop string, its token limit): every processor that keeps
    per-row state drops the row's; returns the first error one recorded for it (e.g. a constraint's
    engine gave up on the row's text), or None."""
    errors = [end(row) for end in (getattr(p, "end_row", None) for p in processors) if callable(end)]
    return next((error for error in errors if error is not None), None)


@dataclass(frozen=True)
class RowConstraints:
    """Each batch row's structured-output constraint (lmcli.generation.constraints.Constraint, None for a
    free row) and what their masks are built from; `processor()` is the chain's first step, or None
    when no row is constrained."""

    tokenizer: Any
    constraints: Sequence[Any]
    vocab_size: int

    def processor(self) -> LogitsProcessor | None:
        if all(constraint is None for constraint in self.constraints):
            return None
        from lmcli.generation.constraints import ConstraintMask

        return ConstraintMask(self.tokenizer, list(self.constraints), self.vocab_size)


def sampling_transforms(temperature: float, top_k: int | None, top_p: float | None) -> list[LogitsProcessor]:
    """generate()'s built-in sampling steps, checked by generate()'s rules (temperature > 0, not top-k
    with top-p), then built by the one factory, SamplingSettings.policy."""
    check_truncation(top_k, top_p)
    check_temperature(temperature)
    return SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p).policy()[1]


def make_processor_chain(do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
                         logits_processors: Iterable[LogitsProcessor] | None) -> ProcessorChain:
    """generate()'s chain: its own sampling steps (only when sampling), then the caller's processors."""
    builtin = sampling_transforms(temperature, top_k, top_p) if do_sample else []
    return ProcessorChain([*builtin, *(logits_processors or [])])


def make_sampler(do_sample: bool, seed: Any, batch_size: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """scores [B, V] -> next token [B]: the argmax, or a draw from each row's own stream."""
    if not do_sample:
        return lambda scores: scores.argmax(dim=-1)
    generators = row_generators(seed, batch_size, device)
    return lambda scores: sample(scores, generators)


@dataclass(frozen=True)
class _Step:
    """One setting's place in the chain: the processor it adds when it is on."""

    setting: str
    make: Callable[[Any, _Context], LogitsProcessor]  # (the setting's value, the call's context)


@dataclass(frozen=True)
class _Context:
    prompt_length: int
    pad_counts: Sequence[int] | None
    eos_token_ids: Iterable[int]
    vocab_size: int | None


# transformers' order: the processors, which act greedy or not, on the raw logits...
_PROCESSORS = (
    _Step("logit_bias", lambda bias, c: LogitBias(check_logit_bias_ids(bias, c.vocab_size))),
    _Step("repetition_penalty", lambda penalty, c: RepetitionPenalty(penalty)),
    _Step("presence_penalty", lambda penalty, c: PresencePenalty(penalty, c.prompt_length)),
    _Step("frequency_penalty", lambda penalty, c: FrequencyPenalty(penalty, c.prompt_length)),
    _Step("no_repeat_ngram_size", lambda n, c: NoRepeatNGram(n, c.pad_counts)),
    _Step("min_new_tokens", lambda n, c: MinNewTokens(c.prompt_length, n, c.eos_token_ids)),
)
# ...then, when sampling, the warpers: temperature first, then truncation.
_WARPERS = (
    _Step("temperature", lambda t, c: Temperature(t)),
    _Step("top_k", lambda k, c: TopK(k)),
    _Step("top_p", lambda p, c: TopP(p)),
    _Step("min_p", lambda p, c: MinP(p)),
    _Step("typical_p", lambda p, c: TypicalP(p)),
)


@dataclass(frozen=True)
class SamplingSettings(DecodingFields):
    """The decoding settings in their convention (temperature 0 means greedy; None means off), with the
    logit bias by token id. `check()` applies lmcli.settings.table's rules; `policy()` is the one factory of
    processor chains, for settings and for generate()'s own arguments alike. (max_new_tokens is
    generate()'s own argument: neither uses it.)"""

    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None

    @classmethod
    def of(cls, fields: DecodingFields, logit_bias: Mapping[int, float], seed: int | None = None) -> SamplingSettings:
        """The decoding fields of `fields` (e.g. a GenerationSettings), with the bias by token id."""
        values = {f.name: getattr(fields, f.name) for f in dataclasses.fields(DecodingFields)}
        return cls(**values, logit_bias=logit_bias, seed=seed)

    def check(self) -> None:
        """Raise SamplingError for the first setting that breaks its rule. (Top-k with top-p is allowed
        here, applied in that order as transformers does; generate()'s own arguments refuse the pair.)"""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(DecodingFields)}
        check_settings({**values, "seed": self.seed})
        check_logit_bias_ids(self.logit_bias)

    def policy(self, *, prompt_length: int = 0, pad_counts: Sequence[int] | None = None,
               eos_token_ids: Iterable[int] = (), vocab_size: int | None = None,
               constraints: RowConstraints | None = None, rules: Mapping[str, Any] | None = None,
               max_length: int | None = None) -> tuple[bool, list[LogitsProcessor]]:
        """(do_sample, logits_processors) for generate(): each row's constraint first (`constraints`),
        then in transformers' order the processors, then, when sampling, the warpers; a setting at its
        off value adds none. generate()'s own temperature/top_k/top_p are then left at their neutral
        defaults, so the whole order is this list's.

        `prompt_length` is the (padded) prompt width, `pad_counts` each row's left padding; `rules` the
        model's own (ModelDefaults.rules), with `max_length` the text's width after the last new token."""
        self.check()
        context = _Context(prompt_length, pad_counts, eos_token_ids, vocab_size)
        steps = _PROCESSORS if self.greedy else (*_PROCESSORS, *_WARPERS)
        constraint = constraints.processor() if constraints is not None else None
        made = [step.make(getattr(self, step.setting), context) for step in steps
                if not SETTINGS[step.setting].is_off(getattr(self, step.setting))]
        # The model's rules (generation_config.json) after the processors, before the warpers.
        own = rule_processors(rules, prompt_length, max_length or prompt_length, eos_token_ids) if rules else []
        processors = len([step for step in _PROCESSORS if not SETTINGS[step.setting].is_off(getattr(self, step.setting))])
        return not self.greedy, [*([constraint] if constraint is not None else []),
                                 *made[:processors], *own, *made[processors:]]


# ----------------------------------------------------------------------------- per-row random streams


def row_generators(seed: Any, batch_size: int, device: torch.device) -> list[torch.Generator]:
    """One RNG per row, so a row's samples do not depend on the rest of the batch.

    `seed`: an int (every row gets it), one value per row (list or tensor), or None (drawn from torch's
    global generator, so torch.manual_seed still makes the call reproducible).
    """
    if isinstance(seed, torch.Tensor):
        seed = seed.tolist()  # a 0-d tensor becomes one int
    if seed is None:
        seeds = torch.randint(0, 2**62, (batch_size,)).tolist()
    elif is_int(seed):
        seeds = [int(seed)] * batch_size
    else:
        try:
            seeds = list(seed)
        except TypeError:
            seeds = [seed]
        if not all(is_int(s) for s in seeds):
            raise ValueError(f"seed must be an int or one int per row, got {seed!r}")
        seeds = [int(s) for s in seeds]
        if len(seeds) != batch_size:
            raise ValueError(f"seed has {len(seeds)} values but the batch has {batch_size} rows")
    generators = []
    for value in seeds:
        generator = torch.Generator(device=device)
        generator.manual_seed(SETTINGS["seed"].require(value))
        generators.append(generator)
    return generators


def sample(logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Draw one token per row from softmax(logits) [B, V] -> [B], one uniform number per row and step.

    Inverse-CDF sampling consumes exactly one draw per step, so a row's stream advances the same way
    alone or in a batch, and zero-probability tokens can never be chosen.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # (B, V)
    cdf = probs.cumsum(dim=-1)
    uniform = torch.stack([torch.rand((), generator=g, device=logits.device) for g in generators])  # (B,)
    threshold = (uniform * cdf[:, -1])[:, None]  # (B, 1)
    chosen = torch.searchsorted(cdf, threshold, right=True)  # (B, 1): first token whose cdf exceeds it
    # Rounding can put the threshold at the very top: fall back to the last token with probability > 0.
    last_possible = torch.searchsorted(cdf, cdf[:, -1:].contiguous())
    return torch.minimum(chosen, last_possible).squeeze(-1)
