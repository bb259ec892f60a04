"""Decode speed with and without a JSON Schema, and the time to build each step's token masks.

    python tools/bench_structured.py [--tokens 200] [--batch 1] [--repeats 3] [CHECKPOINT]

Greedy, on the default model unless a checkpoint is given. The unconstrained run is cut to the same
number of tokens as the constrained one, so both decode equally many steps; the ratio is
constrained tok/s over unconstrained tok/s (the target is >= 0.9). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import lmcli
from lmcli.generation.constraints import Constraint, ConstraintMask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
}


def decode(model, ids, steps: int, processors) -> tuple[float, int]:
    """Seconds for `steps` decode steps after the prefill (timed from the first token), and tokens made."""
    times: list[float] = []

    def on_token(event):
        times.append(time.perf_counter())

    with torch.inference_mode():
        model.generate(ids, max_new_tokens=steps, do_sample=False, logits_processors=processors,
                       on_token=on_token, ignore_output=True)
    return times[-1] - times[0], len(times) - 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = lmcli.load(args.checkpoint)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    ids = torch.tensor([prompt] * args.batch)
    constraint = Constraint.parse("json_schema", SCHEMA)
    started = time.perf_counter()
    ConstraintMask(tokenizer, [constraint], model.config.vocab_size)  # builds the engine's tokenizer once
    setup = time.perf_counter() - started

    free_rates, constrained_rates, mask_times = [], [], []
    for _ in range(args.repeats):
        mask = ConstraintMask(tokenizer, [constraint] * args.batch, model.config.vocab_size)
        seconds, made = decode(model, ids, args.tokens, [mask])
        constrained_rates.append(made * args.batch / seconds)
        mask_times += mask.mask_seconds[1:]  # the first is the prompt's, before any decode step
        seconds_free, made_free = decode(model, ids, made + 1, [])
        free_rates.append(made_free * args.batch / seconds_free)
    free, constrained = statistics.median(free_rates), statistics.median(constrained_rates)
    mask_times.sort()
    print(json.dumps({
        "model": model.config.model_type, "batch": args.batch, "decode_steps": made,
        "tokenizer_setup_s": round(setup, 3),
        "tok_s_unconstrained": round(free, 1), "tok_s_json_schema": round(constrained, 1),
        "ratio": round(constrained / free, 3),
        "mask_us_p50": round(mask_times[len(mask_times) // 2] * 1e6, 1),
        "mask_us_p99": round(mask_times[min(len(mask_times) - 1, int(len(mask_times) * 0.99))] * 1e6, 1),
        "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
