"""Which kernel multiplies each quantized weight kind, and with which activation dtype.

By default (batch-invariant) the choice is a fixed function of the torch build, lmcli's native library
and device, never of timing: for the kinds in NATIVE_DEFAULT lmcli's own C++ kernel (`native`,
lmcli/native) where it builds and passes a probe, else torch's int4 kernel (int4pack for int4 weights, int4pair for int8 ones) where this build
has it and it passes a probe, else dequantise + F.linear; bfloat16 activations; the same kernel at every
row count, so a row's numbers do not depend on how many rows share its batch (`fixed_choice`).

With --fast-kernels (LMCLI_FAST_KERNELS=1) the candidates are measured on this machine once
(`measured_plan`), in a child process, cached on disk per CPU, torch version and thread count; that
plan may switch to dequantise + F.linear from some row count on, and two machines of one kind may
time their way to different kernels (different text).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmcli.config import dtype_name as _dtype_name
from lmcli.errors import first_line
from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels.matmul import Kernel, build_kernel
from lmcli.threads import signature

# --- choosing kernels by measurement ----------------------------------------------------------------


@dataclass
class KernelChoice:
    kind: str  # weight format: int4 or int8
    dtype: str  # activation dtype
    kernel: str  # for few rows (decode)
    large_rows: int | None  # from this many rows on: dequantise the layer, then F.linear
    why: str
    seconds: dict[str, float]  # measured: "<kernel>@<rows>" -> seconds per call

    def describe(self) -> str:
        large = f", dequantise + F.linear from {self.large_rows} rows" if self.large_rows else ""
        kernel = self.kernel
        if kernel == "native":  # which of its code paths runs here
            from lmcli import native

            kernel += f" [{native.describe()}]"
        return f"{self.kind} ({self.dtype}): {kernel}{large} — {self.why}"


PLAN_FORMAT = 3  # 3: measured in a child process (plans measured in-process under load were unreliable)
_PROBE_SHAPE = (1024, 1024)  # (N, K): 1M weights, big enough to time, small enough to do at load
_ROW_COUNTS = (1, 16, 64)


def _machine_key(device: torch.device) -> str:
    from lmcli.machine import cpu_model_and_flags

    cpu = cpu_model_and_flags()[0] or platform.processor() or platform.machine()
    if device.type == "cuda":
        cpu = torch.cuda.get_device_name(device)
    return (f"v{PLAN_FORMAT}|{device.type}|{cpu}|{torch.backends.cpu.get_cpu_capability()}|torch {torch.__version__}"
            f"|{signature()}")  # measured under the thread settings used: lmcli.threads


def _plan_file() -> Path:
    from lmcli.paths import cache_dir

    return cache_dir() / "kernels.json"


def _time_interleaved(calls: dict[str, Any], rounds: int = 5, round_seconds: float = 0.004) -> dict[str, float]:
    """Best seconds per call of each function, timed in turns so that load from other processes
    falls on all of them alike; the minimum over rounds resists that noise."""
    repeats = {}
    for name, fn in calls.items():
        fn()
        start = time.perf_counter()
        fn()
        repeats[name] = max(1, min(50, int(round_seconds / max(time.perf_counter() - start, 1e-6))))
    best = dict.fromkeys(calls, float("inf"))
    spent = dict.fromkeys(calls, 0.0)
    for _ in range(rounds):
        for name, fn in calls.items():
            if spent[name] > 0.2:  # a slow candidate is slow enough to tell after a round or two
                continue
            start = time.perf_counter()
            for _ in range(repeats[name]):
                fn()
            took = time.perf_counter() - start
            spent[name] += took
            best[name] = min(best[name], took / repeats[name])
    return best


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}.get(dtype, 2e-2)


# Weight kinds whose fixed choice tries the native kernel first: where it measured faster than torch's
# (docs/benchmarks.md, "Native kernels": int8, 1.3x at 1 row to 2.4x at 256 on the default model's head).
# For int4 it measured on par, so it stays opt-in there (LMCLI_KERNEL=native).
NATIVE_DEFAULT: tuple[str, ...] = ("int8",)


def _candidates(kind: str, device: torch.device, dtype: torch.dtype | None = None) -> list[str]:
    """Kernels to try, best first. `native` reads bfloat16 activations only (`dtype` None: any)."""
    has_int4 = hasattr(torch.ops.aten, "_weight_int4pack_mm" if device.type == "cuda" else "_weight_int4pack_mm_for_cpu")
    native = []
    if device.type == "cpu" and dtype in (None, torch.bfloat16):
        from lmcli import native as library

        if library.available_without_building() is not None:
            native = ["native"]
    return native + (["int4pack" if kind == "int4" else "int4pair"] if has_int4 else []) + ["dequantise"]


MEASURED_DTYPES = (torch.bfloat16, torch.float32)  # compared against each other in one run


@torch.inference_mode()
def measure(kind: str, device: torch.device, dtypes=MEASURED_DTYPES,
            shape: tuple[int, int] | None = None) -> dict[str, KernelChoice]:
    """Time each candidate kernel for `kind` weights with each activation dtype, all in one interleaved
    run (so the dtypes are compared under the same load); drop any candidate that fails or is wrong.
    Returns a choice per dtype name. `shape`: the probe weight's (N, K), `_PROBE_SHAPE` by default."""
    n, k = shape or _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen) * 0.05
    q = GroupQuantized.quantize(weight, 4 if kind == "int4" else 8)
    reference_weight = q.dequantise(torch.float32)
    rejected: dict[tuple, str] = {}
    kernels: dict[tuple, Kernel] = {}  # (dtype, kernel name) -> kernel
    for dtype in dtypes:
        for name in _candidates(kind, device, dtype):
            if name == "native" and _native_missing():
                continue
            try:
                kernel = build_kernel(name, q, dtype, device)
                x = torch.randn(4, k, generator=gen)
                got = kernel.matmul(x.to(device, dtype)).float().cpu()
                want = F.linear(x, reference_weight)
                error = ((got - want).abs().max() / want.abs().max()).item()
                if not error <= _tolerance(dtype):
                    rejected[dtype, name] = f"off by {error:.1e}"
                    continue
            except (RuntimeError, NotImplementedError, AttributeError) as exc:
                rejected[dtype, name] = first_line(exc)[:80]
                continue
            kernels[dtype, name] = kernel
    inputs = {(dtype, rows): torch.randn(rows, k, generator=gen).to(device, dtype)
              for dtype in dtypes for rows in _ROW_COUNTS}
    calls = {}
    for (dtype, name), kernel in kernels.items():
        for rows in _ROW_COUNTS:
            x = inputs[dtype, rows]
            calls[f"{_dtype_name(dtype)}:{name}@{rows}"] = lambda k=kernel, x=x: k.matmul(x)
            if rows > 1 and name != "dequantise" and kernel.dequantise() is not None:
                calls[f"{_dtype_name(dtype)}:{name}+expand@{rows}"] = lambda k=kernel, x=x: F.linear(x, k.dequantise())
    seconds = _time_interleaved(calls)
    fastest_decode = min((seconds[f"{_dtype_name(d)}:{n}@1"], _dtype_name(d)) for d, n in kernels)
    choices = {}
    for dtype in dtypes:
        label = _dtype_name(dtype)
        mine = {key.split(":", 1)[1]: value for key, value in seconds.items() if key.startswith(f"{label}:")}
        names = [name for d, name in kernels if d == dtype]
        if not names:
            continue
        best = min(names, key=lambda name: mine[f"{name}@1"])
        others = [f"{name} {mine[f'{best}@1'] / mine[f'{name}@1']:.2f}x" for name in names if name != best]
        why = f"fastest at 1 row ({', '.join(others) or 'only candidate'} its speed)"
        if label != fastest_decode[1]:
            why += f"; {fastest_decode[1]} activations decode {mine[f'{best}@1'] / fastest_decode[0]:.1f}x faster"
        gone = [f"{name} ({reason})" for (d, name), reason in rejected.items() if d == dtype]
        if gone:
            why += "; not used: " + ", ".join(gone)
        large_rows = None
        for rows in _ROW_COUNTS[1:]:
            if mine.get(f"{best}+expand@{rows}", float("inf")) < mine[f"{best}@{rows}"]:
                large_rows = rows
                why += f"; from {rows} rows dequantise + F.linear is faster"
                break
        choices[label] = KernelChoice(kind, label, best, large_rows, why, mine)
    return choices


