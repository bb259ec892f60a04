"""GenerationSettings: everything that decides a completion besides the prompt and the model.

Built from command-line flags (`from_flags`, errors name the flag) or a job row's overrides
(`for_row`, errors name the field), and validated on creation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcli.errors import UsageError

DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_TEMPERATURE = 0.8
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed

# How each setting is named to the user, on the command line and in a JSONL row.
FLAG_NAMES = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "repetition_penalty": "--repetition-penalty",
    "seed": "--seed",
    "stop": "--stop",
    "system": "--system",
    "logprobs": "--logprobs",
}
class RowError(ValueError):
    """A problem with one input row; it becomes that row's `error` and the job goes on."""


@dataclass(frozen=True)
class GenerationSettings:
    """Everything that decides a completion besides the prompt and the model. Validated on creation."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE  # 0 means greedy (argmax)
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None  # as given; rows without one draw their own
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    chat: bool = False
    system: str | None = None
    logprobs: int | None = None  # how many alternatives per token; None = no logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_flags(cls, *, greedy: bool = False, temperature: float | None = None, **values) -> GenerationSettings:
        """Settings from command-line flags; raises UsageError naming the flag."""
        if greedy and temperature not in (None, 0):
            raise UsageError(f"--greedy and --temperature {temperature:g} contradict each other; pick one")
        if temperature is None:
            temperature = 0.0 if greedy else DEFAULT_TEMPERATURE
        if values.get("system") is not None and not values.get("chat"):
            raise UsageError("--system only applies with --chat")
        values["stop"] = tuple(values.get("stop") or ())
        settings = cls(temperature=float(temperature), **values)
        settings.check(lambda name: FLAG_NAMES[name], UsageError)
        return settings

    def for_row(self, row: dict) -> GenerationSettings:
        """These settings with a JSONL row's overrides; raises RowError naming the field."""
        changes: dict[str, Any] = {}
        for name in ("seed", "max_new_tokens", "top_k"):
            if name in row:
                changes[name] = _row_int(row, name)
        if "temperature" in row:
            changes["temperature"] = float(_row_number(row, "temperature"))
        if "top_p" in row:
            changes["top_p"] = float(_row_number(row, "top_p"))
        if "top_k" in row or "top_p" in row:
            # Truncation comes from the row as a whole, or it would clash with a flag.
            changes.setdefault("top_k", None)
            changes.setdefault("top_p", None)
        elif changes.get("temperature") == 0:
            changes.update(top_k=None, top_p=None)  # a greedy row drops the flags' truncation
        if "stop" in row:
            stop = row["stop"]
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise RowError('"stop" must be a string or a list of strings')
            changes["stop"] = tuple(stop)
        if "system" in row:
            if not isinstance(row["system"], str):
                raise RowError('"system" must be a string')
            if not self.chat:
                raise RowError('"system" only applies with --chat')
            changes["system"] = row["system"]
        settings = dataclasses.replace(self, **changes)
        settings.check(lambda name: f'"{name}"', RowError)
        return settings

    def check(self, name: Callable[[str], str], error: type[Exception]) -> None:
        """Raise `error` with one line saying which setting is wrong and why."""
        if self.max_new_tokens < 1:
            raise error(f"{name('max_new_tokens')} must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise error(f"{name('temperature')} must be >= 0 (0 means greedy), got {self.temperature:g}")
        if self.top_k is not None and self.top_k < 1:
            raise error(f"{name('top_k')} must be at least 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise error(f"{name('top_p')} must be in (0, 1], got {self.top_p:g}")
        if self.top_k is not None and self.top_p is not None:
            raise error(f"{name('top_k')} and {name('top_p')} cannot be used together; pick one")
        if self.greedy and (self.top_k is not None or self.top_p is not None):
            which = name("top_k") if self.top_k is not None else name("top_p")
            raise error(f"{which} only applies to sampling, not greedy decoding")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise error(f"{name('repetition_penalty')} must be > 0 (1 means none), got {self.repetition_penalty:g}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise error(f"{name('seed')} must be between 0 and 2**63-1, got {self.seed}")
        if any(s == "" for s in self.stop):
            raise error(f"{name('stop')} must not be an empty string")
        if self.logprobs is not None and self.logprobs < 0:
            raise error(f"{name('logprobs')} must be >= 0, got {self.logprobs}")

    def batch_key(self) -> tuple:
        """The settings that every row of one `model.generate` call must share."""
        return (self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.ignore_eos)


def _row_int(row: dict, name: str) -> int:
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise RowError(f'"{name}" must be an integer, got {json.dumps(value)}')
    return value


def _row_number(row: dict, name: str) -> float:
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RowError(f'"{name}" must be a number, got {json.dumps(value)}')
    return value


def input_hash(prompt: Any, settings: GenerationSettings) -> str:
    """A fingerprint of what decides a row's result, so resume can tell if the input changed."""
    payload = json.dumps(
        {"prompt": prompt, "settings": dataclasses.asdict(settings)}, sort_keys=True, ensure_ascii=False
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
