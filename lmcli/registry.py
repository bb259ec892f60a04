"""Names users type -> architecture modules and preset configs.

An architecture module (lmcli/models/<name>.py) provides `config_from_hf(hf_dict) -> ModelConfig`
and, when its checkpoint names differ from the shared decoder's, `convert_checkpoint(tensors, config)`;
it declares the names it answers to (HF_MODEL_TYPES, GGUF_ARCHITECTURES, FLAGSHIP_PRESETS), and
the tables below are built from those.
Presets are HF-style config.json files in configs/, named as users type them.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from lmcli.config import ModelConfig
from lmcli.errors import ConfigError

ARCHITECTURES = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "gemma", "t5", "bart", "marian")  # modules in lmcli/models/


def _architecture_modules() -> dict[str, ModuleType]:
    # The architecture modules import only lmcli.config (torch comes with the model), so this is cheap.
    return {arch: importlib.import_module(f"lmcli.models.{arch}") for arch in ARCHITECTURES}


_MODULES = _architecture_modules()
# HF model_type -> lmcli architecture module.
MODEL_TYPES: dict[str, str] = {model_type: arch for arch, module in _MODULES.items() for model_type in module.HF_MODEL_TYPES}
# A bare architecture name used where a config is needed resolves to its flagship preset.
FLAGSHIP_PRESETS: dict[str, str] = {name: preset for module in _MODULES.values() for name, preset in module.FLAGSHIP_PRESETS.items()}
# GGUF general.architecture -> the lmcli module whose `config_from_gguf` / `tensors_from_gguf` read it.
GGUF_ARCHITECTURES: dict[str, str] = {gguf: arch for arch, module in _MODULES.items() for gguf in module.GGUF_ARCHITECTURES}
# Model types whose GGUF files are filed under another architecture: naming them explicitly is not a conflict.
WIDENS: dict[str, tuple[str, ...]] = {arch: module.STORED_AS for arch, module in _MODULES.items() if hasattr(module, "STORED_AS")}

PRESETS_DIR = Path(__file__).resolve().parent / "configs"


def list_architectures() -> list[str]:
    return list(ARCHITECTURES)


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset_config(name: str) -> dict[str, Any] | None:
    """The HF config dict of a preset (or of an architecture's flagship preset), or None."""
    name = FLAGSHIP_PRESETS.get(name, name)
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def architecture_module(model_type: str) -> ModuleType:
    arch = MODEL_TYPES.get(model_type)
    if arch is None:
        known = ", ".join(sorted(MODEL_TYPES))
        raise ConfigError(f"unknown architecture '{model_type}' (supported model_type values: {known})")
    return _MODULES[arch]


def gguf_architecture_module(gguf_architecture: str) -> ModuleType:
    """The module that translates a GGUF file of this `general.architecture` (a key of GGUF_ARCHITECTURES)."""
    return _MODULES[GGUF_ARCHITECTURES[gguf_architecture]]


def _compatible(model_type: str, wanted: str) -> bool:
    return MODEL_TYPES[model_type] == MODEL_TYPES[wanted] or model_type in WIDENS.get(wanted, ())


def model_type_for_name(name: str) -> str | None:
    """The HF model_type a user-typed `--model` name stands for (architecture, HF type or preset)."""
    if name in MODEL_TYPES:
        return name
    config = preset_config(name)
    return None if config is None else config.get("model_type")


def known_model_type(name: str) -> str:
    """The HF model_type of a user-typed `--model` name, or a ConfigError listing the known names."""
    model_type = model_type_for_name(name)
    if model_type is None:
        raise ConfigError(
            f"unknown model '{name}' (architectures: {', '.join(ARCHITECTURES)}; "
            f"presets: {', '.join(list_presets())})"
        )
    return model_type


def config_from_hf(hf: dict[str, Any], model: str | None = None, source: str = "config.json") -> ModelConfig:
    """ModelConfig from an HF config dict; `model` may name the architecture explicitly.

    The dict is validated first (lmcli.config.validate_hf_config); `source` names it in errors.
    """
    from lmcli.config import validate_hf_config

    model_type = validate_hf_config(hf, source).get("model_type")
    if model is not None:
        wanted = known_model_type(model)
        if model_type in MODEL_TYPES and not _compatible(model_type, wanted):
            raise ConfigError(
                f"--model {model} is a {MODEL_TYPES[wanted]} model but the checkpoint's config "
                f"says model_type '{model_type}'"
            )
        if model_type in WIDENS.get(wanted, ()):
            model_type = wanted  # e.g. a mistral GGUF, which llama.cpp files under "llama"
        if model_type not in MODEL_TYPES:
            model_type = wanted  # an unusual model_type, named explicitly by the user
    if model_type is None:
        raise ConfigError("config.json has no model_type; pass --model to name the architecture")
    module = architecture_module(model_type)
    try:
        return module.config_from_hf({**hf, "model_type": model_type})
    except ConfigError as error:  # the architectures say "config:"; name the actual file
        message = str(error)
        for generic in ("config: ", "config.json: "):
            if message.startswith(generic):
                raise ConfigError(f"{source}: {message[len(generic):]}") from None
        raise
