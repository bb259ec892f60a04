"""`lmcli bench --sections speculative`: speculative decoding against plain greedy decoding.

For each model (the bench's model, and Gemma 3 270M where it is installed) and each prompt, plain
greedy, prompt lookup and (on the bench's model) a draft pairing decode the same number of tokens,
in turns (interleaved, so load from other processes falls on all alike). Reported: tokens/s of the
whole call (prefill included, the same for every method), its ratio to plain, the guesses kept
(acceptance) and whether the text is plain greedy's token for token.

Prompts are input-grounded (repeat a passage, summarise it, edit given code: the output copies the
input) or open-ended (nothing to look up). The draft pairing decodes the model's file requantised to
int8 (`--quantize int8`: twice the bytes a token, the slower target) with the file's own int4 weights
as its draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PASSAGE = ("The river rises in the northern hills, runs south through three small towns, and meets the sea at a "
           "wide muddy delta where fishermen have worked for centuries, mending their nets each winter and "
           "selling their catch at the market by the old stone bridge.")
CODE = ("def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n        total += item.price * "
        "item.quantity\n    return total * (1 + tax_rate)\n")
PROMPTS: list[tuple[str, str, str]] = [  # (label, kind, prompt)
    ("repeat", "grounded", f"Repeat this text exactly, word for word:\n\n{PASSAGE}"),
    ("summarise", "grounded", f"Summarise this text in one sentence, using its own words:\n\n{PASSAGE}"),
    ("edit code", "grounded", f"Rename the function total_price to order_total in this code and show all of it:"
                              f"\n\n{CODE}"),
    ("story", "open-ended", "Write a short story about a lighthouse keeper."),
    ("ideas", "open-ended", "Give me three ideas for a rainy weekend."),
]
K = 8


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    if tokenizer.chat_template:
        return list(tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def _timed(model: Any, ids: Any, new_tokens: int, eos: list[int], **extra: Any) -> tuple[float, list[int], Any]:
    from lmcli.generation.speculative import SpeculationStats

    stats = SpeculationStats()
    if extra:
        extra["stats"] = stats
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos or None, **extra)
    seconds = time.perf_counter() - start
    return seconds, out[0, ids.shape[1]:].tolist(), stats


def _measure_model(name: str, model: Any, tokenizer: Any, methods: dict[str, tuple[Any, dict]], new_tokens: int,
                   repeats: int, progress: Callable[[str], None], quick: bool) -> list[dict]:
    import torch

    rows = []
    for label, kind, prompt in [PROMPTS[0], PROMPTS[2], PROMPTS[3]] if quick else PROMPTS:
        ids = torch.tensor([_encode(tokenizer, prompt)])
        seconds: dict[str, float] = {}
        result: dict[str, Any] = {}
        for _ in range(repeats):
            for method, (target, extra) in methods.items():
                progress(f"speculative: {name}, {label} prompt, {method}")
                took, tokens, stats = _timed(target, ids, new_tokens, tokenizer.eos_token_ids, **dict(extra))
                seconds[method] = min(seconds.get(method, float("inf")), took)
                result[method] = (tokens, stats)
        for method, (target, _) in methods.items():
            tokens, stats = result[method]
            base = next(m for m, (t, e) in methods.items() if t is target and not e)  # plain, same weights
            rows.append({
                "model": name, "kind": kind, "prompt": label, "method": method, "tokens": len(tokens),
                "tok_s": len(tokens) / seconds[method],
                "speedup": seconds[base] / seconds[method] * len(tokens) / max(1, len(result[base][0])),
                "drafted": stats.drafted, "accepted": stats.accepted, "passes": stats.passes,
                "same_text": tokens == result[base][0],
            })
    return rows


def measure(settings: Any, resolved: Any, progress: Callable[[str], None]) -> dict:
    import lmcli
    from lmcli.errors import CheckpointError
    from lmcli.resolve.model_names import gemma_checkpoint_path

    quick = settings.repeats == 1
    new_tokens, repeats = (40, 1) if quick else (96, settings.repeats)
    model, tokenizer = lmcli.load(resolved, device=settings.device)
    name = resolved.path.name
    methods: dict[str, tuple[Any, dict]] = {"plain": (model, {}), "prompt lookup": (model, {"prompt_lookup": K})}
    target, _ = lmcli.load(resolved, device=settings.device, quantize="int8")
    methods["plain int8"] = (target, {})
    methods["int8 + int4 draft"] = (target, {"draft_model": model, "num_draft_tokens": 4})
    rows = _measure_model(name, model, tokenizer, methods, new_tokens, repeats, progress, quick)
    del target
    notes = []
    try:
        gemma_path = gemma_checkpoint_path()
    except CheckpointError as exc:
        notes.append(f"Gemma 3 skipped: {exc}")
    else:
        gemma, gemma_tokenizer = lmcli.load(gemma_path, device=settings.device)
        rows += _measure_model(gemma_path.name, gemma, gemma_tokenizer,
                               {"plain": (gemma, {}), "prompt lookup": (gemma, {"prompt_lookup": K})},
                               new_tokens, repeats, progress, quick)
    return {"new_tokens": new_tokens, "repeats": repeats, "num_draft_tokens": K, "rows": rows, "notes": notes}


def report(result: dict, console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"Speculative decoding, greedy, {result['new_tokens']} new tokens (K = "
                        f"{result['num_draft_tokens']} for prompt lookup, 4 for the draft)", title_justify="left")
    for column in ("model", "prompt", "method", "tok/s", "vs plain", "kept", "passes", "exact"):
        table.add_column(column, justify="right" if column in ("tok/s", "vs plain", "passes") else "left",
                         no_wrap=True)
    for row in result["rows"]:
        kept = f"{row['accepted']}/{row['drafted']}" if row["drafted"] else "-"
        table.add_row(row["model"][:14], f"{row['prompt']} ({row['kind']})", row["method"], f"{row['tok_s']:.1f}",
                      f"{row['speedup']:.2f}x", kept, str(row["passes"] or "-"), "yes" if row["same_text"] else "NO")
    console.print(table)
    console.print("vs plain: tokens/s against plain greedy on the same weights; exact: the text is its token for token",
                  style="dim")
    for note in result["notes"]:
        console.print(note, style="dim")
