"""Eager int4 kernel against inductor's lowering of the same int4 linear (torch.compile, max-autotune, freezing).

    PYTHONPATH=. python tools/compiled_int4.py N K [ROWS,...] [--threads T] [--cpp-only]

For a random (N, K) weight packed as lmcli packs it (kernels/matmul.py Int4PackKernel, bfloat16
activations), compiles the one linear at each row count (static shapes), then reports per row count:
the build time, what inductor's autotuner chose (its own log lines), eager and compiled ms per call
(interleaved calls, medians), whether compiled equals eager bit for bit, and whether a row's output is
the same alone as in a batch (batch invariance) for eager and for compiled. `--cpp-only` leaves the
autotuner no choice but inductor's C++ micro-GEMM (WoQ int4: AMX where the CPU has it, else
AVX-512), to see that kernel's numbers even where it loses. Builds take minutes on two busy cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor_config

from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels.matmul import Int4PackKernel


class _Linear(torch.nn.Module):
    def __init__(self, kernel: Int4PackKernel):
        super().__init__()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.matmul(x)  # (M, K) -> (M, N)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("rows", nargs="?", default="256,17,1")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cpp-only", action="store_true")
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    inductor_config.freezing = True
    if args.cpp_only:
        inductor_config.max_autotune_gemm_backends = "CPP"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, AMX tiles: {amx}, "
          f"threads {args.threads}")
    generator = torch.Generator().manual_seed(0)
    q = GroupQuantized.quantize(torch.randn(args.n, args.k, generator=generator) * 0.05, 4)
    module = _Linear(Int4PackKernel(q, torch.bfloat16)).eval()
    rows = [int(r) for r in args.rows.split(",")]
    x = torch.randn(max(rows), args.k, generator=generator).to(torch.bfloat16)
    compiled, eager, outputs = {}, {}, {}
    with torch.inference_mode():
        for m in rows:
            start = time.perf_counter()
            compiled[m] = torch.compile(module, mode="max-autotune", dynamic=False)
            outputs[m] = compiled[m](x[:m])
            print(f"M={m}: built in {time.perf_counter() - start:.1f} s", flush=True)
            eager[m] = module(x[:m])
        for m in rows:
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(args.calls):
                for name, fn in (("eager", module), ("compiled", compiled[m])):
                    start = time.perf_counter()
                    fn(x[:m])
                    times[name].append(time.perf_counter() - start)
            same = torch.equal(outputs[m], eager[m])
            difference = (outputs[m].float() - eager[m].float()).abs().max().item()
            print(f"M={m}: eager {statistics.median(times['eager']) * 1e3:.3f} ms, compiled "
                  f"{statistics.median(times['compiled']) * 1e3:.3f} ms; compiled == eager: {same} "
                  f"(max difference {difference:.3g})")
        largest = max(rows)
        for m in rows:
            if m != largest:
                print(f"rows 0..{m - 1} alone vs in {largest}: eager {torch.equal(eager[m], eager[largest][:m])}, "
                      f"compiled {torch.equal(outputs[m], outputs[largest][:m])}")


if __name__ == "__main__":
    main()
