"""The decoding settings, each declared once: its type, its range, the value at which it does nothing
("off"), and every name it goes by (command-line flag, job row key, generation_config.json key, GGUF
`general.sampling.*` key, OpenAI body field). Torch-free and below everything that uses it:
lmcli.settings.generation_settings layers flags, rows, transcripts and the model's defaults with it; lmcli.generation.sampling
builds the processor chain from the same entries. A new setting is one entry in `SETTINGS` (and, if it
decides tokens, one field of `DecodingFields` and one processor in the chain).

Every rule raises `SamplingError`, which keeps the setting's own name so each edge can say it the
way its user wrote it (`--top-p`, `"top_p"`, `body field "top_p"`, `generation_config.json: top_p`).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lmcli.config import is_number as is_number  # the one definition; re-exported for the settings layer

DEFAULT_MAX_NEW_TOKENS = 128
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0..2**64-1 (a negative seed aliases one of those)
MAX_DRAFT_TOKENS = 64  # a bound on num_draft_tokens: a longer guess is rarely taken whole, and costs its pass

_NO_VALUE = object()


class SamplingError(ValueError):
    """A setting that breaks its rule. `setting` (and `other`, for a pair that clashes) are the
    settings' own names, so callers can name them their own way with `message_for`. `shown` is the
    value as its source wrote it (JSON for rows and transcripts), when that says it better."""

    def __init__(self, setting: str, requirement: str, value: Any = _NO_VALUE, other: str | None = None,
                 shown: str | None = None):
        self.setting = setting
        self.other = other
        self.requirement = requirement
        self.value = value
        self.shown = shown
        super().__init__(self.message_for(str))

    def message_for(self, name: Callable[[str], str]) -> str:
        subject = name(self.setting) if self.other is None else f"{name(self.setting)} and {name(self.other)}"
        if self.shown is not None:
            return f"{subject} {self.requirement}, got {self.shown}"
        if self.value is _NO_VALUE:
            return f"{subject} {self.requirement}"
        value = f"{self.value:g}" if isinstance(self.value, float) else repr(self.value)
        return f"{subject} {self.requirement}, got {value}"


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_number(setting: str, value: Any, ok: Callable[[float], bool], requirement: str) -> float:
    """A finite number that passes `ok`, as a float."""
    if not is_number(value):
        raise SamplingError(setting, "must be a number", value)
    if not math.isfinite(value):
        raise SamplingError(setting, "must be a finite number", value)
    if not ok(float(value)):
        raise SamplingError(setting, requirement, value)
    return float(value)


# Kinds of value.
INTEGER, NUMBER, SWITCH, TEXT, TEXTS, BIAS = "integer", "number", "switch", "text", "texts", "bias"
EARLY = "early"  # early_stopping: true, false or "never", as transformers' beam search takes it
CONSTRAINT = "constraint"  # lmcli.generation.constraints.Constraint, parsed (and checked) where it is given


@dataclass(frozen=True)
class Setting:
    """One setting: how it is checked and what it is called where."""

    name: str  # lmcli's name: the dataclass field, the job row key, generate()'s argument
    kind: str
    low: float | None = None  # the range (a bias's, for logit_bias)
    high: float | None = None
    open_low: bool = False  # the bound itself is outside the range
    open_high: bool = False
    off: Any = None  # the value at which it does nothing, as files and APIs may write it (lmcli writes None)
    note: str = ""  # said after the range
    said: str = ""  # the requirement in words, where the range alone would not say it well
    optional: bool = True  # None: not set (off)
    sampling_only: bool = False  # no effect when decoding greedily (temperature 0)
    flag: str | None = None
    row: bool = False  # a job row may set it (under `name`)
    hf: str | None = None  # a generation_config.json key that is the model's default for it
    gguf: str | None = None  # a GGUF metadata key that is the model's default for it
    openai: tuple[str, ...] = ()  # OpenAI request body fields that set it

    @property
    def requirement(self) -> str:
        if self.said:
            return f"must be {self.said}"
        if self.high is None:
            if self.kind == INTEGER:
                words = f"at least {self.low:g}"
            else:
                words = f"> {self.low:g}" if self.open_low else f">= {self.low:g}"
        elif not (self.open_low or self.open_high or self.note):
            words = f"between {self.low:g} and {self.high:g}"
        else:
            words = f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"
        return f"must be {words}" + (f" {self.note}" if self.note else "")

    def in_range(self, value: float) -> bool:
        above = self.low is None or value > self.low or (value == self.low and not self.open_low)
        below = self.high is None or value < self.high or (value == self.high and not self.open_high)
        return above and below

    def check(self, value: Any) -> Any:
        """The value by this setting's rule, normalised (a float for a number, a tuple for a list);
        None passes for an optional setting. Raises SamplingError."""
        if value is None and self.optional:
            return None
        if self.kind == INTEGER:
            if not is_int(value):
                raise SamplingError(self.name, "must be an integer", value)
            if not self.in_range(value):
                raise SamplingError(self.name, self.requirement, value)
            return int(value)
        if self.kind == NUMBER:
            return check_number(self.name, value, self.in_range, self.requirement)
        if self.kind == SWITCH:
            if not isinstance(value, bool):
                raise SamplingError(self.name, "must be true or false", value)
            return value
        if self.kind == TEXT:
            if not isinstance(value, str):
                raise SamplingError(self.name, "must be a string", value)
            return value
        if self.kind == EARLY:
            if not (isinstance(value, bool) or value == "never"):
                raise SamplingError(self.name, 'must be true, false or "never"', value)
            return value
        if self.kind == CONSTRAINT:
            if not (isinstance(value, tuple) and len(value) == 3 and all(isinstance(part, str) for part in value)):
                raise SamplingError(self.name, "must be a Constraint (lmcli.generation.constraints)", value)
            return value
        if self.kind == TEXTS:
            if not isinstance(value, (tuple, list)) or not all(isinstance(s, str) for s in value):
                raise SamplingError(self.name, "must be a string or a list of strings", value)
            if any(s == "" for s in value):
                raise SamplingError(self.name, "must not be an empty string")
            return tuple(value)
        return self._check_bias(value)

    def _check_bias(self, pairs: Any) -> tuple[tuple[str, float], ...]:
        """(token as text or id, bias) pairs; the tokens become ids with the tokenizer, later."""
        if not isinstance(pairs, (tuple, list)) or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
            raise SamplingError(self.name, "must be (token, bias) pairs", pairs)
        checked = []
        for token, bias in pairs:
            if not isinstance(token, str):
                raise SamplingError(self.name, "must name each token as text or an id in a string", token)
            try:
                checked.append((token, check_number(self.name, bias, self.in_range, self.bias_range)))
            except SamplingError as e:
                shown = f"{bias:g}" if is_number(bias) else json.dumps(bias, default=repr)
                raise SamplingError(self.name, e.requirement, shown=f"{token}={shown}") from None
        return tuple(checked)

    @property
    def bias_range(self) -> str:
        return f"biases must be between {self.low:g} and {self.high:g}"

    def require(self, value: Any) -> Any:
        """check(), with None refused: what a processor given this setting takes."""
        if value is None:
            raise SamplingError(self.name, "must be given", value)
        return self.check(value)

    def is_off(self, value: Any) -> bool:
        """Whether `value` leaves the decoding unchanged (not set, or its off value)."""
        return value is None or (self.off is not None and value == self.off) or value in ((), {})

    def off_in_llama_cpp(self, value: Any) -> bool:
        """llama.cpp's reading: its off value, or beyond it, outside the range (top_k <= 0, top_p >= 1)."""
        if self.off is None or not is_number(value):
            return False
        if value == self.off:
            return True
        if self.low is not None and self.off <= self.low:
            return value <= self.off
        if self.high is not None and self.off >= self.high:
            return value >= self.off
        return False

    def from_json(self, value: Any, *, null: bool = False) -> Any:
        """A value as a JSON file (a row, a transcript, a request body) writes it, type-checked, in the
        form check() takes; `null`: JSON null means not set. Raises SamplingError showing the JSON."""
        if value is None and null and self.optional:
            return None
        shown = json.dumps(value, ensure_ascii=False, default=repr)
        if self.kind == INTEGER and not is_int(value):
            raise SamplingError(self.name, "must be an integer", shown=shown)
        if self.kind == NUMBER and not is_number(value):
            raise SamplingError(self.name, "must be a number", shown=shown)
        if self.kind == SWITCH and not isinstance(value, bool):
            raise SamplingError(self.name, "must be true or false", shown=shown)
        if self.kind == TEXT and not isinstance(value, str):
            raise SamplingError(self.name, "must be a string", shown=shown)
        if self.kind == EARLY and not (isinstance(value, bool) or value == "never"):
            raise SamplingError(self.name, 'must be true, false or "never"', shown=shown)
        if self.kind == TEXTS:
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise SamplingError(self.name, "must be a string or a list of strings", shown=shown)
            return tuple(value)
        if self.kind == BIAS:
            if not isinstance(value, dict) or not all(is_number(v) for v in value.values()):
                raise SamplingError(self.name, 'must be an object of token (text or id) to bias, e.g. {"13": -100}',
                                    shown=shown)
            return tuple((str(token), float(bias)) for token, bias in value.items())
        return float(value) if self.kind == NUMBER else value


