"""The sampling defaults a checkpoint ships: generation_config.json beside an HF directory or a
.safetensors file, or a .gguf file's `general.sampling.*` keys. Which keys they are, and what each
file means by "off", is lmcli.settings.table's table; here they are read and checked by its rules."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError
from lmcli.settings.table import SETTINGS, SamplingError, check_settings, is_number

# What the model's own defaults may set: the settings with a generation_config.json key.
MODEL_SETTINGS = tuple(name for name, setting in SETTINGS.items() if setting.hf)


@dataclass(frozen=True)
class ModelDefaults:
    """The sampling settings a checkpoint asks for, and the file (and keys) they came from."""

    values: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""  # e.g. "generation_config.json"
    # generation_config.json's rules, which no flag sets: forced_bos_token_id, forced_eos_token_id,
    # bad_words_ids, suppress_tokens, begin_suppress_tokens (lmcli.generation.sampling.rule_processors)
    rules: Mapping[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.values)


def read_model_defaults(checkpoint: str | Path) -> ModelDefaults:
    """The sampling defaults a checkpoint ships. Commands read them through their ResolvedModel
    (lmcli.resolve.model_ref), so a model found by name has the defaults it has when given by path."""
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
    values = {}
    for name in MODEL_SETTINGS:
        value = data.get(SETTINGS[name].hf)
        if value is not None and not (SETTINGS[name].off is not None and value == SETTINGS[name].off):
            values[name] = value
    if data.get("do_sample") is False:
        values["temperature"] = 0.0  # transformers decodes greedily then, whatever the temperature says
    defaults = checked_model_defaults(values, str(path))
    return ModelDefaults(defaults.values, defaults.source, checked_rules(data, str(path)))


RULES = ("forced_bos_token_id", "forced_eos_token_id", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
         "renormalize_logits")  # the last: beam scores renormalised after the processors (opus-mt ships it)


def checked_rules(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """generation_config.json's rules, checked (token ids: integers >= 0); an error names the file and key."""
    def token(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    rules: dict[str, Any] = {}
    for key in RULES:
        value = data.get(key)
        if value is None:
            continue
        if key == "renormalize_logits":
            if not isinstance(value, bool):
                raise LmcliError(f"{source}: {key} must be true or false, got {json.dumps(value)}")
            if value:
                rules[key] = value
            continue
        if key == "forced_bos_token_id":
            ok = token(value)
        elif key == "forced_eos_token_id":
            ok = token(value) or (isinstance(value, list) and bool(value) and all(map(token, value)))
        elif key == "bad_words_ids":
            ok = isinstance(value, list) and all(isinstance(w, list) and w and all(map(token, w)) for w in value)
        else:
            ok = isinstance(value, list) and all(map(token, value))
        if not ok:
            raise LmcliError(f"{source}: {key} must be token ids (integers >= 0), got {json.dumps(value)}")
        rules[key] = value
    return rules


def _gguf_defaults(path: Path) -> ModelDefaults:
    from lmcli.io.gguf_reader import read_gguf_metadata

    metadata = read_gguf_metadata(path, texts=False)  # the vocabulary is not needed here
    values = {name: metadata[setting.gguf] for name, setting in SETTINGS.items()
              if setting.gguf and setting.gguf in metadata and not setting.off_in_llama_cpp(metadata[setting.gguf])}
    return checked_model_defaults(values, f"{path.name} (general.sampling)")


def checked_model_defaults(values: Mapping[str, Any], source: str) -> ModelDefaults:
    """The model's values, checked by the same rules as a flag's; an error names the file and key.
    (A transcript's saved copy of them comes back through here too.)"""
    values = dict(values)
    for name in values:
        if name not in MODEL_SETTINGS:
            raise LmcliError(f"{source}: {name} is not a setting a model's defaults may hold")
        # Files may write a whole number as a float (40.0).
        if SETTINGS[name].kind == "integer" and is_number(values[name]) and float(values[name]).is_integer():
            values[name] = int(values[name])
    # A greedy model's sampling-only values are checked as if it sampled (they apply once a flag samples).
    try:
        checked = check_settings({**values, "temperature": values.get("temperature") or 1.0})
    except SamplingError as e:
        raise LmcliError(e.message_for(lambda name: f"{source}: {name}")) from None
    return ModelDefaults({name: checked[name] if name != "temperature" else float(values[name]) for name in values},
                         source)
