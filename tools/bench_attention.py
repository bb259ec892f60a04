"""Prefill tokens/s of a model at several prompt lengths, the native attention kernel against the torch
row calls (models/native_attention.py, row_attention.py), interleaved in one process: each round runs
every length on each path in turn, so a busy machine slows both alike. Prints medians.

    PYTHONPATH=. python tools/bench_attention.py [CHECKPOINT] [--lengths 256,1024,2048,4096] [--rounds 3]

A prefill is `generate(prompt, 1)` of a random prompt at batch 1 (the first token's time), after one
warm-up of each path at the shortest length. Used for docs/benchmarks.md's "Attention".
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import lmcli
from lmcli.models import native_attention


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--lengths", default="256,1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", default="torch,native")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: lmcli's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    paths = args.paths.split(",")
    model, _ = lmcli.load(args.checkpoint)
    print(f"{args.checkpoint or 'the default model'}: dtype {model.dtype}, batch-invariant {model.batch_invariant}, "
          f"CPU {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), threads {torch.get_num_threads()}, "
          f"native kernel: {native_attention.describe()}")

    def use(path: str) -> None:
        if path == "torch":
            os.environ["LMCLI_ATTENTION"] = "torch"
        else:
            os.environ.pop("LMCLI_ATTENTION", None)

    rates: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for path in paths:  # warm-up
            use(path)
            model.generate(torch.randint(3, 1000, (1, lengths[0])), 1, False)
        for round_ in range(args.rounds):
            for length in lengths:
                prompt = torch.randint(3, model.config.vocab_size, (1, length),
                                       generator=torch.Generator().manual_seed(length))
                for path in paths if round_ % 2 == 0 else paths[::-1]:
                    use(path)
                    start = time.perf_counter()
                    model.generate(prompt, 1, False)
                    seconds = time.perf_counter() - start
                    rates.setdefault((path, length), []).append(length / seconds)
                    print(f"round {round_ + 1} {path:6s} {length:5d} tokens: {seconds:7.2f} s, "
                          f"{length / seconds:6.1f} tok/s", flush=True)
    use("native")
    print("\n| prompt tokens | " + " | ".join(f"{p} tok/s (median)" for p in paths) + " |")
    print("|---|" + "---|" * len(paths))
    for length in lengths:
        print(f"| {length} | " + " | ".join(f"{statistics.median(rates[(p, length)]):.1f}" for p in paths) + " |")
    for p in paths:
        print(f"{p}: {lengths[-1]} tokens at {statistics.median(rates[(p, lengths[-1])]) / statistics.median(rates[(p, lengths[0])]):.2f}x "
              f"the {lengths[0]}-token rate")


if __name__ == "__main__":
    main()
