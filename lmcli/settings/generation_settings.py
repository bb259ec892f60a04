"""GenerationSettings: everything that decides a completion besides the prompt and the model.

Four layers decide each setting, the first that sets it wins:

    a command-line flag > a job row's field > the model's own defaults > lmcli's defaults

(what the user typed for this run wins over what the input file asks for, and a row wins over the
model's and lmcli's defaults). Speculation (`prompt_lookup`, `draft_model`, `num_draft_tokens`) is the
one exception: its flags set the job's default and load what it needs (the draft), and a row's field
chooses for that row (it decides how fast a row's tokens come, not which: greedy text is the same). A row's value that a flag overrides is still checked, then dropped
without a word (no warning per row). Top-k and top-p are one unit: a flag that sets either keeps the
row's pair out; otherwise a row that sets either replaces both. A greedy flag (--greedy,
--temperature 0) makes every row greedy and drops the rows' sampling-only settings; a row's
`temperature: 0`, when no --temperature/--greedy flag was given, makes that row greedy.
The model's defaults come from `generation_config.json` (HF directories) or the GGUF
`general.sampling.*` keys (`read_model_defaults`). Each setting remembers where it came from
(`sources`), which `lmcli info`, `--stats` and JSONL rows show.

Each setting's type, range, off value and names are lmcli.settings.table's table; here its rules are
applied at each edge (flags, job rows, chat transcripts, the model's files) and named as the user wrote
them: `--top-p` for a flag, `"top_p"` for a row, the file and key for a model's default. A
GenerationSettings is checked whenever one is made, `dataclasses.replace` included, so none breaks a rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from lmcli.errors import LmcliError, UsageError
from lmcli.settings.constraint import CONSTRAINED_MAX_NEW_TOKENS, KINDS, Constraint, one_constraint
from lmcli.settings.model_defaults import MODEL_SETTINGS, RULES, ModelDefaults, checked_model_defaults, checked_rules
from lmcli.settings.model_defaults import read_model_defaults as read_model_defaults
from lmcli.settings.table import DEFAULT_MAX_NEW_TOKENS as DEFAULT_MAX_NEW_TOKENS
from lmcli.settings.table import (
    FLAG_NAMES,
    SAMPLING_ONLY,
    SETTINGS,
    SPECULATION,
    SWITCH,
    DecodingFields,
    SamplingError,
    check_settings,
    check_truncation,
)
from lmcli.settings.table import ROW_SETTINGS as ROW_SETTINGS

DEFAULT_TEMPERATURE = 0.8
# A job row's settings: the table's, and the structured-output keys, which make the one `constraint`.
JOB_ROW_SETTINGS = (*ROW_SETTINGS, *KINDS)
TRUNCATION = ("top_k", "top_p")  # one unit: a layer that sets either replaces both

DEFAULT, FLAG, ROW = "lmcli default", "flag", "row"


class RowError(ValueError):
    """A problem with one input row; it becomes that row's `error` and the job goes on."""


class InvalidSettings(LmcliError, ValueError):
    """GenerationSettings that would break a rule. Its message names the setting by where it came from;
    `message_for` names it as a caller's user wrote it."""

    def __init__(self, problem: SamplingError, note: str, name: Callable[[str], str]):
        self.problem, self.note = problem, note
        super().__init__(self.message_for(name))

    def message_for(self, name: Callable[[str], str]) -> str:
        return self.problem.message_for(name) + self.note