FAST_KERNELS_ENV = "LMCLI_FAST_KERNELS"  # "1": the measured, not batch-invariant plan (--fast-kernels)


def fast_kernels() -> bool:
    """Whether --fast-kernels (or LMCLI_FAST_KERNELS=1) asked for the measured plan."""
    return os.environ.get(FAST_KERNELS_ENV, "") not in ("", "0")


def fixed_choice(kind: str, dtype: torch.dtype, device: torch.device) -> KernelChoice:
    """The batch-invariant choice: torch's int4 kernel where it exists and passes a small probe
    against F.linear on the dequantised weight, else dequantise; one kernel at every row count.

    On the CPU the probe runs once per machine (cached with the measured plans) in a child process, so a
    loading process does not keep the resident memory of kernels it probed."""
    return _fixed_choice(kind, dtype, device, _plan_file())


# Kept per plans file: a process that moves to another lmcli cache (LMCLI_CACHE_DIR) reads that cache's plans.
@functools.cache
def _fixed_choice(kind: str, dtype: torch.dtype, device: torch.device, path: Path) -> KernelChoice:
    if device.type != "cpu":
        return _probe_fixed(kind, dtype, device)
    from lmcli import native

    machine = _machine_key(device)
    # The native library's key: a new build (or a failed one) is probed again.
    entry = f"fixed|{kind}|{_dtype_name(dtype)}"
    if kind in NATIVE_DEFAULT:
        entry += f"|native={native.available_without_building()}"
    stored = _read_plans(path)
    try:
        known = KernelChoice(**stored[machine][entry])
        if (known.kind, known.dtype, known.large_rows) == (kind, _dtype_name(dtype), None) and \
                known.kernel in (*_candidates(kind, device, dtype), "dequantise"):
            return known  # else a damaged or foreign entry: probe again
    except (KeyError, TypeError):
        pass
    fields = _in_child("_fixed_for_parent", [kind, _dtype_name(dtype)])
    try:
        choice = KernelChoice(**fields) if isinstance(fields, dict) else _probe_fixed(kind, dtype, device)
    except TypeError:
        choice = _probe_fixed(kind, dtype, device)
    stored.setdefault(machine, {})[entry] = asdict(choice)
    _write_plans(path, stored)
    return choice


