"""GenerationSettings: everything that decides a completion besides the prompt and the model.

Four layers decide each setting, the first that sets it wins:

    a command-line flag > a job row's field > the model's own defaults > lmcli's defaults

(what the user typed for this run wins over what the input file asks for, and a row wins over the
model's and lmcli's defaults). A row's value that a flag overrides is still checked, then dropped
without a word (no warning per row). Top-k and top-p are one unit: a flag that sets either keeps the
row's pair out; otherwise a row that sets either replaces both. A greedy flag (--greedy,
--temperature 0) makes every row greedy and drops the rows' sampling-only settings; a row's
`temperature: 0`, when no --temperature/--greedy flag was given, makes that row greedy.
The model's defaults come from `generation_config.json` (HF directories) or the GGUF
`general.sampling.*` keys (`read_model_defaults`). Each setting remembers where it came from
(`sources`), which `lmcli info`, `--stats` and JSONL rows show.

The sampling rules themselves (ranges, what applies only when sampling) live in
lmcli.generation.sampling; here they are only named as the user wrote them: `--top-p` for a flag,
`"top_p"` for a row, the file and key for a model's default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError, UsageError
from lmcli.generation.constraints import CONSTRAINED_MAX_NEW_TOKENS, Constraint, ConstraintError, one_constraint
from lmcli.generation.decoding_fields import DEFAULT_MAX_NEW_TOKENS as DEFAULT_MAX_NEW_TOKENS
from lmcli.generation.decoding_fields import WARPERS, DecodingFields

DEFAULT_TEMPERATURE = 0.8

# How each setting is named to the user, on the command line and in a JSONL row.
FLAG_NAMES = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "typical_p": "--typical-p",
    "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "no_repeat_ngram_size": "--no-repeat-ngram-size",
    "min_new_tokens": "--min-new-tokens",
    "logit_bias": "--logit-bias",
    "seed": "--seed",
    "stop": "--stop",
    "system": "--system",
    "logprobs": "--logprobs",
    "constraint": "--json-schema/--json/--regex/--grammar",
}
# Settings a JSONL row may set (besides "prompt" and "id").
ROW_SETTINGS = ("seed", "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "no_repeat_ngram_size",
                "min_new_tokens", "logit_bias", "stop", "system", "json_schema", "json", "regex", "grammar")
INTEGER_SETTINGS = ("seed", "max_new_tokens", "top_k", "no_repeat_ngram_size", "min_new_tokens")
NUMBER_SETTINGS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")
TRUNCATION = ("top_k", "top_p")  # one unit: a layer that sets either replaces both
# What the model's own defaults may set.
MODEL_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty", "max_new_tokens")

DEFAULT, FLAG, ROW = "lmcli default", "flag", "row"


class RowError(ValueError):
    """A problem with one input row; it becomes that row's `error` and the job goes on."""


@dataclass(frozen=True)
class ModelDefaults:
    """The sampling settings a checkpoint asks for, and the file (and keys) they came from."""

    values: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""  # e.g. "generation_config.json"

    def __bool__(self) -> bool:
        return bool(self.values)


