"""What `lmcli bench` measures: its settings, their defaults (those `lmcli bench --help` shows) and the
checks of the command line's values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmcli.bench.sections import DEFAULT_SECTIONS, SECTIONS
from lmcli.bench.synthetic import TEXT_PROMPTS
from lmcli.errors import UsageError

ENGINES = ("lmcli", "transformers", "llama.cpp")
MAX_BACKGROUND_LOAD = 256
FORMATS = ("float", "native", "int4", "int8")  # lmcli weight formats; "native" = the file's own quantization


@dataclass
class BenchSettings:
    """What to measure; the defaults are those shown by `lmcli bench --help`."""

    checkpoint: str | None = None
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"  # activation dtype of the float format (and transformers); auto = float32 on CPU
    engines: Sequence[str] = ENGINES
    formats: Sequence[str] = FORMATS
    prefill_tokens: int = 256
    prompt_tokens: int = 32  # the prompt before the decode runs
    new_tokens: int = 32
    batch_sizes: Sequence[int] = (1, 8)
    repeats: int = 3
    scaling_contexts: Sequence[int] = (128, 1024, 4096)
    scaling_batches: Sequence[int] = (1, 8, 32)
    scaling_tokens: int = 16
    quality: bool = True
    quality_prompts: int = len(TEXT_PROMPTS)
    quality_tokens: int = 32
    kl_tokens: int = 512
    threads: int | None = None  # default: lmcli's choice for the machine (lmcli.threads)
    background_load: int = 0  # busy loops spinning beside the engines in a second set of runs (0: none)
    sections: Sequence[str] = DEFAULT_SECTIONS  # lmcli.bench.sections: which parts of the bench run
    job_file: str | None = None  # bench_job: the job to run (default: LMCLI_BENCH_JOB, else its target job)
    job_rows: int = 48  # bench_job: rows of its target job
    structured_tokens: int = 128  # the most decode steps of a run with a JSON Schema (bench_structured)

    def quick(self) -> BenchSettings:
        """Less of everything: one round, no 4k context or batch 32, a shorter quality check."""
        self.repeats = 1
        self.new_tokens = min(self.new_tokens, 16)
        self.scaling_contexts = tuple(c for c in self.scaling_contexts if c <= 1024)
        self.scaling_batches = tuple(b for b in self.scaling_batches if b <= 8)
        self.quality_prompts = min(self.quality_prompts, 2)
        self.kl_tokens = min(self.kl_tokens, 128)
        self.job_rows = min(self.job_rows, 16)
        return self


def _names(value: str | Sequence[str], allowed: Sequence[str], option: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip()) if isinstance(value, str) else tuple(value)
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise UsageError(f"{option} {','.join(names) or repr('')}: choose from {', '.join(allowed)}")
    return names


def _sizes(value: str | Sequence[int], option: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(n) for n in value.split(",") if n.strip()) if isinstance(value, str) else tuple(value)
    except ValueError:
        raise UsageError(f"{option} {value!r}: expected comma-separated whole numbers, e.g. 1,8,32") from None
    if any(n < 1 for n in sizes):
        raise UsageError(f"{option} {value!r}: sizes must be at least 1")
    return sizes


def settings_from_options(checkpoint: str | None = None, *, engines: str | Sequence[str] | None = None,
                          formats: str | Sequence[str] | None = None, max_new_tokens: int | None = None,
                          batch_size: int | None = None, contexts: str | Sequence[int] | None = None,
                          scaling_batches: str | Sequence[int] | None = None,
                          sections: str | Sequence[str] | None = None, skip_quality: bool = False,
                          quick: bool = False, **options: Any) -> BenchSettings:
    """BenchSettings from `lmcli bench`'s options (names as on the command line), validated."""
    settings = BenchSettings(checkpoint=checkpoint, **options)
    if engines is not None:
        settings.engines = _names(engines, ENGINES, "--engines")
    if formats is not None:
        settings.formats = _names(formats, FORMATS, "--formats")
    if sections is not None:
        settings.sections = _names(sections, tuple(SECTIONS), "--sections")
    if max_new_tokens is not None:
        if max_new_tokens < 2:
            raise UsageError("--max-new-tokens must be at least 2: decode speed is timed between tokens")
        settings.new_tokens = max_new_tokens
    if batch_size is not None:
        settings.batch_sizes = tuple(dict.fromkeys((1, *_sizes([batch_size], "--batch-size"))))
    if contexts is not None:
        settings.scaling_contexts = _sizes(contexts, "--contexts")
    if scaling_batches is not None:
        settings.scaling_batches = _sizes(scaling_batches, "--scaling-batches")
    if not 0 <= settings.background_load <= MAX_BACKGROUND_LOAD:
        raise UsageError(f"--background-load {settings.background_load}: choose 0 to {MAX_BACKGROUND_LOAD} busy loops")
    settings.quality = settings.quality and not skip_quality
    return settings.quick() if quick else settings

