"""Native kernels against torch's on the default model, interleaved in one process, medians of rounds.

    PYTHONPATH=. python tools/bench_native_kernels.py [--rounds 5] [--new 32] [--threads N] [--prefill 256,1024]

Loads SmolLM2 (the embedded GGUF) twice: LMCLI_KERNEL=native and LMCLI_KERNEL=int4pack (torch's
int4pack / int4pair), then per round times, for each in turn: decode at batch 1 and 8 (tokens/s of
`generate` for --new tokens minus a 1-token run), and prefill of about 256 and 1024 tokens (a 1-token
`generate` on a random prompt). The machine is shared: compare the two in one round, not across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import lmcli
from lmcli.resolve.default_model import default_checkpoint_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: lmcli's choice)")
    parser.add_argument("--prefill", default="256,1024", help="prompt lengths to prefill")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = default_checkpoint_path()
    models = {}
    for name in ("native", "int4pack"):
        os.environ["LMCLI_KERNEL"] = name
        models[name] = lmcli.load(path, device="cpu")[0]
        print(name, models[name].weight_formats(), flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = models["native"].config.vocab_size
    prompts = {b: torch.randint(3, vocab, (b, 8), generator=gen) for b in (1, 8)}
    long = {n: torch.randint(3, vocab, (1, n), generator=gen) for n in map(int, filter(None, args.prefill.split(",")))}

    def timed(fn) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            fn()
        return time.perf_counter() - start

    figures: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, model in models.items():
            for b, ids in prompts.items():
                full = timed(lambda m=model, x=ids: m.generate(x, args.new + 1, False))
                one = timed(lambda m=model, x=ids: m.generate(x, 1, False))
                figures.setdefault(f"{name} decode batch {b} (tok/s)", []).append(b * args.new / max(full - one, 1e-9))
            for n, ids in long.items():
                took = timed(lambda m=model, x=ids: m.generate(x, 1, False))
                figures.setdefault(f"{name} prefill {n} (tok/s)", []).append(n / took)
        print({k: round(v[-1], 1) for k, v in figures.items()}, flush=True)
    print("medians over", args.rounds, "rounds, threads", torch.get_num_threads())
    for key, values in figures.items():
        print(f"  {key}: {statistics.median(values):.1f}  (range {min(values):.1f}-{max(values):.1f})")


if __name__ == "__main__":
    main()
