"""Token choice: the sampling rules, one small class per logits transform, the chain built once from
settings, and per-row RNGs.

Every transform has the uniform call `(input_ids [B, S], logits [B, V]) -> logits [B, V]` and checks
its argument once, in __init__, with a message that says what to pass instead. The rules for each
setting live here alone (`SamplingSettings.check`); the CLI and job rows name the setting in their
own words from `SamplingError.setting`.

Two conventions meet here and are translated in one place, `SamplingSettings.policy`: settings say
greedy with `temperature == 0` (as the CLI and job rows do), `generate()` says it with `do_sample`.

The order is transformers': logit bias, repetition penalty, (presence and frequency penalties, which
transformers lacks), n-gram blocking, minimum new tokens; then, when sampling, temperature, top-k,
top-p, min-p and typical-p. A penalty therefore acts on the raw logits, before truncation.

One concern, choosing the next token, which is why it is longer than most modules.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lmcli.config import is_number as _is_number
from lmcli.generation.decoding_fields import WARPERS, DecodingFields

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0..2**64-1 (a negative seed aliases one of those)
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties, as OpenAI's API bounds them
MAX_ABS_LOGIT_BIAS = 100.0  # as OpenAI's API bounds logit_bias


_NO_VALUE = object()


class SamplingError(ValueError):
    """A sampling setting that breaks its rule. `setting` (and `other`, for a pair that clashes) are
    generate()'s names, so callers can name them their own way (`--top-p`, `"top_p"`) with
    `message_for`."""

    def __init__(self, setting: str, requirement: str, value: Any = _NO_VALUE, other: str | None = None):
        self.setting = setting
        self.other = other
        self.requirement = requirement
        self.value = value
        super().__init__(self.message_for(str))

    def message_for(self, name: Callable[[str], str]) -> str:
        subject = name(self.setting) if self.other is None else f"{name(self.setting)} and {name(self.other)}"
        if self.value is _NO_VALUE:
            return f"{subject} {self.requirement}"
        value = f"{self.value:g}" if isinstance(self.value, float) else repr(self.value)
        return f"{subject} {self.requirement}, got {value}"


# ----------------------------------------------------------------------------- the rules, each once


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require_int(setting: str, value: Any, lowest: int) -> int:
    if not _is_int(value):
        raise SamplingError(setting, "must be an integer", value)
    if value < lowest:
        raise SamplingError(setting, f"must be at least {lowest}", value)
    return int(value)


def _require_number(setting: str, value: Any, ok: Callable[[float], bool], requirement: str) -> float:
    if not _is_number(value):
        raise SamplingError(setting, "must be a number", value)
    if not math.isfinite(value):
        raise SamplingError(setting, "must be a finite number", value)
    if not ok(float(value)):
        raise SamplingError(setting, requirement, value)
    return float(value)


# Below this, logits / temperature can overflow float32 (1e-30 keeps logits up to 3.4e8 finite) and the
# draw would index past the vocabulary; such a temperature samples as greedy decoding does anyway.
MIN_TEMPERATURE = 1e-30


def check_temperature(value: Any) -> float:
    """Sampling temperature as generate() takes it (greedy is do_sample=False)."""
    return _require_number("temperature", value, lambda v: v >= MIN_TEMPERATURE,
                           f"must be at least {MIN_TEMPERATURE:g} (use do_sample=False for greedy)")


def check_top_k(value: Any) -> int:
    return _require_int("top_k", value, 1)


def check_top_p(value: Any) -> float:
    return _require_number("top_p", value, lambda v: 0 < v <= 1, "must be in (0, 1]")


def check_min_p(value: Any) -> float:
    return _require_number("min_p", value, lambda v: 0 <= v <= 1, "must be in [0, 1] (0 means none)")


def check_typical_p(value: Any) -> float:
    return _require_number("typical_p", value, lambda v: 0 < v <= 1, "must be in (0, 1] (1 means none)")


def check_repetition_penalty(value: Any) -> float:
    return _require_number("repetition_penalty", value, lambda v: v > 0, "must be > 0 (1 means none)")


def _check_occurrence_penalty(setting: str, value: Any) -> float:
    bound = MAX_ABS_PENALTY
    return _require_number(setting, value, lambda v: -bound <= v <= bound, f"must be between -{bound:g} and {bound:g}")


def check_no_repeat_ngram_size(value: Any) -> int:
    return _require_int("no_repeat_ngram_size", value, 1)


def check_min_new_tokens(value: Any) -> int:
    return _require_int("min_new_tokens", value, 0)


def check_seed(value: Any) -> int:
    if not _is_int(value):
        raise SamplingError("seed", "must be an integer", value)
    if not 0 <= value <= MAX_SEED:
        raise SamplingError("seed", "must be between 0 and 2**64-1", value)
    return int(value)


def check_logit_bias(bias: Any, vocab_size: int | None = None) -> dict[int, float]:
    """{token id: bias}; each bias in [-100, 100] is added to that token's logit."""
    if not isinstance(bias, Mapping):
        raise SamplingError("logit_bias", "must map token ids to biases", bias)
    limit = MAX_ABS_LOGIT_BIAS
    checked = {}
    for token, value in bias.items():
        if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f" (the vocabulary has {vocab_size} tokens)" if vocab_size is not None else ""
            raise SamplingError("logit_bias", f"must name token ids >= 0{where}", token)
        checked[int(token)] = _require_number(
            "logit_bias", value, lambda v: -limit <= v <= limit, f"biases must be between -{limit:g} and {limit:g}"
        )
    return checked