def _table(*settings: Setting) -> dict[str, Setting]:
    return {setting.name: setting for setting in settings}


SETTINGS = _table(
    Setting("max_new_tokens", INTEGER, low=1, optional=False, flag="--max-new-tokens", row=True,
            hf="max_new_tokens", openai=("max_tokens", "max_completion_tokens")),
    Setting("temperature", NUMBER, low=0, note="(0 means greedy)", optional=False, flag="--temperature", row=True,
            hf="temperature", gguf="general.sampling.temp", openai=("temperature",)),
    Setting("top_k", INTEGER, low=1, off=0, sampling_only=True, flag="--top-k", row=True, hf="top_k",
            gguf="general.sampling.top_k", openai=("top_k",)),  # top_k: a vLLM extension of OpenAI's API
    Setting("top_p", NUMBER, low=0, high=1, open_low=True, off=1.0, sampling_only=True, flag="--top-p", row=True,
            hf="top_p", gguf="general.sampling.top_p", openai=("top_p",)),
    Setting("min_p", NUMBER, low=0, high=1, off=0.0, note="(0 means none)", sampling_only=True, flag="--min-p",
            row=True, hf="min_p", gguf="general.sampling.min_p"),
    Setting("typical_p", NUMBER, low=0, high=1, open_low=True, off=1.0, note="(1 means none)", sampling_only=True,
            flag="--typical-p", row=True, hf="typical_p"),
    Setting("repetition_penalty", NUMBER, low=0, open_low=True, off=1.0, note="(1 means none)",
            flag="--repetition-penalty", row=True, hf="repetition_penalty", gguf="general.sampling.penalty_repeat"),
    # OpenAI's bounds for its two penalties and its logit_bias.
    Setting("presence_penalty", NUMBER, low=-2, high=2, off=0.0, flag="--presence-penalty", row=True),
    Setting("frequency_penalty", NUMBER, low=-2, high=2, off=0.0, flag="--frequency-penalty", row=True),
    Setting("no_repeat_ngram_size", INTEGER, low=1, off=0, flag="--no-repeat-ngram-size", row=True,
            hf="no_repeat_ngram_size"),
    Setting("min_new_tokens", INTEGER, low=0, off=0, flag="--min-new-tokens", row=True),
    # Beam search (generation/beams.py), as transformers': a model's generation_config.json may ask for it.
    Setting("num_beams", INTEGER, low=1, off=1, note="(1 means none)", flag="--num-beams", row=True, hf="num_beams"),
    Setting("length_penalty", NUMBER, off=1.0, said="a number", flag="--length-penalty", row=True,
            hf="length_penalty"),
    Setting("early_stopping", EARLY, off=False, flag="--early-stopping", row=True, hf="early_stopping"),
    Setting("logit_bias", BIAS, low=-100, high=100, optional=False, flag="--logit-bias", row=True),
    Setting("seed", INTEGER, low=0, high=MAX_SEED, said="between 0 and 2**64-1", flag="--seed", row=True,
            openai=("seed",)),
    Setting("stop", TEXTS, optional=False, flag="--stop", row=True, openai=("stop",)),
    Setting("ignore_eos", SWITCH, optional=False, flag="--ignore-eos"),
    Setting("chat", SWITCH, optional=False, flag="--chat"),
    Setting("system", TEXT, flag="--system", row=True),
    Setting("logprobs", INTEGER, low=0, said=">= 0", flag="--logprobs"),
    Setting("truncate", SWITCH, optional=False, flag="--no-truncate"),
    # Structured output: one of --json-schema/--json/--regex/--grammar, or a job row's key of the same
    # name (json_schema, json, regex, grammar), or an OpenAI body's response_format (jobs/openai_batch.py).
    Setting("constraint", CONSTRAINT, flag="--json-schema/--json/--regex/--grammar"),
    # Speculative decoding (lmcli.generation.speculative_setup): how a row guesses tokens, if at all. The draft model itself
    # is the command's (--draft-model PATH|NAME loads it); a row's "draft_model" switches it on or off.
    # OpenAI bodies take the same names (extension fields, as vLLM's top_k is one).
    Setting("prompt_lookup", SWITCH, optional=False, flag="--prompt-lookup", row=True, openai=("prompt_lookup",)),
    Setting("draft_model", SWITCH, optional=False, flag="--draft-model", row=True, openai=("draft_model",)),
    Setting("num_draft_tokens", INTEGER, low=1, high=MAX_DRAFT_TOKENS, said=f"an integer from 1 to {MAX_DRAFT_TOKENS}",
            flag="--num-draft-tokens", row=True, openai=("num_draft_tokens",)),
    # Which of the command's LoRA adapters (--lora) a row gets, by name; "none" for none; unset: all of them.
    Setting("lora", TEXT, flag="--lora", row=True, openai=("lora",)),
)
SPECULATION = ("prompt_lookup", "draft_model", "num_draft_tokens")
SAMPLING_ONLY = tuple(name for name, setting in SETTINGS.items() if setting.sampling_only)
ROW_SETTINGS = tuple(name for name, setting in SETTINGS.items() if setting.row)
FLAG_NAMES = {name: setting.flag for name, setting in SETTINGS.items() if setting.flag}


