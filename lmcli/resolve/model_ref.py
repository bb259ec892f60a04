"""A model resolved once: what `-c`/`-m`/`--tokenizer` name, found and checked in one place.

`resolve_model` turns the three flags into a `ResolvedModel`: the checkpoint's path (found by name
in lmcli's models, the packaged models or the HF hub cache, or the embedded default), its kind,
where its config and tokenizer come from, and, read on first use, the model's own sampling
defaults and its one fingerprint. Every command builds one and hands it on: the settings take its
defaults, loading its path and config source, a job and its resume its identity, a chat transcript
its path and fingerprint, `info` all of it. Nothing else resolves a name or checks the path again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcli.errors import CheckpointError, ConfigError, UsageError

if TYPE_CHECKING:
    from lmcli.settings.model_defaults import ModelDefaults

KINDS = ("hf", "safetensors", "gguf")  # an HF directory, a lone .safetensors file, a .gguf file


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the checkpoint: an HF directory, a .safetensors file or a .gguf file (it exists)
    kind: str  # one of KINDS
    origin: str  # how it was found: "checkpoint" (-c), "name" (-m alone) or "default" (the embedded model)
    name: str | None = None  # --model as given
    check_as: str | None = None  # the architecture or preset its config must match (None: trust the config)
    # The config a preset supplies (a lone .safetensors file, a directory without config.json); None: its own.
    preset: dict[str, Any] | None = field(default=None, compare=False)
    tokenizer_path: Path | None = None  # --tokenizer, in place of the checkpoint's own

    @property
    def config_source(self) -> str:
        """Where the config comes from, as errors and `info` name it."""
        if self.preset is not None:
            return f"preset {self.check_as}"
        if self.kind == "gguf":
            return str(self.path)
        return str(self.checkpoint_dir / "config.json")

    @property
    def checkpoint_dir(self) -> Path:
        """The directory whose config.json, tokenizer and generation_config.json belong to the checkpoint."""
        return self.path if self.kind == "hf" else self.path.parent

    @property
    def tokenizer_source(self) -> Path:
        """The tokenizer's files: --tokenizer's, a GGUF file's own vocabulary, else the checkpoint's directory."""
        if self.tokenizer_path is not None:
            return self.tokenizer_path
        return self.path if self.kind == "gguf" else self.checkpoint_dir

    @functools.cached_property
    def defaults(self) -> ModelDefaults:
        """The sampling defaults the model ships (generation_config.json, or a GGUF's general.sampling.*)."""
        from lmcli.settings.model_defaults import read_model_defaults

        return read_model_defaults(self.path)

    @functools.cached_property
    def fingerprint(self) -> str:
        """The content fingerprint of what loads: weights, config (or preset), tokenizer."""
        from lmcli.io.fingerprint import checkpoint_fingerprint

        return checkpoint_fingerprint(self.path, self.tokenizer_path, self.preset)

    @property
    def label(self) -> str:
        """The name a job row records: --model's, else the checkpoint's file name, else the default's."""
        from lmcli.resolve.model_names import DEFAULT_MODEL

        if self.name is not None:
            return self.name
        return DEFAULT_MODEL if self.origin == "default" else self.path.name

    def identity(self) -> dict[str, str]:
        """What a job row records of the model ({"name", "fingerprint"}); resume compares it."""
        return {"name": self.label, "fingerprint": self.fingerprint}

    def record(self) -> dict[str, str]:
        """What a chat transcript records of the model: the checkpoint loaded and its fingerprint."""
        return {"checkpoint": str(self.path), "fingerprint": self.fingerprint}

    def described(self) -> str:
        """The checkpoint and how it was found, as `info` shows it."""
        if self.origin == "name":
            return f"{self.path} (found for --model {self.name})"
        if self.origin == "default":
            return f"{self.path} (the embedded default model)"
        return str(self.path)


def resolve_model(checkpoint: str | Path | None = None, model: str | None = None,
                  tokenizer_path: str | Path | None = None) -> ResolvedModel:
    """The model `-c CHECKPOINT`, `-m MODEL` and `--tokenizer` name, found and checked.

    Without a checkpoint, `model` is looked up on this machine (see model_names), and a hub REF that is
    not there is downloaded (see hub; never with --offline / HF_HUB_OFFLINE=1); without either, the
    embedded default. Raises CheckpointError for a path that does not exist or is no checkpoint,
    UsageError/ConfigError for a config that nothing supplies.
    """
    if checkpoint is None and model is not None:
        from lmcli.resolve import hub

        # lmcli's models, the packages, the HF hub cache; a hub REF not on disk is downloaded (lmcli.resolve.hub)
        path, check_as = hub.resolve_name(model)
        origin = "name"
    elif checkpoint is None:
        from lmcli.resolve.default_model import default_checkpoint_path

        path, check_as, origin = default_checkpoint_path(), None, "default"
    else:
        path, check_as, origin = Path(checkpoint).expanduser(), model, "checkpoint"
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    kind, preset = _kind_and_preset(path, check_as)
    tokenizer = Path(tokenizer_path).expanduser() if tokenizer_path is not None else None
    return ResolvedModel(path, kind, origin, model, check_as, preset, tokenizer)


def _kind_and_preset(path: Path, check_as: str | None) -> tuple[str, dict[str, Any] | None]:
    """The checkpoint's kind, and the preset config it is loaded with (None: its own config.json).

    A .gguf file carries its config. A directory has its config.json, or else --model's preset.
    A lone .safetensors file takes --model's preset when one is named, else the config.json beside it.
    """
    from lmcli import registry

    if path.suffix == ".gguf":
        return "gguf", None
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", None
        preset = registry.preset_config(check_as) if check_as is not None else None
        if preset is None:
            raise CheckpointError(f"{path}: no config.json (pass --model with a preset name to supply one)")
        return "hf", preset
    if path.suffix == ".safetensors":
        if check_as is not None:
            preset = registry.preset_config(check_as)
            if preset is None:
                raise ConfigError(f"unknown model '{check_as}' (presets: {', '.join(registry.list_presets())})")
            return "safetensors", preset
        if not (path.parent / "config.json").is_file():
            raise UsageError(f"{path}: a single .safetensors file needs --model NAME (a preset) to supply its config")
        return "safetensors", None
    raise CheckpointError(f"{path}: not a checkpoint (expected an HF directory, a .safetensors or a .gguf file)")