def _fixed_for_parent() -> None:
    """The child's side of `fixed_choice`: arguments kind and activation dtype."""
    import sys

    kind, dtype = sys.argv[1:]
    print(json.dumps(asdict(_probe_fixed(kind, getattr(torch, dtype), torch.device("cpu")))))


def _probe_fixed(kind: str, dtype: torch.dtype, device: torch.device) -> KernelChoice:
    gen = torch.Generator().manual_seed(0)
    q = GroupQuantized.quantize(torch.randn(128, 256, generator=gen) * 0.05, 4 if kind == "int4" else 8)
    x = torch.randn(3, 256, generator=gen)
    why = (f"{_dtype_name(dtype)} activations, fixed for {device.type} {torch.backends.cpu.get_cpu_capability()}, "
           f"torch {torch.__version__}")
    for name in _candidates(kind, device, dtype):
        if name == "native" and (kind not in NATIVE_DEFAULT or _native_missing()):
            continue
        try:
            got = build_kernel(name, q, dtype, device).matmul(x.to(device, dtype)).float().cpu()
        except (RuntimeError, NotImplementedError, AttributeError):
            continue
        want = F.linear(x, q.dequantise())
        if ((got - want).abs().max() / want.abs().max()).item() <= _tolerance(dtype):
            return KernelChoice(kind, _dtype_name(dtype), name, None, f"{why} (batch-invariant)", {})
    return KernelChoice(kind, _dtype_name(dtype), "dequantise", None, f"{why} (batch-invariant)", {})