def check_truncation(top_k: Any, top_p: Any) -> None:
    """Top-k and top-p are not set together by one layer (the flags, one row, generate()'s arguments);
    a model's defaults may hold both, applied in that order as transformers does."""
    if top_k is not None and top_p is not None:
        raise SamplingError("top_k", "cannot be used together; pick one", other="top_p")


def check_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """Each of `values` (by name) by its rule, then greedy decoding with a sampling-only setting refused;
    returns them normalised. Raises SamplingError for the first that breaks."""
    checked = {name: SETTINGS[name].check(value) for name, value in _temperature_first(values)}
    if checked.get("prompt_lookup") and checked.get("draft_model"):
        raise SamplingError("prompt_lookup", "are two ways to guess tokens: choose one", other="draft_model")
    if checked.get("temperature") == 0:
        for name in SAMPLING_ONLY:
            if checked.get(name) is not None:
                raise SamplingError(name, "only applies to sampling, not greedy decoding")
    return checked


def _temperature_first(values: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
    if "temperature" in values:
        yield "temperature", values["temperature"]
    yield from ((name, value) for name, value in values.items() if name != "temperature")


def check_logit_bias_ids(bias: Any, vocab_size: int | None = None) -> dict[int, float]:
    """{token id: bias} as generate()'s LogitBias takes it; each bias in logit_bias's range."""
    if not isinstance(bias, Mapping):
        raise SamplingError("logit_bias", "must map token ids to biases", bias)
    setting = SETTINGS["logit_bias"]
    checked = {}
    for token, value in bias.items():
        if not is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f" (the vocabulary has {vocab_size} tokens)" if vocab_size is not None else ""
            raise SamplingError("logit_bias", f"must name token ids >= 0{where}", token)
        checked[int(token)] = check_number("logit_bias", value, setting.in_range, setting.bias_range)
    return checked


@dataclass(frozen=True)
class DecodingFields:
    """How many tokens to generate and how each one is chosen; None means off. Their order is the order
    in which JSON rows and `lmcli info` list them. Extended by lmcli.settings.generation_settings.GenerationSettings (what the
    user asked for) and lmcli.generation.sampling.SamplingSettings (what generate() is given)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    min_new_tokens: int | None = None
    num_beams: int | None = None  # None or 1: no beam search
    length_penalty: float | None = None  # beam search only; None is transformers' 1.0
    early_stopping: bool | str | None = None  # beam search only: True, False (None) or "never"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