def check_truncation(top_k: Any, top_p: Any) -> None:
    if top_k is not None and top_p is not None:
        raise SamplingError("top_k", "cannot be used together; pick one", other="top_p")


# ----------------------------------------------------------------------------- warpers (sampling only)


class Temperature:
    needs_history = False

    def __init__(self, temperature: float):
        self.temperature = check_temperature(temperature)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.temperature


class TopK:
    """Keep the k most likely tokens."""

    needs_history = False

    def __init__(self, top_k: int):
        self.top_k = check_top_k(top_k)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, logits.shape[-1])
        kth_best = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
        return logits.masked_fill(logits < kth_best, float("-inf"))


class TopP:
    """Nucleus: the smallest set of most likely tokens whose total probability is >= p."""

    needs_history = False

    def __init__(self, top_p: float):
        self.top_p = check_top_p(top_p)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the least likely tokens while what they add up to stays within 1 - p; keep the best one.
        drop_sorted = cumulative <= 1 - self.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        return logits.masked_fill(drop, float("-inf"))


class MinP:
    """Keep the tokens at least `min_p` times as likely as the most likely one (so the cut adapts:
    strict when the model is sure, loose when it is not)."""

    needs_history = False

    def __init__(self, min_p: float):
        self.min_p = check_min_p(min_p)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        probs = logits.softmax(dim=-1)  # (B, V)
        floor = self.min_p * probs.amax(dim=-1, keepdim=True)  # (B, 1); the best token always passes
        return logits.masked_fill(probs < floor, float("-inf"))


class TypicalP:
    """Locally typical sampling: rank tokens by how far their surprise (-log p) is from the
    distribution's entropy, and keep the closest ones until their probability adds up to `typical_p`."""

    needs_history = False

    def __init__(self, typical_p: float):
        self.typical_p = check_typical_p(typical_p)

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

    def __init__(self, penalty: float):
        self.penalty = check_repetition_penalty(penalty)

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

    def __init__(self, penalty: float, prompt_length: int = 0):
        self.penalty = _check_occurrence_penalty(self.setting, penalty)
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

    def __init__(self, ngram_size: int, pad_counts: Sequence[int] | torch.Tensor | None = None):
        self.ngram_size = check_no_repeat_ngram_size(ngram_size)
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

    def __init__(self, prompt_length: int, min_new_tokens: int, eos_token_ids: Iterable[int]):
        self.prompt_length = prompt_length
        self.min_new_tokens = check_min_new_tokens(min_new_tokens)
        self.eos_token_ids = sorted({int(i) for i in eos_token_ids})

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] - self.prompt_length >= self.min_new_tokens or not self.eos_token_ids:
            return logits
        eos = torch.tensor(self.eos_token_ids, device=logits.device)
        return logits.index_fill(1, eos, float("-inf"))


class LogitBias:
    """Add a fixed bias to chosen tokens' logits ({token id: bias}); -100 all but bans a token."""

    needs_history = False

    def __init__(self, bias: Mapping[int, float]):
        self.bias = check_logit_bias(bias)
        self._vector: torch.Tensor | None = None  # (V,), built at the first call, when V is known

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self._vector is None or self._vector.shape[0] != logits.shape[-1]:
            check_logit_bias(self.bias, logits.shape[-1])
            vector = torch.zeros(logits.shape[-1], dtype=logits.dtype)
            vector[list(self.bias)] = torch.tensor(list(self.bias.values()), dtype=logits.dtype)
            self._vector = vector
        return logits + self._vector.to(device=logits.device, dtype=logits.dtype)


# ----------------------------------------------------------------------------- the chain and the sampler