@dataclass(frozen=True)
class GenerationSettings(DecodingFields):
    """Everything that decides a completion besides the prompt and the model: the decoding fields
    (lmcli.settings.table.DecodingFields) and the ones below. Checked on creation (InvalidSettings)."""

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
    prompt_lookup: bool = False  # speculate by prompt lookup (lmcli.generation.speculative_setup)
    draft_model: bool = False  # speculate with the command's --draft-model
    num_draft_tokens: int | None = None  # the bound on a guess (None: lmcli.generation.speculative's default)
    lora: str | None = None  # the loaded LoRA adapter this row gets, by name (kernels/lora.py); None: the command's
    # Where each setting above came from (FLAG, ROW, the model's file); absent means lmcli's default.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    model_defaults: ModelDefaults = field(default_factory=ModelDefaults, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Every setting by its rule (lmcli.settings.table), normalised in place (a float for a number, a tuple
        for a list); InvalidSettings for the first that breaks one."""
        try:
            if not isinstance(self.sources, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()):
                raise SamplingError("sources", "must map setting names to where each came from", self.sources)
            if not isinstance(self.model_defaults, ModelDefaults):
                raise SamplingError("model_defaults", "must be a ModelDefaults", self.model_defaults)
            checked = check_settings({name: getattr(self, name) for name in SETTINGS})
            if self.system is not None and not self.chat:
                raise SamplingError("system", "only applies with --chat")
        except SamplingError as e:
            raise InvalidSettings(e, self._greedy_note(e), self._name_by_source) from None
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        self._settle_beams()

    def _settle_beams(self) -> None:
        """Beam search (num_beams > 1) chooses tokens itself, without sampling: the temperature becomes 0 and
        the sampling-only settings are dropped. A user's own beams (a flag or a row) with sampling settings,
        speculation, structured output or logprobs of their own is InvalidSettings; the model's default beams
        give way to them instead."""
        if (self.num_beams or 1) <= 1:
            return
        own = lambda name: self.source(name) in (FLAG, ROW)  # noqa: E731
        sampling = [name for name in ("temperature", *SAMPLING_ONLY) if own(name) and getattr(self, name)]
        other = [name for name in ("prompt_lookup", "draft_model") if getattr(self, name)]
        other += ["constraint"] if self.constraint is not None else []
        other += ["logprobs"] if self.logprobs is not None else []
        if sampling or other:
            if own("num_beams"):
                clash = (sampling + other)[0]
                raise InvalidSettings(SamplingError(
                    "num_beams", "cannot be combined (beam search does not sample, speculate, constrain or give logprobs)",
                    other=clash),
                                      "", self._name_by_source)
            for name in ("num_beams", "length_penalty", "early_stopping"):
                object.__setattr__(self, name, None)
            return
        object.__setattr__(self, "temperature", 0.0)
        for name in SAMPLING_ONLY:
            object.__setattr__(self, name, None)

    @property
    def beams(self) -> int:
        """How many beams: 1 means no beam search."""
        return self.num_beams or 1

    def _greedy_note(self, problem: SamplingError) -> str:
        where = self.source("temperature")
        if self.greedy and problem.setting in SAMPLING_ONLY and where not in (FLAG, ROW, DEFAULT):
            return f" ({where} asks for greedy decoding; give a --temperature to sample)"
        return ""

    def source(self, name: str) -> str:
        return self.sources.get(name, DEFAULT)

    def changed(self, name: Callable[[str], str], error: type[Exception], **changes: Any) -> GenerationSettings:
        """These settings with `changes`; raises `error` naming the setting that breaks a rule with `name`."""
        return _made(lambda: dataclasses.replace(self, **changes), error, name)

    @classmethod
    def from_flags(cls, *, greedy: bool = False, temperature: float | None = None,
                   max_new_tokens: int | None = None, **values) -> GenerationSettings:
        """Settings from command-line flags (None: not given); raises UsageError naming the flag."""
        if greedy and temperature not in (None, 0):
            raise UsageError(f"--greedy and --temperature {temperature:g} contradict each other; pick one")
        if greedy:
            temperature = 0.0
        if values.get("constraint") is not None and values.get("ignore_eos"):
            raise UsageError("--ignore-eos cannot be combined with a constraint: its end is the end of the text")
        given = {name: value for name, value in values.items() if value is not None}
        for name in ("stop", "logit_bias"):
            if name in given:
                given[name] = tuple(given[name])
                if not given[name]:
                    del given[name]
        if temperature is not None:
            given["temperature"] = temperature
        if max_new_tokens is not None:
            given["max_new_tokens"] = max_new_tokens
        # A switch is always given (off unless typed), so it has no source worth telling.
        sources = {name: FLAG for name in given if SETTINGS[name].kind != SWITCH}

        def make() -> GenerationSettings:
            check_truncation(given.get("top_k"), given.get("top_p"))
            return cls(**given, sources=sources)

        return _made(make, UsageError, _flag_name)

    def for_row(self, row: dict) -> GenerationSettings:
        """These settings with a JSONL row's fields, which fill what no flag set; raises RowError naming
        the field. Every field the row gives is checked (on its own, as one layer), even one a flag
        overrides; an overridden field is then dropped silently."""

        def own() -> dict[str, Any]:
            values = {name: SETTINGS[name].from_json(row[name]) for name in ROW_SETTINGS if name in row}
            check_truncation(values.get("top_k"), values.get("top_p"))
            if any(kind in row for kind in KINDS):  # ConstraintError: one line naming the row's key
                values["constraint"] = one_constraint(row, _row_name)
            # The row on its own, as a layer (as a model's defaults are checked): its values are its own
            # business whether or not a flag overrides them.
            GenerationSettings(**values, chat=self.chat)
            return values

        changes = _made(own, RowError, _row_name)
        changes.update(_made(lambda: self._row_speculation(changes), RowError, _row_name))
        # A flag wins: the row's value for anything a flag set is dropped (silently; see the module doc).
        flagged = {name for name, where in self.sources.items() if where == FLAG} - set(SPECULATION)
        if flagged & set(TRUNCATION):
            flagged |= set(TRUNCATION)  # the flags' truncation stands whole
        if self.source("temperature") == FLAG and self.temperature == 0:
            flagged |= set(SAMPLING_ONLY)  # a greedy flag makes every row greedy
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
            for name in SAMPLING_ONLY:
                if name not in given:
                    changes[name] = None
                    sources.pop(name, None)
        return _made(lambda: self._over_model(changes, sources, self.model_defaults), RowError)

    def _row_speculation(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """A row's speculation fields over these settings' (the row's own choice wins, see the module doc):
        a row that switches one method on switches the other off; "draft_model" needs the command's draft."""
        changes: dict[str, Any] = {}
        if row.get("prompt_lookup") and self.draft_model:
            changes["draft_model"] = False
        if row.get("draft_model"):
            if not self.draft_model:
                raise SamplingError("draft_model", "needs --draft-model (the command loads the draft)")
            if self.prompt_lookup:
                changes["prompt_lookup"] = False
        merged = {name: row.get(name, changes.get(name, getattr(self, name))) for name in ("prompt_lookup", "draft_model")}
        if row.get("num_draft_tokens") is not None and not any(merged.values()):
            raise SamplingError("num_draft_tokens", 'needs "prompt_lookup": true (or --prompt-lookup, --draft-model)')
        return changes

    def speculates(self) -> bool:
        return self.prompt_lookup or self.draft_model

    def with_model_defaults(self, defaults: ModelDefaults) -> GenerationSettings:
        """These settings over the model's own defaults (which fill only what no flag or row set)."""
        return _made(lambda: self._over_model({}, self.sources, defaults), LmcliError)

    def _over_model(self, changes: Mapping[str, Any], sources: Mapping[str, str],
                    defaults: ModelDefaults) -> GenerationSettings:
        """These settings with `changes` (from `sources`), over `defaults`: every setting that only has
        lmcli's default is refilled from the model's. Made (and so checked) once."""
        changes = dict(changes)
        sources = {name: where for name, where in sources.items() if where in (FLAG, ROW)}
        for name in MODEL_SETTINGS:
            if sources.get(name) in (FLAG, ROW):
                continue
            if name in TRUNCATION and any(sources.get(t) in (FLAG, ROW) for t in TRUNCATION):
                changes[name] = None  # the user chose the truncation; the model's does not mix in
            elif name in defaults.values:
                changes[name] = defaults.values[name]
                sources[name] = defaults.source
            elif name == "max_new_tokens" and changes.get("constraint", self.constraint) is not None:  # a row's own too
                changes[name] = CONSTRAINED_MAX_NEW_TOKENS  # a whole object ends the text itself, at EOS
            else:
                changes[name] = _LMCLI_DEFAULTS.get(name)
        temperature = changes.get("temperature", self.temperature)
        if temperature == 0:  # greedy: the model's sampling-only settings do not apply
            for name in SAMPLING_ONLY:
                if sources.get(name) == defaults.source:
                    changes[name] = None
                    del sources[name]
        return dataclasses.replace(self, **changes, sources=sources, model_defaults=defaults)

    def resumed(self, saved: Mapping[str, Any], allowed: Collection[str], explicit: Collection[str], where: str,
                error: type[Exception]) -> GenerationSettings:
        """These settings under a chat transcript's saved ones (`allowed` by name), except those given on
        the command line this time (`explicit`). Each saved field is checked by its rule and type; a
        bad one is refused with `error`, naming it and `where` (the file)."""
        name = lambda setting: f'"{setting}" in {where}'  # noqa: E731
        unknown = sorted(key for key in saved if key not in allowed or key not in (*SETTINGS, *_SAVED_EXTRAS))
        if unknown:
            raise error(f"{where}: unknown setting '{unknown[0]}' in \"settings\"")

        def values() -> dict[str, Any]:
            return {key: _SAVED_EXTRAS[key](value, where) if key in _SAVED_EXTRAS else _saved_value(key, value)
                    for key, value in saved.items() if key not in explicit}

        changes = _made(values, error, name)
        if "sources" in changes:  # a setting given this time keeps its source (the user's own, as a flag)
            changes["sources"] = {**changes["sources"], **{k: v for k, v in self.sources.items() if k in explicit}}
        return _made(lambda: dataclasses.replace(self, **changes), error, name)

    def _name_by_source(self, name: str) -> str:
        where = self.source(name)
        if where == FLAG:
            return _flag_name(name)
        if where == ROW:
            return _row_name(name)
        return name if where == DEFAULT else f"{name} (from {where})"

    def _decoding(self) -> dict[str, Any]:
        """The decoding fields' values, by name, in their order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DecodingFields)}

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
        # Beam search's result depends on its length limit: beam rows share max_new_tokens too.
        beams = self.max_new_tokens if self.beams > 1 else None
        return (*sampling, self.logit_bias, self.ignore_eos, self.logprobs, *(getattr(self, n) for n in SPECULATION),
                beams)

    def used(self) -> dict[str, Any]:
        """The decoding settings in effect (those that are on), as JSON output records them."""
        out = {name: value for name, value in self._decoding().items() if value is not None}
        if self.logit_bias:
            out["logit_bias"] = dict(self.logit_bias)
        if self.constraint is not None:
            out.update(self.constraint.describe())
        if self.lora is not None:
            out["lora"] = self.lora
        return out

    def described(self) -> list[tuple[str, str, str]]:
        """(setting, value, where it came from) for each decoding setting, as `lmcli info` shows them."""
        rows = []
        for name in ("max_new_tokens", "temperature", *SAMPLING_ONLY, "repetition_penalty"):
            value = getattr(self, name)
            shown = "off" if value is None else ("0 (greedy)" if name == "temperature" and value == 0 else f"{value:g}")
            if name == "temperature" and self.beams > 1:
                shown = "0 (beam search)"
            rows.append((name, shown, self.source(name)))
        if self.beams > 1:  # the model's own beams (or the flags'), as its generation_config.json asks
            early = {True: "true", False: "false", None: "false", "never": "never"}[self.early_stopping]
            length = 1.0 if self.length_penalty is None else self.length_penalty
            rows += [("num_beams", str(self.beams), self.source("num_beams")),
                     ("length_penalty", f"{length:g}", self.source("length_penalty")),
                     ("early_stopping", early, self.source("early_stopping"))]
        return rows


_LMCLI_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationSettings) if f.name in MODEL_SETTINGS}


def _flag_name(name: str) -> str:
    return FLAG_NAMES.get(name, name)


def _row_name(name: str) -> str:
    return f'"{name}"'


def _made(make: Callable[[], Any], error: type[Exception], name: Callable[[str], str] | None = None) -> Any:
    """make(), with a broken rule raised as `error`, naming the setting with `name` (by default, by
    where each setting came from)."""
    try:
        return make()
    except InvalidSettings as e:
        raise error(e.message_for(name) if name is not None else str(e)) from None
    except SamplingError as e:
        raise error(e.message_for(name or str)) from None
    except LmcliError as e:  # a model's defaults, saved in a transcript
        raise error(str(e)) from None


def _saved_value(name: str, value: Any) -> Any:
    """A transcript's setting as /save wrote it (JSON null for one not set; logit_bias as pairs)."""
    pairs = name == "logit_bias" and isinstance(value, list)
    if pairs and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in value):
        value = dict(value)  # anything else is refused as not an object, below
    return SETTINGS[name].from_json(value, null=True)


