"""`lmcli bench`: generation speed of lmcli and of transformers, side by side, in the same run.

Both generate greedily from the same random prompt with the same weights and no EOS, so they do the
same work; the table also says whether their tokens agree. Decode speed is reported as tokens/s
and as the weight bytes it streams per second, the figure that bounds single-row decoding.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _reference_model(checkpoint: Path, dtype: torch.dtype, device: torch.device):
    """transformers' model for the same checkpoint, or (None, reason)."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed (pip install transformers accelerate)"
    transformers.logging.set_verbosity_error()
    if checkpoint.suffix == ".gguf":
        kwargs = dict(gguf_file=checkpoint.name)
        directory = checkpoint.parent
    elif checkpoint.is_dir():
        kwargs, directory = {}, checkpoint
    else:
        return None, "transformers needs an HF directory or a .gguf file"
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    model.generation_config.eos_token_id = None  # always generate the full length, as lmcli is asked to
    return model.to(device).eval(), None  # type: ignore[arg-type]  # transformers' stubs type `to` as a decorator


def _measure(generate_n, max_new_tokens: int, rows: int, prompt_tokens: int, repeats: int):
    """(prefill tokens/s, decode tokens/s, tokens) from best-of-`repeats` timings."""
    generate_n(1)  # warm-up: allocators, kernels, lazy initialisation
    first = min(_timed(lambda: generate_n(1)) for _ in range(repeats))
    output = None

    def full():
        nonlocal output
        output = generate_n(max_new_tokens)

    total = min(_timed(full) for _ in range(repeats))
    decode_seconds = max(total - first, 1e-9)
    return rows * prompt_tokens / first, rows * (max_new_tokens - 1) / decode_seconds, output


def main(checkpoint: str | None = None, model: str | None = None, device: str = "auto", dtype: str = "auto",
         max_new_tokens: int = 32, batch_size: int = 1, prompt_tokens: int = 32, repeats: int = 2,
         reference: bool = True, quantize: str | None = None) -> dict:
    from rich.console import Console
    from rich.table import Table

    import lmcli
    from lmcli.loading import resolve_device, resolve_dtype

    console = Console(file=sys.stdout)
    from lmcli.default_model import default_checkpoint_path

    path = Path(checkpoint) if checkpoint is not None else default_checkpoint_path()
    torch_device = resolve_device(device)
    ours, _ = lmcli.load(path, model=model, dtype=dtype, device=torch_device, quantize=quantize)
    torch_dtype = ours.dtype if dtype == "auto" else resolve_dtype(dtype, torch_device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, ours.config.vocab_size, (batch_size, prompt_tokens), generator=generator).to(torch_device)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())

    results = {}
    with torch.inference_mode():
        results["lmcli"] = _measure(
            lambda n: ours.generate(prompt, n, False), max_new_tokens, batch_size, prompt_tokens, repeats)
        ours = None  # free its memory before the reference model loads
        note = "skipped (reference=False)" if not reference else None
        if reference:
            ref, note = _reference_model(path, torch_dtype, torch_device)
            if ref is not None:
                mask = torch.ones_like(prompt)
                results["transformers"] = _measure(
                    lambda n: ref.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                           do_sample=False, pad_token_id=0),
                    max_new_tokens, batch_size, prompt_tokens, repeats)

    table = Table(title=f"{path.name} · {torch_device.type} · {str(torch_dtype).removeprefix('torch.')} · "
                        f"batch {batch_size} · prompt {prompt_tokens} · {max_new_tokens} new tokens")
    for column in ("implementation", "prefill tok/s", "decode tok/s", "weights streamed GB/s"):
        table.add_column(column, justify="left" if column == "implementation" else "right")
    for name, (prefill, decode, _) in results.items():
        table.add_row(name, f"{prefill:,.0f}", f"{decode:,.1f}", f"{weight_bytes * decode / batch_size / 1e9:,.1f}")
    console.print(table)
    if "transformers" in results:
        same = torch.equal(results["lmcli"][2].cpu(), results["transformers"][2].cpu())
        speedup = results["lmcli"][1] / results["transformers"][1]
        console.print(f"greedy tokens identical: {'yes' if same else 'no'} · decode speed vs transformers: {speedup:.2f}x")
    else:
        console.print(f"transformers: {note}")
    return {name: {"prefill_tokens_per_s": r[0], "decode_tokens_per_s": r[1]} for name, r in results.items()}
