"""`lmcli bench --sections beams`: beam search with 4 beams against greedy decoding on the same model.

One prompt, the same number of new tokens for every method (EOS is not given, so no run stops early;
the lengths are checked), timed in turns (interleaved, so load from other processes falls on all alike),
the whole `model.generate` call (one prefill each). The methods:

  greedy       batch 1: the cost beam search is compared with (the target: 4 beams at most 4.5x its time)
  greedy b4    the prompt 4 times, batch 4: the same rows per forward pass as 4 beams, without the search
  4 beams      model.generate(num_beams=4): one batched pass over the 4 beams per step

"4 beams / greedy" is the figure the target is about; "4 beams / greedy b4" is what the search itself
(top-k over beams x vocabulary, hypotheses, the cache's rows reordered each step) adds to a batch of 4.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from lmcli.bench.settings import BenchSettings
    from lmcli.resolve.model_ref import ResolvedModel

PROMPT = "The old lighthouse keeper climbed the stairs each evening and"
BEAMS = 4
TARGET = 4.5  # the most 4 beams may cost, in greedy decode's time
METHODS = ("greedy", "greedy b4", "4 beams")


def _timed(model: Any, ids: Any, new_tokens: int, **extra: Any) -> tuple[float, int]:
    """Seconds of one whole generate call and the new tokens of its (first) output row."""
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, **extra)
    seconds = time.perf_counter() - start
    # An encoder-decoder's output is the decoder's text: its start token, then the new tokens.
    before = 1 if getattr(model.config, "is_encoder_decoder", False) else ids.shape[1]
    return seconds, out.shape[1] - before


def run_methods(model: Any, prompt_ids: list[int], new_tokens: int, repeats: int,
                progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Each method's seconds per round (interleaved), the new tokens each made, and the ratios of the
    fastest rounds."""
    import torch

    one = torch.tensor([prompt_ids])  # [1, T]
    calls: dict[str, tuple[Any, dict[str, Any]]] = {
        "greedy": (one, {}), "greedy b4": (one.repeat(BEAMS, 1), {}), "4 beams": (one, {"num_beams": BEAMS})}
    seconds: dict[str, list[float]] = {name: [] for name in METHODS}
    made: dict[str, int] = {}
    for round_ in range(repeats):
        for name in METHODS:
            progress(f"beams: round {round_ + 1} of {repeats}, {name}")
            ids, extra = calls[name]
            took, made[name] = _timed(model, ids, new_tokens, **extra)
            seconds[name].append(took)
    best = {name: min(values) for name, values in seconds.items()}
    return {
        "new_tokens": made,
        "seconds": {name: [round(s, 4) for s in values] for name, values in seconds.items()},
        "best_s": {name: round(s, 4) for name, s in best.items()},
        "tok_s": {name: round(made[name] / best[name], 2) for name in METHODS},  # of the output's first row
        "ratio_to_greedy": round(best["4 beams"] / best["greedy"], 3),
        "ratio_to_greedy_b4": round(best["4 beams"] / best["greedy b4"], 3),
        "equal_lengths": len(set(made.values())) == 1 and made["greedy"] == new_tokens,
    }


def measure(settings: BenchSettings, resolved: ResolvedModel, progress: Callable[[str], None]) -> dict[str, Any]:
    import torch

    from lmcli.loading import load

    progress("beams: loading the model")
    model, tokenizer = load(resolved)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    prompt_ids = tokenizer.encode(PROMPT) if tokenizer is not None else list(range(1, 9))
    figures = run_methods(model, list(prompt_ids), settings.new_tokens, settings.repeats, progress)
    return {"model": resolved.path.name, "prompt_tokens": len(prompt_ids), "num_beams": BEAMS,
            "max_new_tokens": settings.new_tokens, "repeats": settings.repeats, "target": TARGET,
            "torch_threads": torch.get_num_threads(), **figures}


def report(result: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    table = Table(title=f"beam search · {result['model']} · {result['prompt_tokens']}-token prompt, "
                        f"{result['max_new_tokens']} new tokens (no EOS) · fastest of {result['repeats']} "
                        f"interleaved · {result['torch_threads']} torch threads", title_justify="left")
    for column in ("method", "new tokens", "seconds", "tok/s (a row)", "vs greedy"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name in METHODS:
        ratio = result["best_s"][name] / result["best_s"]["greedy"]
        table.add_row(name, str(result["new_tokens"][name]), f"{result['best_s'][name]:.3f}",
                      f"{result['tok_s'][name]:.1f}", f"{ratio:.2f}x")
    console.print(table)
    verdict = "within" if result["ratio_to_greedy"] <= result["target"] else "OVER"
    console.print(f"{result['num_beams']} beams cost {result['ratio_to_greedy']:.2f}x greedy decoding ({verdict} the "
                  f"target of {result['target']}x) and {result['ratio_to_greedy_b4']:.2f}x greedy at batch "
                  f"{result['num_beams']}; whole generate calls, one prefill each"
                  + ("" if result["equal_lengths"] else "; LENGTHS DIFFER"), highlight=False)