def kernel_plan(kind: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> KernelChoice:
    """The kernel for `kind` weights and `dtype` activations: `fixed_choice`, or with --fast-kernels
    `measured_plan`. LMCLI_KERNEL=<name> forces a kernel (for tests and comparisons)."""
    device = torch.device(device)
    forced = os.environ.get("LMCLI_KERNEL")
    if forced:
        if forced not in ("int4pack", "int4pair", "dequantise", "native"):
            from lmcli.errors import UsageError

            raise UsageError(f"LMCLI_KERNEL={forced}: unknown kernel (use native, int4pack, int4pair or dequantise)")
        if forced == "native" and (device.type != "cpu" or dtype != torch.bfloat16 or _native_missing()):
            why = "forced by LMCLI_KERNEL=native, which cannot run here: torch's kernel"
            return KernelChoice(kind, _dtype_name(dtype), "int4pack" if kind == "int4" else "int4pair", None, why, {})
        if forced not in ("dequantise", "native"):
            forced = "int4pack" if kind == "int4" else "int4pair"
        return KernelChoice(kind, _dtype_name(dtype), forced, None, "forced by LMCLI_KERNEL", {})
    return measured_plan(kind, dtype, device) if fast_kernels() else fixed_choice(kind, dtype, device)


def _native_missing() -> bool:
    """Whether lmcli's native library cannot be had (building it first if it was never tried)."""
    from lmcli import native

    return native.library() is None


def measured_plan(kind: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> KernelChoice:
    """The measured choice for `kind` weights and `dtype` activations on this machine (cached on disk).

    LMCLI_REMEASURE=1 measures again.
    """
    device = torch.device(device)
    dtypes = MEASURED_DTYPES if dtype in MEASURED_DTYPES else (dtype,)
    return _cached_plans(kind, dtypes, device, _plan_file())[_dtype_name(dtype)]


@functools.cache  # per plans file, as _fixed_choice
def _cached_plans(kind: str, dtypes: tuple[torch.dtype, ...], device: torch.device,
                  path: Path) -> dict[str, KernelChoice]:
    machine = _machine_key(device)
    entry = f"{kind}|{','.join(map(_dtype_name, dtypes))}"
    stored = _read_plans(path)
    known = stored.get(machine, {}).get(entry)
    if isinstance(known, dict) and not os.environ.get("LMCLI_REMEASURE") and not _worth_measuring_again(known):
        try:
            return {label: KernelChoice(**fields) for label, fields in known.items() if label != _LOAD_KEY}
        except TypeError:
            pass
    choices = (_measure_apart(kind, dtypes) if device.type == "cpu" else None) or measure(kind, device, dtypes)
    stored.setdefault(machine, {})[entry] = {**{label: asdict(choice) for label, choice in choices.items()},
                                             _LOAD_KEY: _load_average()}
    _write_plans(path, stored)
    return choices


def _read_plans(path: Path) -> dict[str, Any]:
    """The plans file by machine key; empty when it is missing or not what lmcli writes."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) and all(isinstance(v, dict) for v in stored.values()) else {}


def _write_plans(path: Path, stored: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        from lmcli.io.atomic import write_atomically

        write_atomically(path, json.dumps(stored, indent=1) + "\n")
    except OSError:
        pass  # a read-only cache only means measuring again next time


_LOAD_KEY = "load_average"  # of the machine when a plan was measured


def _load_average() -> float:
    """Runnable processes per CPU over the last minute (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def _worth_measuring_again(known: dict[str, Any]) -> bool:
    """A plan measured while other work crowded the CPUs (more runnable processes than CPUs) is
    measured again once the machine is quiet: timings under contention can rank kernels wrongly, as a
    plan measured at a load of about 5 per CPU here once picked float32 activations for int8 weights,
    25x slower than bfloat16."""
    then = known.get(_LOAD_KEY, 0.0)
    return isinstance(then, (int, float)) and then > 1.0 and _load_average() < 0.5


def _measure_apart(kind: str, dtypes: tuple[torch.dtype, ...]) -> dict[str, KernelChoice] | None:
    """`measure` in a child process with this one's thread count; None if that fails (the caller then
    measures here). Its probe matrices and timing loops peak at about 80 MB, which a loading
    process would otherwise keep as resident memory it never uses again."""
    fields = _in_child("_measure_for_parent", [kind, str(torch.get_num_threads()), *map(str, _PROBE_SHAPE),
                                               *map(_dtype_name, dtypes)])
    try:
        return {label: KernelChoice(**value) for label, value in fields.items()} if isinstance(fields, dict) else None
    except (TypeError, AttributeError):
        return None


def _in_child(function: str, args: list[str]) -> Any:
    """The JSON that this module's `function` prints in a child process run with `args`; None on failure."""
    import subprocess
    import sys

    import lmcli

    code = f"from lmcli.kernels.plan import {function}; {function}()"
    package_root = str(Path(lmcli.__file__).resolve().parents[1])  # the same lmcli as this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                                env=env)
        return json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _measure_for_parent() -> None:
    """The child's side of `_measure_apart`: arguments kind, threads, probe rows and columns, dtypes."""
    import sys

    kind, threads, rows, columns, *dtypes = sys.argv[1:]
    torch.set_num_threads(int(threads))
    choices = measure(kind, torch.device("cpu"), tuple(getattr(torch, name) for name in dtypes), (int(rows), int(columns)))
    print(json.dumps({label: asdict(choice) for label, choice in choices.items()}))


def preferred_dtype(kind: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The activation dtype for quantized weights: bfloat16 (batch-invariant default, and on CUDA);
    with --fast-kernels the one whose best kernel for `kind` weights is fastest at one row (decode)."""
    device = torch.device(device)
    if device.type == "cuda" or not fast_kernels():
        return torch.bfloat16
    timings = {}
    for dtype in MEASURED_DTYPES:
        choice = kernel_plan(kind, dtype, device)  # measured, or forced by LMCLI_KERNEL
        timings[dtype] = choice.seconds.get(f"{choice.kernel}@1", float("inf"))
    if all(t == float("inf") for t in timings.values()):  # forced kernels: nothing measured
        return torch.bfloat16 if kind == "int4" else torch.float32
    return min(timings, key=lambda d: timings[d])
