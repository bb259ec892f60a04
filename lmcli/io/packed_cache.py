"""A GGUF model as loaded, kept on disk: its packed kernels and float tensors, mapped back at the next start.

Loading a quantized GGUF decodes every block, packs the codes for the int4 kernel and joins each
layer's projections; that is most of a start (measured on the default model: about 1 s of 1.3 s
after `import torch`). The result is the same for the same file, code and torch build, so after the
first load it is written here once (`save`) and later loads map it (`restore`): no copy is made, the
tensors are pages of the file.

An entry is one file, `<lmcli cache>/packed/<stem>-<key digest>.lmpk`:
  8 bytes magic, 8 bytes header length (little-endian), the JSON header, zero padding to 64 bytes,
  then each tensor's bytes (64-byte aligned) in the header's order.
The header holds the key (the file's fingerprint, lmcli's source code, torch's version, the CPU and the
kernel settings), the module tree, each kernel's settings, each tensor's dtype, shape and place, and a
CRC-32 of sampled pieces of the data. It is checked before anything is used: a stale or damaged entry
(wrong key, size, bounds, dtype, class or checksum) is deleted and the model is loaded from the GGUF
and written again. Entries are written through io/atomic.py, so a writer killed midway leaves only a
hidden temporary, and two writers each rename a complete file of their own.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmcli.errors import first_line

FORMAT = 1  # bump when the file layout or what the header means changes
MAGIC = b"LMCLIPK\x01"
ALIGN = 64
MAX_HEADER = 16 << 20  # a header claiming more is not one of ours
SAMPLE_BYTES = 1 << 16  # checksummed pieces: the first and last of every tensor, and 32 spread over the data
ENV = "LMCLI_PACKED_CACHE"  # "0": neither read nor write entries

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                                                       torch.int8, torch.int32, torch.int64, torch.bool)}
_PLAIN = (bool, int, float, str, type(None))


def enabled() -> bool:
    return os.environ.get(ENV, "") != "0"


def _code_version() -> str:
    """lmcli's own sources that decide what a load builds (readers, kernels, models, quantization):
    an entry written by other code is stale."""
    package = Path(__file__).resolve().parents[1]
    sources = sorted([*(package / "io").glob("gguf*.py"), *(package / "models").glob("*.py"),
                      *(package / "quant").glob("*.py"), package / "loading.py", Path(__file__).resolve()])
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:20]


def cache_key(gguf_path: Path, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """What an entry must have been made under to be used for loading `gguf_path` with `dtype` now."""
    from lmcli.fingerprint import checkpoint_fingerprint

    stat = gguf_path.stat()
    return {
        "format": FORMAT,
        "source": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "fingerprint": checkpoint_fingerprint(gguf_path),
        "code": _code_version(),
        "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
        "dtype": str(dtype),
        "kernel_env": {name: os.environ.get(name, "") for name in ("LMCLI_KERNEL", "LMCLI_FAST_KERNELS")},
    }


def entry_path(gguf_path: Path, key: dict[str, Any]) -> Path:
    from lmcli.paths import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "packed" / f"{gguf_path.stem}-{digest}.lmpk"


def entries_for(gguf_path: Path) -> list[Path]:
    """This GGUF file's entries (any key), for `lmcli info`."""
    from lmcli.paths import cache_dir

    return sorted((cache_dir() / "packed").glob(f"{gguf_path.stem}-*.lmpk"))


# --- writing ----------------------------------------------------------------------------------------


def _kernel_classes() -> dict[str, Any]:
    from lmcli.models.kernels import DequantiseKernel, Int4PackKernel

    return {cls.__name__: cls for cls in (Int4PackKernel, DequantiseKernel)}


def _plain(value: Any) -> Any:
    """A kernel setting as JSON; ValueError for anything this format does not know how to keep."""
    from lmcli.models.kernels import PackLayout

    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, PackLayout):
        return {"layout": [value.block, list(value.rows)]}
    raise ValueError(f"a kernel setting of type {type(value).__name__}")