def _saved_sources(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(k in SETTINGS and isinstance(v, str) for k, v in value.items()):
        raise SamplingError("sources", "must be an object of setting name to where it came from",
                            shown=json.dumps(value, default=repr))
    return value


def _saved_model_defaults(value: Any, where: str) -> ModelDefaults:
    if (not isinstance(value, dict) or set(value) - {"values", "source", "rules"}
            or not isinstance(value.get("values", {}), dict) or not isinstance(value.get("rules", {}), dict)
            or not isinstance(value.get("source", ""), str)):
        raise SamplingError("model_defaults", 'must be an object {"values": {setting: value}, "source": file}',
                            shown=json.dumps(value, default=repr))
    checked = checked_model_defaults(value.get("values", {}), f'{where}: "model_defaults"')
    rules = value.get("rules", {})
    if set(rules) - set(RULES):
        raise SamplingError("model_defaults", f"has an unknown rule {sorted(set(rules) - set(RULES))[0]!r}")
    return ModelDefaults(checked.values, value.get("source", ""), checked_rules(rules, f'{where}: "model_defaults"'))


# What a transcript saves besides the settings themselves.
_SAVED_EXTRAS: dict[str, Callable[[Any, str], Any]] = {"sources": _saved_sources, "model_defaults": _saved_model_defaults}


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
    return input_hasher(settings)(prompt)


def input_hasher(settings: GenerationSettings) -> Callable[[Any], str]:
    """input_hash for many prompts with the same settings, their JSON written once: the payload is
    json.dumps({"prompt": prompt, "settings": values}, sort_keys=True, ensure_ascii=False)."""
    values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
              if f.compare and f.name not in SPECULATION}
    for name in ("num_beams", "length_penalty", "early_stopping", "lora"):  # newer than the hashes of earlier outputs
        if values[name] is None:
            del values[name]
    if not settings.greedy:  # speculation leaves greedy text as it is, and draws a sampled row's differently
        values.update({name: getattr(settings, name) for name in SPECULATION if getattr(settings, name)})
    tail = (', "settings": ' + json.dumps(values, sort_keys=True, ensure_ascii=False) + "}").encode("utf-8")

    def hash_prompt(prompt: Any) -> str:
        # a string's JSON by json's own C encoder (what json.dumps calls for one, without its set-up)
        text = json.encoder.encode_basestring(prompt) if isinstance(prompt, str) else json.dumps(
            prompt, sort_keys=True, ensure_ascii=False)
        head = '{"prompt": ' + text
        return hashlib.sha256(head.encode("utf-8") + tail).hexdigest()[:16]

    return hash_prompt
