"""Where a prefill and a decode step spend their time: torch.profiler over each, the time split into
the int4 matrix kernel, other matrix products, attention, the other aten ops, and what lies outside
every op (Python and dispatch).

    PYTHONPATH=. python tools/profile_phases.py [CHECKPOINT] [--synthetic-1b] [--prefill 256] [--steps 16]
                                                [--compile] [--threads T]

Prefill: one `generate(..., max_new_tokens=1)` of a random PREFILL-token prompt at batch 1 (the first
token's time). Decode: STEPS greedy steps after a 32-token prompt, timed and profiled from the first
token on (the profiler starts in `on_token`). Each phase runs once to warm up, once timed, once
profiled. The parts are of the profiled run: each op's self time on the main thread, the profiler's
own cost (the ops recorded times its cost per op, measured on a loop of tiny adds), and "outside
ops", what is left: Python and dispatch between ops. The unprofiled time is printed beside it.
Used for the README's "Compiled prefill chunks; what holds issue 17's targets back".
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import lmcli

INT4 = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int4pack_mm")
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm", "aten::linear", "aten::matmul")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
             "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention")


def profiler_cost_per_op() -> float:
    """Seconds the profiler adds to each op it records: a loop of tiny adds, timed with it and without."""
    a, b = torch.ones(1), torch.ones(1)
    n = 20000
    spans = []
    for profiled in (False, True, False, True):
        with profile(activities=[ProfilerActivity.CPU]) if profiled else _nothing():
            start = time.perf_counter()
            for _ in range(n):
                torch.add(a, b)
            spans.append(time.perf_counter() - start)
    return max(0.0, (min(spans[1::2]) - min(spans[0::2])) / n)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def split(prof: Any, wall: float, per_op: float) -> dict[str, float]:
    """Seconds of each part of `wall` (the profiled run's time), and the number of op calls."""
    parts: dict[str, float] = defaultdict(float)
    others: dict[str, float] = {}
    calls = 0
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        name = event.key
        if name in INT4:
            part = "int4 kernel"
        elif name in MATMUL:
            part = "other matrix products"
        elif name in ATTENTION:
            part = "attention kernel"
        elif name.startswith(("aten::", "inductor", "torch_")) or "::" in name:
            part = "other ops"
            others[name] = seconds
        else:  # the profiler's own spans (ProfilerStep, record_function): not op time
            continue
        parts[part] += seconds
        calls += event.count
    parts["the profiler's own cost (calls x its cost per op)"] = calls * per_op
    parts["outside ops (Python, dispatch)"] = max(0.0, wall - sum(parts.values()))
    parts["calls"] = calls
    largest = sorted(others.items(), key=lambda item: -item[1])[:6]
    print("largest other ops: " + ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in largest))
    return dict(parts)


def report(title: str, unprofiled: float, profiled: float, parts: dict[str, float], tokens: int) -> None:
    print(f"\n{title}: {unprofiled:.3f} s unprofiled ({tokens / unprofiled:.1f} tok/s), {profiled:.3f} s profiled, "
          f"{int(parts.pop('calls'))} op calls")
    print("| part | ms per token | share of the profiled run |\n| --- | --- | --- |")
    for part, seconds in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"| {part} | {seconds / tokens * 1e3:.2f} | {seconds / profiled:.0%} |")


def prefill(model: Any, length: int, per_op: float) -> None:
    prompt = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    model.generate(prompt, 1, False)  # warm-up
    start = time.perf_counter()
    model.generate(prompt, 1, False)
    unprofiled = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        model.generate(prompt, 1, False)
        profiled = time.perf_counter() - start
    report(f"prefill of {length} tokens, batch 1", unprofiled, profiled, split(prof, profiled, per_op), length)


def decode(model: Any, steps: int, per_op: float) -> None:
    prompt = torch.randint(3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    model.generate(prompt, 4, False)  # warm-up (and a compiled step's build or load)
    marks: dict[str, float] = {}
    prof = profile(activities=[ProfilerActivity.CPU])

    def timed(event: Any, profiled: bool) -> None:
        if event.step == 0:
            if profiled:
                prof.start()
            marks["start"] = time.perf_counter()

    model.generate(prompt, steps + 1, False, on_token=lambda event: timed(event, False))
    unprofiled = time.perf_counter() - marks["start"]
    model.generate(prompt, steps + 1, False, on_token=lambda event: timed(event, True))
    profiled = time.perf_counter() - marks["start"]
    prof.stop()
    report(f"decode, {steps} steps at batch 1 after 32 tokens", unprofiled, profiled, split(prof, profiled, per_op), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--synthetic-1b", action="store_true", help="the synthetic 1.04B Q4_0 llama (bench_models)")
    parser.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill (0: none)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps (0: none)")
    parser.add_argument("--compile", action="store_true", help="the compiled programs (model.compile_decode())")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    checkpoint = args.checkpoint
    if args.synthetic_1b:
        from lmcli.bench.synthetic import synthetic_llama_gguf

        checkpoint = synthetic_llama_gguf()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = lmcli.load(checkpoint)
    if args.compile:
        model.compile_decode()
    print(f"{checkpoint or 'the default model'}: dtype {model.dtype}, torch {torch.__version__}, "
          f"CPU {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()} at the start")
    with torch.inference_mode():
        per_op = profiler_cost_per_op()
        print(f"the profiler's own cost: {per_op * 1e6:.2f} us per op recorded")
        if args.prefill:
            prefill(model, args.prefill, per_op)
        if args.steps:
            decode(model, args.steps, per_op)
    print(f"\nthreads at the end: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
