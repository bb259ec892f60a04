"""Batch- and chunk-invariant attention in a small C++ kernel (csrc/attention.cpp), loaded with ctypes.

A query's output there is an online softmax over its own keys in blocks of 32 counted from its first
key, each operation in a fixed order, on one thread: the same numbers whatever the chunk it is prefilled
in, the batch, or the thread count, by construction; and its cost is that of its own keys (linear
memory, no per-query call). The kernel is built the first time it is needed, with the system's g++
for this CPU's instruction set (AVX-512, AVX2 or plain), into lmcli's cache directory, keyed by the
source's hash; a failed build is recorded there once and not retried, and attention then takes the
torch path of models/row_attention.py. `LMCLI_ATTENTION=torch` forces that path;
`LMCLI_ATTENTION_ISA=avx512|avx2|generic` forces a build (for tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "attention.cpp"
ISA_FLAGS = {
    "avx512": ["-march=x86-64-v4", "-mprefer-vector-width=512"],
    "avx2": ["-march=x86-64-v3"],
    "generic": [],
}
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_loaded: dict[str, ctypes.CDLL | None] = {}


@cache
def _cpu_flags() -> frozenset[str]:
    from lmcli.machine import cpu_model_and_flags

    return frozenset(cpu_model_and_flags()[1])


def supported_isas() -> list[str]:
    """The builds this CPU can run, best first."""
    flags = _cpu_flags()
    isas = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        isas.append("avx512")
    if {"avx2", "fma", "bmi2"} <= flags:
        isas.append("avx2")
    return [*isas, "generic"]


def isa() -> str | None:
    """The build in use: an ISA name, or None where attention takes the torch path."""
    if os.environ.get("LMCLI_ATTENTION", "").lower() == "torch":
        return None
    forced = os.environ.get("LMCLI_ATTENTION_ISA")
    choice = forced if forced in supported_isas() else supported_isas()[0]
    return choice if _library(choice) is not None else None


def describe() -> str:
    """One line for `lmcli info` / `bench`: which attention path runs."""
    name = isa()
    return f"native ({name})" if name else "torch (row calls)"


def _library(name: str) -> ctypes.CDLL | None:
    if name not in _loaded:
        _loaded[name] = _build_and_load(name)
    return _loaded[name]


def _flags(name: str) -> list[str]:
    return ["-O3", *ISA_FLAGS[name], "-fopenmp", "-shared", "-fPIC", "-Wno-psabi"]


def build_paths(name: str) -> tuple[Path, Path]:
    """(the library, the record of a failed build) for ISA `name`, keyed by the source and the flags."""
    from lmcli.paths import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_flags(name)).encode()).hexdigest()[:16]
    directory = cache_dir() / "native"
    return directory / f"attention-{key}-{name}.so", directory / f"attention-{key}-{name}.failed"


def _build_and_load(name: str) -> ctypes.CDLL | None:
    from lmcli.io.atomic import atomic_file, write_atomically

    try:
        target, failed = build_paths(name)
    except OSError:  # no source beside the package
        return None
    directory, flags = target.parent, _flags(name)
    if failed.exists():
        return None
    if not target.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with atomic_file(target) as temporary:
                run = subprocess.run(["g++", *flags, "-o", str(temporary), str(SOURCE)],
                                     capture_output=True, text=True, timeout=300)
                if run.returncode:
                    write_atomically(failed, run.stderr[-4000:] or f"g++ exited {run.returncode}\n")
                    raise OSError("build failed")
        except (OSError, subprocess.SubprocessError) as error:
            if not failed.exists():
                with contextlib.suppress(OSError):
                    write_atomically(failed, f"{type(error).__name__}: {error}\n")
            return None
    try:
        library = ctypes.CDLL(str(target))
        if library.lmcli_attention_version() != 1:
            raise OSError("unexpected version")
    except (OSError, AttributeError) as error:  # a damaged file: record it once, take the torch path
        with contextlib.suppress(OSError):
            write_atomically(failed, f"load failed: {error}\n")
        return None
    library.lmcli_attend.restype = ctypes.c_int
    return library


@dataclass(frozen=True)
class NativePlan:
    """Which keys each query reads: `keys` [B, L] each row's key indices (into the layer's keys) in slot
    order, `first` and `end` [B, T]: query t of row b reads keys[b, first:end] (end <= first: a pad)."""

    keys: torch.Tensor
    first: torch.Tensor
    end: torch.Tensor


def plan(key_slots: torch.Tensor, query_slots: torch.Tensor, slot_is_token: torch.Tensor,
         window: int | None) -> NativePlan:
    """key_slots [S] (-1 empty), query_slots [T], slot_is_token [B, S_total] -> the plan; one per layer type."""
    slots, queries, is_token = key_slots.cpu(), query_slots.cpu(), slot_is_token.cpu()
    big = torch.iinfo(torch.long).max
    valid = (slots >= 0)[None] & is_token[:, slots.clamp(min=0)]  # (B, S)
    ordered = torch.where(valid, slots[None], big)  # (B, S)
    ordered, order = torch.sort(ordered, dim=-1, stable=True)  # slot order; a row's empty columns last
    B, T = is_token.shape[0], queries.numel()
    wanted = queries[None].expand(B, T).contiguous()  # (B, T)
    end = torch.searchsorted(ordered, wanted, right=True)  # keys up to the query's slot
    if window is not None:
        first = torch.searchsorted(ordered, (wanted - window).contiguous(), right=True)  # the last `window`
    else:
        first = torch.zeros_like(end)
    real = is_token[:, queries]  # (B, T): a pad query reads nothing (output 0, never used)
    end = torch.where(real, end, first)
    return NativePlan(order.contiguous(), first.contiguous(), end.contiguous())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: NativePlan, scale: float,
           softcap: float | None) -> torch.Tensor | None:
    """q (B, nh, T, hd), k and v (B, nkv, S, hd) -> (B, T, nh * hd) in q's dtype; None where the kernel
    does not take these tensors (dtype, device, layout): the caller takes the torch path."""
    name = isa()
    if name is None or q.device.type != "cpu" or q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    library = _library(name)
    assert library is not None
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    out = torch.empty((B, T, nh * hd), dtype=q.dtype)
    keys, first, end = plan.keys, plan.first, plan.end  # int64, contiguous, on the CPU

    def strides(x: torch.Tensor) -> ctypes.Array:
        return (ctypes.c_int64 * 3)(*x.stride()[:3])

    status = library.lmcli_attend(
        ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(k.data_ptr()), ctypes.c_void_p(v.data_ptr()),
        ctypes.c_void_p(out.data_ptr()), ctypes.c_int(DTYPES[q.dtype]),
        ctypes.c_int64(B), ctypes.c_int64(T), ctypes.c_int64(nh), ctypes.c_int64(nkv), ctypes.c_int64(hd),
        strides(q), strides(k), strides(v),
        ctypes.c_void_p(keys.data_ptr()), ctypes.c_int64(keys.shape[1]),
        ctypes.c_void_p(first.data_ptr()), ctypes.c_void_p(end.data_ptr()),
        ctypes.c_float(scale), ctypes.c_float(softcap or 0.0), ctypes.c_int(torch.get_num_threads()))
    return out if status == 0 else None