def _unplain(value: Any) -> Any:
    from lmcli.models.kernels import PackLayout, cpu_pack_layout

    if isinstance(value, dict) and set(value) == {"dtype"}:
        return _DTYPES[value["dtype"]]
    if isinstance(value, dict) and set(value) == {"layout"}:
        block, rows = value["layout"]
        layout = PackLayout(int(block), tuple(int(r) for r in rows))
        if layout != cpu_pack_layout():  # torch packs differently now
            raise ValueError("a packing layout this torch does not use")
        return layout
    if isinstance(value, _PLAIN):
        return value
    raise ValueError("an unknown kernel setting")


def _describe(model: nn.Module) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header's description of `model` and the tensors to store, in order (each stored once)."""
    from lmcli.models.linear import QuantEmbedding, QuantLinear

    tensors: list[torch.Tensor] = []
    index: dict[tuple, int] = {}

    def stored(tensor: torch.Tensor) -> dict[str, Any]:
        if tensor.device.type != "cpu" or str(tensor.dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"a {tensor.dtype} tensor on {tensor.device}")
        transposed = tensor.dim() == 2 and not tensor.is_contiguous() and tensor.t().is_contiguous()
        data = tensor.t() if transposed else tensor.contiguous()
        identity = (data.data_ptr(), tuple(data.shape), data.dtype)
        if identity not in index:
            index[identity] = len(tensors)
            tensors.append(data)
        return {"tensor": index[identity], "transposed": transposed}

    kernels: list[dict[str, Any]] = []
    kernel_index: dict[int, int] = {}
    classes = {cls: name for name, cls in _kernel_classes().items()}
    modules: list[dict[str, Any]] = []
    for path, module in model.named_modules(remove_duplicate=False):
        for leaf, child in module._modules.items():
            if child is None:
                modules.append({"path": f"{path}.{leaf}" if path else leaf, "type": None})
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            kernel = module.kernel
            if id(kernel) not in kernel_index:
                if type(kernel) not in classes:
                    raise ValueError(f"a kernel of type {type(kernel).__name__}")
                settings = {k: _plain(v) for k, v in vars(kernel).items() if not k.startswith("_")}
                buffers = {name: stored(b) for name, b in kernel._buffers.items() if b is not None}
                kernel_index[id(kernel)] = len(kernels)
                kernels.append({"class": classes[type(kernel)], "settings": settings, "buffers": buffers,
                                "none": [name for name, b in kernel._buffers.items() if b is None]})
            kind = "QuantLinear" if isinstance(module, QuantLinear) else "QuantEmbedding"
            modules.append({"path": path, "type": kind, "kernel": kernel_index[id(kernel)],
                            "large_rows": module.large_rows})
    parameters = {name: stored(p) for name, p in model.named_parameters(remove_duplicate=False)
                  if not _inside_kernel(name)}
    buffers = {name: stored(b) for name, b in model.named_buffers(remove_duplicate=False) if not _inside_kernel(name)}
    paths = [path for path, _ in model.named_modules(remove_duplicate=False) if path]
    from dataclasses import asdict

    choices = {kind: asdict(choice) for kind, choice in getattr(model, "kernel_choices", {}).items()}
    return {"modules": modules, "paths": paths, "kernels": kernels, "parameters": parameters, "buffers": buffers,
            "kernel_choices": choices, "batch_invariant": bool(getattr(model, "batch_invariant", False))}, tensors


def _inside_kernel(name: str) -> bool:
    return ".kernel." in f".{name}"


