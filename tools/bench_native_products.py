"""Native kernels against torch's per product, on SmolLM2's shapes (one layer after QKV and gate+up are
joined, and the int8 head), 1 thread, medians of 5 interleaved rounds:

    PYTHONPATH=. python tools/bench_native_products.py
"""

from __future__ import annotations

import statistics
import time

import torch

from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels.matmul import build_kernel

SHAPES = [(960, 576, 4), (576, 576, 4), (3072, 576, 4), (576, 1536, 4), (49152, 576, 8)]  # (N, K, bits)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    kernels = {}
    for n, k, bits in SHAPES:
        q = GroupQuantized.quantize(torch.randn(n, k) * 0.05, bits)
        kernels[n, k, bits] = {name: build_kernel(name, q, torch.bfloat16) for name in ("native", "int4pack")}
    seconds: dict[tuple, list[float]] = {}
    for _ in range(5):
        for m in (1, 8, 256):
            x = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
            for shape, pair in kernels.items():
                for name, kernel in pair.items():
                    reps = max(1, int(3e7 / (shape[0] * shape[1] * m))) if m < 256 else 1
                    kernel.matmul(x[shape[1]])
                    start = time.perf_counter()
                    for _ in range(reps):
                        kernel.matmul(x[shape[1]])
                    seconds.setdefault((m, shape, name), []).append((time.perf_counter() - start) / reps)
    for (m, (n, k, bits), name), values in sorted(seconds.items()):
        t = statistics.median(values)
        print(f"M={m:3d} N={n:5d} K={k:4d} int{bits} {name:9s} {t * 1e6:9.1f} us  {n * k * bits / 8 / t / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