class ProcessorChain:
    """Processors applied in order. `needs_history`: some processor reads the text (input_ids), so the
    loop must keep all of it; a plain callable is assumed to."""

    def __init__(self, processors: Iterable[LogitsProcessor]):
        self.processors = list(processors)
        self.needs_history = any(getattr(p, "needs_history", True) for p in self.processors)

    def __bool__(self) -> bool:
        return bool(self.processors)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """input_ids: the text [B, S] (empty, [B, 0], when no processor needs it)."""
        for processor in self.processors:
            logits = processor(input_ids, logits)
        return logits


def sampling_transforms(temperature: float, top_k: int | None, top_p: float | None) -> list[LogitsProcessor]:
    """generate()'s built-in sampling steps in their fixed order, validated."""
    check_truncation(top_k, top_p)
    transforms: list[LogitsProcessor] = [Temperature(temperature)]
    if top_k is not None:
        transforms.append(TopK(top_k))
    if top_p is not None:
        transforms.append(TopP(top_p))
    return transforms


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
class SamplingSettings(DecodingFields):
    """The decoding settings in their convention (temperature 0 means greedy; None means off), with the
    logit bias by token id. `check()` holds every sampling rule; `policy()` turns them into generate()'s
    arguments. (max_new_tokens is generate()'s own argument: neither uses it.)"""

    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None

    def check(self) -> None:
        """Raise SamplingError for the first setting that breaks its rule. (Top-k with top-p is allowed
        here, applied in that order as transformers does; generate()'s own arguments refuse the pair.)"""
        if not self.greedy:
            _require_number("temperature", self.temperature, lambda v: v == 0 or v >= MIN_TEMPERATURE,
                            "must be >= 0 (0 means greedy)" if _is_number(self.temperature) and self.temperature < 0 else
                            f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        else:
            for name in WARPERS:
                if getattr(self, name) is not None:
                    raise SamplingError(name, "only applies to sampling, not greedy decoding")
        for name, check in (("top_k", check_top_k), ("top_p", check_top_p), ("min_p", check_min_p),
                            ("typical_p", check_typical_p), ("repetition_penalty", check_repetition_penalty),
                            ("no_repeat_ngram_size", check_no_repeat_ngram_size),
                            ("min_new_tokens", check_min_new_tokens), ("seed", check_seed)):
            if getattr(self, name) is not None:
                check(getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None:
                _check_occurrence_penalty(name, getattr(self, name))
        check_logit_bias(self.logit_bias)

    def policy(self, *, prompt_length: int = 0, pad_counts: Sequence[int] | None = None,
               eos_token_ids: Iterable[int] = (), vocab_size: int | None = None) -> tuple[bool, list[LogitsProcessor]]:
        """(do_sample, logits_processors) for generate(), in transformers' order: the processors, then,
        when sampling, the warpers. generate()'s own temperature/top_k/top_p are left at their
        neutral defaults (temperature 1.0 divides by one, exactly), so the whole order is this list's.

        `prompt_length` is the (padded) prompt width, `pad_counts` each row's left padding."""
        self.check()
        processors: list[LogitsProcessor] = []
        if self.logit_bias:
            processors.append(LogitBias(check_logit_bias(self.logit_bias, vocab_size)))
        if self.repetition_penalty not in (None, 1.0):
            processors.append(RepetitionPenalty(self.repetition_penalty))
        if self.presence_penalty:
            processors.append(PresencePenalty(self.presence_penalty, prompt_length))
        if self.frequency_penalty:
            processors.append(FrequencyPenalty(self.frequency_penalty, prompt_length))
        if self.no_repeat_ngram_size is not None:
            processors.append(NoRepeatNGram(self.no_repeat_ngram_size, pad_counts))
        if self.min_new_tokens:
            processors.append(MinNewTokens(prompt_length, self.min_new_tokens, eos_token_ids))
        if self.greedy:
            return False, processors
        if self.temperature != 1.0:
            processors.append(Temperature(self.temperature))
        if self.top_k is not None:
            processors.append(TopK(self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            processors.append(TopP(self.top_p))
        if self.min_p:
            processors.append(MinP(self.min_p))
        if self.typical_p is not None and self.typical_p < 1.0:
            processors.append(TypicalP(self.typical_p))
        return True, processors


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
    elif _is_int(seed):
        seeds = [int(seed)] * batch_size
    else:
        try:
            seeds = list(seed)
        except TypeError:
            seeds = [seed]
        if not all(_is_int(s) for s in seeds):
            raise ValueError(f"seed must be an int or one int per row, got {seed!r}")
        seeds = [int(s) for s in seeds]
        if len(seeds) != batch_size:
            raise ValueError(f"seed has {len(seeds)} values but the batch has {batch_size} rows")
    generators = []
    for value in seeds:
        generator = torch.Generator(device=device)
        generator.manual_seed(check_seed(value))
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
