"""`lmcli bench --sections lora`: what LoRA adapters (kernels/lora.py) cost in decode speed.

On the model the bench resolved (by default the embedded int4 one, where adapters run beside the
kernels, unmerged), with random rank-16 adapters on every q/k/v/o and gate/up/down projection, written
as PEFT directories in a scratch folder:

- batch 1: the model without adapters against the same model with one adapter (the target: at most 15%
  slower);
- batch 8: 8 rows all with one adapter against 8 rows with 4 different adapters, 2 rows each, in one
  batch (the target: at least 0.8x the speed).

Greedy, each run timed from its first to its last token (the prefill excluded), the runs compared in
turns (round by round, each configuration once a round) so that load from other processes falls on all
alike; the medians over the rounds are reported.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from lmcli.bench.settings import BenchSettings
    from lmcli.resolve.model_ref import ResolvedModel

RANK = 16
ADAPTERS = 4
PROMPT = "Write a short story about a lighthouse keeper."
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(directory: Path, config: Any, rank: int = RANK, seed: int = 0) -> Path:
    """A PEFT adapter directory of random rank-`rank` updates on every projection of `config`'s model."""
    import json

    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    hidden, inner = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (inputs, outputs) in shapes.items():
            where = "self_attn" if name in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) / inputs**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
         "task_type": "CAUSAL_LM"}))
    return directory


def _decode(model: Any, ids: Any, steps: int, choices: Sequence[str | None]) -> float:
    """Tokens a second between the first and the last token of a greedy run, the rows' adapters `choices`."""
    import torch

    from lmcli.kernels import lora

    times: list[float] = []
    with torch.inference_mode(), lora.routed(lora.routing_for(model, choices)):
        model.generate(ids, max_new_tokens=steps, do_sample=False, ignore_output=True,
                       on_token=lambda event: times.append(time.perf_counter()))
    return (len(times) - 1) * ids.shape[0] / (times[-1] - times[0])


def measure(settings: BenchSettings, resolved: ResolvedModel, progress: Callable[[str], None]) -> dict[str, Any]:
    import torch

    from lmcli.kernels import lora
    from lmcli.loading import load

    progress("lora: loading the model twice (without and with adapters)")
    base, tokenizer = load(resolved)
    adapted, _ = load(resolved)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-lora-") as scratch:
        paths = [str(write_random_adapter(Path(scratch) / f"a{i}", adapted.config, seed=i)) for i in range(ADAPTERS)]
        loaded = lora.attach(adapted, paths, merge=False)
    assert loaded is not None
    prompt = tokenizer.encode(PROMPT) if tokenizer is not None else list(range(3, 35))
    steps = max(settings.new_tokens, 32)
    one = torch.tensor([prompt])
    eight = torch.tensor([prompt] * 8)
    mixed = [loaded.names[i // 2] for i in range(8)]  # 2 rows per adapter
    runs: dict[str, Callable[[], float]] = {
        "b1_base": lambda: _decode(base, one, steps, [None]),
        "b1_one": lambda: _decode(adapted, one, steps, [loaded.names[0]]),
        "b8_one": lambda: _decode(adapted, eight, steps, [loaded.names[0]] * 8),
        "b8_four": lambda: _decode(adapted, eight, steps, mixed),
    }
    for run in runs.values():  # warm-up: first-call costs (allocations, kernel set-up) out of the timings
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    rounds = max(3, settings.repeats)
    for round_ in range(rounds):
        progress(f"lora: round {round_ + 1} of {rounds}")
        for name, run in runs.items():
            rates[name].append(run())
    medians = {name: statistics.median(values) for name, values in rates.items()}
    bases: list[Any] = [m.base for m in adapted.modules() if isinstance(m, lora.LoraLinear)]
    kinds = sorted({str(base.kernel.name) for base in bases if hasattr(base, "kernel")})
    return {"model": resolved.path.name, "rank": RANK, "adapters": ADAPTERS, "steps": steps, "rounds": rounds,
            "torch_threads": torch.get_num_threads(), "beside": ", ".join(kinds) or "float weights",
            **{f"tok_s_{name}": round(value, 1) for name, value in medians.items()},
            "b1_cost": round(1 - medians["b1_one"] / medians["b1_base"], 3),
            "b8_ratio": round(medians["b8_four"] / medians["b8_one"], 3),
            "all_rounds": {name: [round(v, 1) for v in values] for name, values in rates.items()}}


def report(result: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    table = Table(title=f"LoRA · {result['model']} · rank {result['rank']} on q/k/v/o/gate/up/down, beside "
                        f"{result['beside']} · greedy, {result['steps']} steps · median of {result['rounds']} "
                        f"interleaved rounds · {result['torch_threads']} torch threads")
    for column in ("case", "tok/s", "against", "tok/s", "figure", "target"):
        table.add_column(column, justify="right")
    table.add_row("batch 1, one adapter", f"{result['tok_s_b1_one']:.1f}", "no adapter",
                  f"{result['tok_s_b1_base']:.1f}", f"{result['b1_cost']:.1%} slower", "<= 15%")
    table.add_row(f"batch 8, {result['adapters']} adapters", f"{result['tok_s_b8_four']:.1f}", "one adapter",
                  f"{result['tok_s_b8_one']:.1f}", f"{result['b8_ratio']:.2f}x", ">= 0.8x")
    console.print(table)