def _samples(total: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) pieces of the data region that are checksummed: each tensor's first and last
    SAMPLE_BYTES, and 32 pieces spread evenly over the whole."""
    pieces = set()
    for start, length in spans:
        pieces.add((start, min(length, SAMPLE_BYTES)))
        pieces.add((start + max(0, length - SAMPLE_BYTES), min(length, SAMPLE_BYTES)))
    for i in range(32):
        offset = total * i // 32
        pieces.add((offset, min(SAMPLE_BYTES, total - offset)))
    return sorted(p for p in pieces if p[1] > 0)


def _checksum(data: memoryview | bytes, pieces: list[tuple[int, int]]) -> int:
    crc = 0
    for offset, length in pieces:
        crc = zlib.crc32(data[offset:offset + length], crc)
    return crc


def save(model: nn.Module, path: Path, key: dict[str, Any]) -> None:
    """Write `model` as an entry at `path`; a one-line warning (and no entry) where that fails."""
    from lmcli.io.atomic import atomic_file

    try:
        header, tensors = _describe(model)
    except ValueError as exc:  # a model this format cannot describe: loaded from the GGUF each time
        sys.stderr.write(f"note: the loaded weights are not kept in the packed cache ({exc})\n")
        return
    spans, offset = [], 0
    for tensor in tensors:
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = tensor.numel() * tensor.element_size()
        spans.append((offset, nbytes))
        offset += nbytes
    total = offset
    header.update(key=key, tensors=[{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                      "offset": o, "nbytes": n} for t, (o, n) in zip(tensors, spans, strict=True)],
                  data_bytes=total)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as temporary, open(temporary, "wb+") as file:
            file.truncate(_data_start(len(_encode(header, 0))) + total)
            start = _data_start(len(_encode(header, 0)))
            for tensor, (place, _) in zip(tensors, spans, strict=True):
                file.seek(start + place)
                file.write(tensor.view(-1).view(torch.uint8).numpy().data)  # the tensor's bytes, not copied
            file.flush()
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                crc = _checksum(memoryview(mapped)[start:], _samples(total, spans))
            encoded = _encode(header, crc)
            assert _data_start(len(encoded)) == start  # the checksum's digits do not move the data
            file.seek(0)
            file.write(encoded)
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:
        sys.stderr.write(f"warning: cannot keep the packed weights in {path.parent} ({first_line(exc)}); "
                         "the next start loads from the GGUF again\n")


def _encode(header: dict[str, Any], crc: int) -> bytes:
    body = json.dumps({**header, "crc32": f"{crc:08x}"}, sort_keys=True).encode()
    return MAGIC + struct.pack("<Q", len(body)) + body


def _data_start(encoded_length: int) -> int:
    return -(-encoded_length // ALIGN) * ALIGN


# --- reading ----------------------------------------------------------------------------------------


class Damaged(ValueError):
    """An entry that is not what this format writes, or not for this key."""


def _read_header(mapped: mmap.mmap, key: dict[str, Any]) -> tuple[dict[str, Any], int]:
    if len(mapped) < 16 or mapped[:8] != MAGIC:
        raise Damaged("not a packed-weights file")
    (length,) = struct.unpack("<Q", mapped[8:16])
    if length > min(MAX_HEADER, len(mapped) - 16):
        raise Damaged("header length out of bounds")
    try:
        header = json.loads(bytes(mapped[16:16 + length]))
    except ValueError:
        raise Damaged("header is not JSON") from None
    if not isinstance(header, dict):
        raise Damaged("header is not an object")
    if header.get("key") != key:
        raise Damaged("made for another file, code, torch or CPU")
    start = _data_start(16 + length)
    if not isinstance(header.get("data_bytes"), int) or start + header["data_bytes"] != len(mapped):
        raise Damaged("size differs from its header (cut short?)")
    return header, start


def _tensor_views(mapped: mmap.mmap, header: dict[str, Any], start: int) -> list[torch.Tensor]:
    import numpy as np

    total = header["data_bytes"]
    views, spans = [], []
    buffer = np.frombuffer(mapped, dtype=np.uint8, offset=start, count=total)  # no copy: the file's pages
    for entry in header["tensors"]:
        dtype, shape, offset, nbytes = _DTYPES[entry["dtype"]], [int(s) for s in entry["shape"]], entry["offset"], entry["nbytes"]
        numel = 1
        for size in shape:
            if size < 0:
                raise Damaged("negative size")
            numel *= size
        if not (isinstance(offset, int) and offset >= 0 and offset % ALIGN == 0 and offset + nbytes <= total
                and nbytes == numel * dtype.itemsize):
            raise Damaged("a tensor out of bounds")
        spans.append((offset, nbytes))
        views.append(torch.from_numpy(buffer[offset:offset + nbytes]).view(dtype).view(shape))
    if f"{_checksum(memoryview(mapped)[start:], _samples(total, spans)):08x}" != header.get("crc32"):
        raise Damaged("checksum differs")
    return views


def restore(model: nn.Module, path: Path, key: dict[str, Any]) -> bool:
    """Fill `model` (built from its config, weights not yet placed) from the entry at `path`. False
    where there is none; a stale or damaged one is deleted, and `model` may then be half-filled: the
    caller builds a new one to load from the GGUF."""
    try:
        with open(path, "rb") as file:
            # Copy-on-write: tensors are writable (torch wants that) and nothing written reaches the file.
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):  # none, unreadable, or empty
        if path.exists():
            path.unlink(missing_ok=True)
        return False
    try:
        header, start = _read_header(mapped, key)
        _apply(model, header, _tensor_views(mapped, header, start))
        return True
    except (Damaged, KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
        sys.stderr.write(f"note: {path.name}: packed weights not used ({first_line(exc)[:100]}); loading from the GGUF\n")
        path.unlink(missing_ok=True)
        return False


def _apply(model: nn.Module, header: dict[str, Any], views: list[torch.Tensor]) -> None:
    from lmcli.models.kernel_plan import KernelChoice, kernel_plan
    from lmcli.models.linear import QuantEmbedding, QuantLinear

    def tensor(ref: dict[str, Any]) -> torch.Tensor:
        view = views[ref["tensor"]]
        return view.t() if ref["transposed"] else view

    choices = {kind: KernelChoice(**fields) for kind, fields in header["kernel_choices"].items()}
    for kind, choice in choices.items():  # the plan this process would choose (a re-probe may change it)
        if kernel_plan(kind, _DTYPES[choice.dtype], "cpu").kernel != choice.kernel:
            raise Damaged(f"the {kind} kernel plan changed")
    classes = _kernel_classes()
    kernels = []
    for entry in header["kernels"]:
        cls = classes[entry["class"]]
        kernel = cls.__new__(cls)
        nn.Module.__init__(kernel)
        for name, value in entry["settings"].items():
            setattr(kernel, name, _unplain(value))
        for name, ref in entry["buffers"].items():
            kernel.register_buffer(name, tensor(ref), persistent=False)
        for name in entry["none"]:
            kernel.register_buffer(name, None, persistent=False)
        kernels.append(kernel)

    def parent_of(path: str) -> tuple[nn.Module, str]:
        owner, _, leaf = path.rpartition(".")
        return (model.get_submodule(owner) if owner else model), leaf

    for entry in header["modules"]:
        parent, leaf = parent_of(entry["path"])
        if entry["type"] is None:
            setattr(parent, leaf, None)
        elif entry["type"] == "QuantLinear":
            kernel = kernels[entry["kernel"]]
            setattr(parent, leaf, QuantLinear(kernel, None, entry["large_rows"]))
        elif entry["type"] == "QuantEmbedding":
            setattr(parent, leaf, QuantEmbedding(kernels[entry["kernel"]], entry["large_rows"]))
        else:
            raise Damaged(f"unknown module type {entry['type']!r}")
    keep = set(header["paths"])
    for path, _ in sorted(model.named_modules(remove_duplicate=False), key=lambda item: -item[0].count(".")):
        if path and path not in keep:
            parent, leaf = parent_of(path)
            if leaf in parent._modules:
                delattr(parent, leaf)
    for name, ref in header["parameters"].items():
        parent, leaf = parent_of(name)
        parent.__dict__.pop(leaf, None)  # a None set as a plain attribute (a QuantLinear without bias)
        parent._parameters[leaf] = nn.Parameter(tensor(ref), requires_grad=False)
    for name, ref in header["buffers"].items():
        parent, leaf = parent_of(name)
        parent.__dict__.pop(leaf, None)
        parent._buffers[leaf] = tensor(ref)
    if sorted(n for n, _ in model.named_modules(remove_duplicate=False) if n) != sorted(keep):
        raise Damaged("module tree differs")
    # Every parameter and buffer of the rebuilt tree came from the entry (none left unfilled).
    filled = set(header["parameters"]) | set(header["buffers"])
    present = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
              {n for n, _ in model.named_buffers(remove_duplicate=False)}
    if {n for n in present if not _inside_kernel(n)} != filled:
        raise Damaged("parameters differ from the model's")
    setattr(model, "kernel_choices", choices)  # noqa: B010  (plain attributes of BaseModel, not modules)
    setattr(model, "batch_invariant", bool(header["batch_invariant"]))  # noqa: B010
    model.eval()
