"""What this CPU's matrix kernels reach at prefill sizes: GFLOPS of the eager int4 kernel lmcli calls
(`Int4PackKernel`, bfloat16 activations) against dense bfloat16 and float32 `F.linear` on the same
weights dequantised, and the time to dequantise them to bfloat16.

    PYTHONPATH=. python tools/gemm_rates.py [N K] [--rows 64,128,256] [--calls 5]

Interleaved calls, medians. The dense rows say what a prefill could reach by dequantising a layer's
weights once per chunk (the dequantising time is then spread over the chunk's rows).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels.matmul import Int4PackKernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="?", default=8192)
    parser.add_argument("k", type=int, nargs="?", default=2048)
    parser.add_argument("--rows", default="64,128,256")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(args.n, args.k, generator=generator) * 0.05
    q = GroupQuantized.quantize(weight, 4)
    kernel = Int4PackKernel(q, torch.bfloat16)
    dense32 = q.dequantise(torch.float32)  # (N, K)
    dense16 = dense32.to(torch.bfloat16)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {torch.get_num_threads()}, weight {args.n} x {args.k}")
    with torch.inference_mode():
        for m in [int(r) for r in args.rows.split(",")]:
            x16 = torch.randn(m, args.k, generator=generator).to(torch.bfloat16)
            x32 = x16.float()
            runs: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = {
                "int4 kernel (eager)": (kernel.matmul, x16),  # (M, K) -> (M, N)
                "bfloat16 F.linear": (lambda x: F.linear(x, dense16), x16),
                "float32 F.linear": (lambda x: F.linear(x, dense32), x32),
            }
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.calls):
                for name, (fn, x) in runs.items():
                    start = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - start)
            flops = 2 * m * args.n * args.k
            print(f"rows {m}: " + "; ".join(f"{name} {statistics.median(t) * 1e3:.1f} ms "
                                             f"({flops / statistics.median(t) / 1e9:.0f} GFLOPS)"
                                             for name, t in times.items()))
        spans = []
        for _ in range(args.calls):
            start = time.perf_counter()
            q.dequantise(torch.bfloat16)
            spans.append(time.perf_counter() - start)
        print(f"dequantising the weight to bfloat16 (eager, GroupQuantized.dequantise): "
              f"{statistics.median(spans) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