@dataclass(frozen=True)
class GenerationSettings(DecodingFields):
    """Everything that decides a completion besides the prompt and the model: the decoding fields
    (lmcli.generation.decoding_fields) and the ones below. Validated on creation."""

    temperature: float = DEFAULT_TEMPERATURE  # lmcli's default (the field keeps its place among the decoding fields)
    logit_bias: tuple[tuple[str, float], ...] = ()  # (token as text or as an id, bias), resolved with the tokenizer
    seed: int | None = None  # as given; rows without one draw their own
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    chat: bool = False
    system: str | None = None
    logprobs: int | None = None  # how many alternatives per token; None = no logprobs
    truncate: bool = True  # a prompt longer than the context loses its start (with a warning); False: refuse
    constraint: Constraint | None = None  # the structured output the row must have (generation/constraints.py)
    # Where each setting above came from (FLAG, ROW, the model's file); absent means lmcli's default.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    model_defaults: ModelDefaults = field(default_factory=ModelDefaults, compare=False, repr=False)

    def source(self, name: str) -> str:
        return self.sources.get(name, DEFAULT)

    @classmethod
    def from_flags(cls, *, greedy: bool = False, temperature: float | None = None,
                   max_new_tokens: int | None = None, **values) -> GenerationSettings:
        """Settings from command-line flags (None: not given); raises UsageError naming the flag."""
        if greedy and temperature not in (None, 0):
            raise UsageError(f"--greedy and --temperature {temperature:g} contradict each other; pick one")
        if greedy:
            temperature = 0.0
        if values.get("system") is not None and not values.get("chat"):
            raise UsageError("--system only applies with --chat")
        if values.get("constraint") is not None and values.get("ignore_eos"):
            raise UsageError("--ignore-eos cannot be combined with a constraint: its end is the end of the text")
        given = {name: value for name, value in values.items() if value is not None}
        for name in ("stop", "logit_bias"):
            if name in given:
                given[name] = tuple(given[name])
                if not given[name]:
                    del given[name]
        if temperature is not None:
            given["temperature"] = float(temperature)
        if max_new_tokens is not None:
            given["max_new_tokens"] = max_new_tokens
        _check_truncation_layer(given, lambda name: FLAG_NAMES[name], UsageError)
        sources = {name: FLAG for name in given if name in FLAG_NAMES}
        settings = cls(**given, sources=sources)
        settings.check(lambda name: FLAG_NAMES[name], UsageError)
        return settings

    def for_row(self, row: dict) -> GenerationSettings:
        """These settings with a JSONL row's fields, which fill what no flag set; raises RowError naming
        the field. Every field the row gives is checked (on its own, as one layer), even one a flag
        overrides; an overridden field is then dropped silently."""
        changes: dict[str, Any] = {}
        for name in INTEGER_SETTINGS:
            if name in row:
                changes[name] = _row_int(row, name)
        for name in NUMBER_SETTINGS:
            if name in row:
                changes[name] = float(_row_number(row, name))
        _check_truncation_layer(changes, lambda name: f'"{name}"', RowError)
        if "stop" in row:
            stop = row["stop"]
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise RowError('"stop" must be a string or a list of strings')
            changes["stop"] = tuple(stop)
        if "logit_bias" in row:
            bias = row["logit_bias"]
            if not isinstance(bias, dict) or not all(_is_number(v) for v in bias.values()):
                raise RowError('"logit_bias" must be an object of token (text or id) to bias, e.g. {"13": -100}')
            changes["logit_bias"] = tuple((str(token), float(value)) for token, value in bias.items())
        if "system" in row:
            if not isinstance(row["system"], str):
                raise RowError('"system" must be a string')
            if not self.chat:
                raise RowError('"system" only applies with --chat')
            changes["system"] = row["system"]
        if any(kind in row for kind in ("json_schema", "json", "regex", "grammar")):
            try:
                changes["constraint"] = one_constraint(row, lambda kind: f'"{kind}"')
            except ConstraintError as e:
                raise RowError(str(e)) from None
        # The row on its own, as a layer (as a model's defaults are checked): its values are its own
        # business whether or not a flag overrides them.
        GenerationSettings(**changes, chat=self.chat).check(lambda name: f'"{name}"', RowError)
        # A flag wins: the row's value for anything a flag set is dropped (silently; see the module doc).
        flagged = {name for name, where in self.sources.items() if where == FLAG}
        if flagged & set(TRUNCATION):
            flagged |= set(TRUNCATION)  # the flags' truncation stands whole
        if self.source("temperature") == FLAG and self.temperature == 0:
            flagged |= set(WARPERS)  # a greedy flag makes every row greedy
        changes = {name: value for name, value in changes.items() if name not in flagged}
        given = set(changes)
        sources = dict(self.sources)
        for name in changes:
            sources[name] = ROW
        if any(name in changes for name in TRUNCATION):
            # Truncation comes from the row as a whole (no flag set any), replacing the model's.
            for name in TRUNCATION:
                changes.setdefault(name, None)
                sources[name] = ROW
        if changes.get("temperature") == 0:
            # A greedy row (no temperature flag): sampling-only settings it did not give itself have no
            # effect, whether from the flags or the model's or lmcli's defaults; drop them.
            for name in WARPERS:
                if name not in given:
                    changes[name] = None
                    sources.pop(name, None)
        settings = dataclasses.replace(self, **changes, sources=sources)._with_model_layer()
        settings.check(settings._name_by_source, RowError)
        return settings

    def with_model_defaults(self, defaults: ModelDefaults) -> GenerationSettings:
        """These settings over the model's own defaults (which fill only what no flag or row set)."""
        settings = dataclasses.replace(self, model_defaults=defaults)._with_model_layer()
        settings.check(self._name_by_source, LmcliError)
        return settings

    def _with_model_layer(self) -> GenerationSettings:
        """Refill, from the model's defaults, every setting that only has lmcli's default."""
        defaults = self.model_defaults
        changes: dict[str, Any] = {}
        sources = {name: where for name, where in self.sources.items() if where in (FLAG, ROW)}
        for name in MODEL_SETTINGS:
            if sources.get(name) in (FLAG, ROW):
                continue
            if name in TRUNCATION and any(sources.get(t) in (FLAG, ROW) for t in TRUNCATION):
                changes[name] = None  # the user chose the truncation; the model's does not mix in
            elif name in defaults.values:
                changes[name] = defaults.values[name]
                sources[name] = defaults.source
            elif name == "max_new_tokens" and self.constraint is not None:
                changes[name] = CONSTRAINED_MAX_NEW_TOKENS  # a whole object ends the text itself, at EOS
            else:
                changes[name] = _LMCLI_DEFAULTS.get(name)
        temperature = changes.get("temperature", self.temperature)
        if temperature == 0:  # greedy: the model's sampling-only settings do not apply
            for name in WARPERS:
                if sources.get(name) == defaults.source:
                    changes[name] = None
                    del sources[name]
        return dataclasses.replace(self, **changes, sources=sources)

    def _name_by_source(self, name: str) -> str:
        where = self.source(name)
        if where == FLAG:
            return FLAG_NAMES[name]
        if where == ROW:
            return f'"{name}"'
        return f"{name} (from {where})"

    @property
    def sampling(self):
        """The sampling part, for lmcli.generation.sampling (logit_bias as given, not yet token ids)."""
        from lmcli.generation.sampling import SamplingSettings

        return SamplingSettings(**self._decoding(), seed=self.seed)

    def _decoding(self) -> dict[str, Any]:
        """The decoding fields' values, by name, in their order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DecodingFields)}

    def check(self, name: Callable[[str], str], error: type[Exception]) -> None:
        """Raise `error` with one line saying which setting is wrong and why."""
        from lmcli.generation.sampling import SamplingError, check_logit_bias

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise error(f"{name('max_new_tokens')} must be at least 1, got {self.max_new_tokens}")
        try:
            self.sampling.check()
        except SamplingError as e:
            message = e.message_for(name)
            if e.setting in WARPERS and self.source("temperature") not in (FLAG, ROW, DEFAULT):
                message += f" ({self.source('temperature')} asks for greedy decoding; give a --temperature to sample)"
            raise error(message) from None
        for token, bias in self.logit_bias:  # the tokens become ids with the tokenizer; the biases are checked now
            try:
                check_logit_bias({0: bias})
            except SamplingError as e:
                raise error(f"{name('logit_bias')} {e.requirement}, got {token}={bias:g}") from None
        if any(s == "" for s in self.stop):
            raise error(f"{name('stop')} must not be an empty string")
        if self.logprobs is not None and self.logprobs < 0:
            raise error(f"{name('logprobs')} must be >= 0, got {self.logprobs}")

    def logit_bias_ids(self, tokenizer, vocab_size: int) -> dict[int, float]:
        """{token id: bias}: a token given as digits is an id, any other as text that must be one token."""
        name = self._name_by_source("logit_bias")
        error: type[Exception] = UsageError if self.source("logit_bias") == FLAG else RowError
        ids: dict[int, float] = {}
        for token, bias in self.logit_bias:
            if token.isdigit():
                token_id = int(token)
                if token_id >= vocab_size:
                    raise error(f"{name}: token id {token_id} is outside the vocabulary ({vocab_size} tokens)")
            else:
                encoded = list(tokenizer.encode(token, add_special_tokens=False))
                if len(encoded) != 1:
                    raise error(f"{name}: {token!r} is {len(encoded)} tokens {encoded}, not one; give one token or its id")
                token_id = encoded[0]
            ids[token_id] = bias
        return ids

    def batch_key(self) -> tuple:
        """The settings that every row of one `model.generate` call must share."""
        sampling = (value for name, value in self._decoding().items() if name != "max_new_tokens")
        return (*sampling, self.logit_bias, self.ignore_eos, self.logprobs)

    def used(self) -> dict[str, Any]:
        """The decoding settings in effect (those that are on), as JSON output records them."""
        out = {name: value for name, value in self._decoding().items() if value is not None}
        if self.logit_bias:
            out["logit_bias"] = dict(self.logit_bias)
        if self.constraint is not None:
            out.update(self.constraint.describe())
        return out

    def described(self) -> list[tuple[str, str, str]]:
        """(setting, value, where it came from) for each decoding setting, as `lmcli info` shows them."""
        rows = []
        for name in ("max_new_tokens", "temperature", *WARPERS, "repetition_penalty"):
            value = getattr(self, name)
            shown = "off" if value is None else ("0 (greedy)" if name == "temperature" and value == 0 else f"{value:g}")
            rows.append((name, shown, self.source(name)))
        return rows


_LMCLI_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationSettings) if f.name in MODEL_SETTINGS}


def _check_truncation_layer(values: Mapping[str, Any], name: Callable[[str], str], error: type[Exception]) -> None:
    """One layer (the flags, or a row) may not set both top-k and top-p; a model's defaults may."""
    if values.get("top_k") is not None and values.get("top_p") is not None:
        raise error(f"{name('top_k')} and {name('top_p')} cannot be used together; pick one")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _row_int(row: dict, name: str) -> int:
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise RowError(f'"{name}" must be an integer, got {json.dumps(value)}')
    return value


