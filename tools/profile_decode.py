"""Where lmcli's decode time goes: torch.profiler over greedy decode steps, top ops by self CPU time.

    python tools/profile_decode.py [CHECKPOINT] [--quantize none|int4|int8] [--batch N] [--steps N]

Used for the profiles in the README's benchmark section (the targets not yet reached).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import lmcli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--quantize", default=None, help="none (float32), int4, int8; default: the file's own")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    model, _ = lmcli.load(args.checkpoint, quantize=args.quantize)
    prompt = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt),
                           generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.generate(prompt, 4, False)  # warm-up
        start = time.perf_counter()
        model.generate(prompt, args.steps, False)
        seconds = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.generate(prompt, args.steps, False)
    print(f"{args.steps} steps at batch {args.batch} (with a {args.prompt}-token prefill): {seconds:.2f} s unprofiled, "
          f"{args.batch * args.steps / seconds:.1f} tokens/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=48))


if __name__ == "__main__":
    main()
