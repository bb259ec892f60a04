"""`lmcli bench --sections structured`: decode speed with and without a JSON Schema, and the time to
build each step's token masks (lmcli.generation.constraints).

Greedy, at each of the bench's batch sizes, on the model the bench resolved. Each round decodes with the
schema twice, with the masks built after each forward pass (the default) and beside it on a thread
(ConstraintMask's `overlap`), then without the schema for as many steps as the schema's run made, so all
three decode equally many steps. The ratio is constrained tok/s over unconstrained tok/s (the target is
at least 0.9).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from lmcli.bench.settings import BenchSettings
    from lmcli.resolve.model_ref import ResolvedModel

PROMPT = "Describe a person as JSON."
# Five fields, a nested object and a bounded array: a typical extraction target.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                                     "city": {"type": "string", "maxLength": 30}},
                    "required": ["street", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
MODES = ("after", "overlap")  # masks built after the forward pass (the default), or beside it


def _decode(model: Any, ids: Any, steps: int, processors: list) -> tuple[float, int]:
    """Seconds between the first and the last token of a greedy run (the prefill excluded), and the
    steps in between."""
    import torch

    times: list[float] = []
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=steps, do_sample=False, logits_processors=processors,
                       on_token=lambda event: times.append(time.perf_counter()), ignore_output=True)
    return times[-1] - times[0], len(times) - 1


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def measure(settings: BenchSettings, resolved: ResolvedModel, progress: Callable[[str], None]) -> dict[str, Any]:
    import torch

    from lmcli.generation.constraints import Constraint, ConstraintMask
    from lmcli.loading import load

    progress("structured: loading the model")
    model, tokenizer = load(resolved)
    if tokenizer is None:
        raise ValueError(f"{resolved.path}: structured output needs the model's tokenizer")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    vocab = model.config.vocab_size
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.encode_chat(messages) if tokenizer.chat_template else tokenizer.encode(PROMPT)
    constraint = Constraint.parse("json_schema", SCHEMA)
    started = time.perf_counter()
    ConstraintMask(tokenizer, [constraint], vocab)  # builds (and keeps) the engine's view of the tokenizer
    setup = time.perf_counter() - started

    batches: dict[str, Any] = {}
    for batch in settings.batch_sizes:
        ids = torch.tensor([prompt] * batch)
        rates: dict[str, list[float]] = {"none": [], **{mode: [] for mode in MODES}}
        build: dict[str, list[float]] = {mode: [] for mode in MODES}
        blocked: dict[str, list[float]] = {mode: [] for mode in MODES}
        steps = settings.structured_tokens
        for round_ in range(settings.repeats):
            progress(f"structured: batch {batch}, round {round_ + 1} of {settings.repeats}")
            made = steps
            for mode in MODES:
                mask = ConstraintMask(tokenizer, [constraint] * batch, vocab, overlap=mode == "overlap")
                seconds, made = _decode(model, ids, steps, [mask])
                rates[mode].append(made * batch / seconds)
                build[mode] += mask.mask_seconds[1:]  # the first is the prompt's, before any decode step
                blocked[mode] += mask.blocked_seconds[1:]
            seconds, made_free = _decode(model, ids, made + 1, [])
            rates["none"].append(made_free * batch / seconds)
        medians = {name: statistics.median(values) for name, values in rates.items()}
        batches[str(batch)] = {
            "decode_steps": made,
            "tok_s_unconstrained": round(medians["none"], 1),
            **{f"tok_s_{mode}": round(medians[mode], 1) for mode in MODES},
            **{f"ratio_{mode}": round(medians[mode] / medians["none"], 3) for mode in MODES},
            **{f"mask_ms_p{p}_{mode}": round(_percentile(build[mode], p / 100) * 1e3, 3)
               for mode in MODES for p in (50, 99)},
            **{f"blocked_ms_p{p}_{mode}": round(_percentile(blocked[mode], p / 100) * 1e3, 3)
               for mode in MODES for p in (50, 99)},
        }
    return {"model": str(resolved.path.name), "schema_fields": len(SCHEMA["properties"]),
            "tokenizer_setup_s": round(setup, 3), "repeats": settings.repeats,
            "torch_threads": torch.get_num_threads(), "batches": batches}


def report(result: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    table = Table(title=f"structured output · {result['model']} · greedy, a {result['schema_fields']}-field JSON "
                        f"Schema · median of {result['repeats']} · {result['torch_threads']} torch threads")
    for column in ("batch", "steps", "tok/s none", "tok/s schema", "ratio", "mask p50 ms", "mask p99 ms",
                   "tok/s overlapped", "ratio overlapped", "waited p50 ms overlapped"):
        table.add_column(column, justify="right")
    for batch, figures in result["batches"].items():
        table.add_row(batch, str(figures["decode_steps"]), f"{figures['tok_s_unconstrained']:.1f}",
                      f"{figures['tok_s_after']:.1f}", f"{figures['ratio_after']:.2f}x",
                      f"{figures['mask_ms_p50_after']:.2f}", f"{figures['mask_ms_p99_after']:.2f}",
                      f"{figures['tok_s_overlap']:.1f}", f"{figures['ratio_overlap']:.2f}x",
                      f"{figures['blocked_ms_p50_overlap']:.2f}")
    console.print(table)
    console.print(f"the engine's tokenizer: built in {result['tokenizer_setup_s']:.2f} s · mask: feeding the "
                  "tokens and building every row's mask, per step · overlapped: masks built on a thread beside "
                  "the forward pass; waited: what a step still waited for them and spent applying them",
                  highlight=False)