def _row_number(row: dict, name: str) -> float:
    value = row[name]
    if not _is_number(value):
        raise RowError(f'"{name}" must be a number, got {json.dumps(value)}')
    return value


def parse_logit_bias(specs: list[str] | None) -> tuple[tuple[str, float], ...]:
    """--logit-bias TOKEN=BIAS (repeatable) -> ((token, bias), ...); the last '=' splits, so a token may hold one."""
    parsed = []
    for spec in specs or ():
        token, sep, bias = spec.rpartition("=")
        try:
            value = float(bias)
        except ValueError:
            value = None
        if not sep or not token or value is None:
            raise UsageError(f"--logit-bias takes TOKEN=BIAS (a token id or its text, and a number), got {spec!r}")
        parsed.append((token, value))
    return tuple(parsed)


def input_hash(prompt: Any, settings: GenerationSettings) -> str:
    """A fingerprint of what decides a row's result, so resume can tell if the input changed."""
    values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.compare}
    payload = json.dumps({"prompt": prompt, "settings": values}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


# ----------------------------------------------------------------------------- the model's own defaults

# generation_config.json keys that are lmcli settings of the same name, and their "off" values.
_HF_OFF = {"top_k": 0, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0, "min_p": 0.0}
# llama.cpp's GGUF keys (general.sampling.*) and the lmcli setting each one is.
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def read_model_defaults(checkpoint: str | Path | None, model_name: str | None = None) -> ModelDefaults:
    """The sampling defaults a checkpoint ships: generation_config.json beside an HF directory or a
    .safetensors file, or a .gguf file's general.sampling.* keys; None is the embedded default model.
    A model given only by name (no checkpoint) has none read here: its files are found at load."""
    if checkpoint is None and model_name is not None:
        return ModelDefaults()
    if checkpoint is None:
        from lmcli.default_model import default_checkpoint_path

        checkpoint = default_checkpoint_path()
    path = Path(checkpoint)
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_defaults(path)
    directory = path if path.is_dir() else path.parent
    config = directory / "generation_config.json"
    return _hf_defaults(config) if config.is_file() else ModelDefaults()


def _hf_defaults(path: Path) -> ModelDefaults:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LmcliError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise LmcliError(f"{path}: not a JSON object")
    values = {name: data[name] for name in MODEL_SETTINGS if data.get(name) is not None}
    values = {name: value for name, value in values.items() if value != _HF_OFF.get(name)}
    if data.get("do_sample") is False:
        values["temperature"] = 0.0  # transformers decodes greedily then, whatever the temperature says
    return _checked(values, str(path))


def _gguf_defaults(path: Path) -> ModelDefaults:
    from lmcli.io.gguf_reader import read_gguf_metadata

    metadata = read_gguf_metadata(path)
    values = {setting: metadata[key] for key, setting in _GGUF_KEYS.items() if key in metadata}
    # llama.cpp treats top_k <= 0, top_p >= 1, min_p <= 0 and penalty 1 as off.
    off = {"top_k": lambda v: v <= 0, "top_p": lambda v: v >= 1, "min_p": lambda v: v <= 0,
           "repetition_penalty": lambda v: v == 1}
    values = {name: value for name, value in values.items() if not (name in off and _is_number(value) and off[name](value))}
    return _checked(values, f"{path.name} (general.sampling)")


def _checked(values: dict[str, Any], source: str) -> ModelDefaults:
    """The model's values, checked by the same rules as a flag's; an error names the file and key."""
    for name in ("top_k", "max_new_tokens"):
        if _is_number(values.get(name)) and float(values[name]).is_integer():
            values[name] = int(values[name])
    for name in ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty"):
        if _is_number(values.get(name)):
            values[name] = float(values[name])
    # A greedy model's sampling-only values are checked as if it sampled (they apply once a flag samples).
    probe = GenerationSettings(**{**values, "temperature": values.get("temperature") or 1.0})
    probe.check(lambda name: f"{source}: {name}", LmcliError)
    return ModelDefaults(values, source)
