"""A loaded model's tree as data, and back: what io/packed_cache.py keeps of a quantized model.

`describe` turns the model (after loading, fusing and tying) into JSON-able data and the list of
tensors to store; `apply` rebuilds that tree in a model built from the same config, with the stored
tensors (mapped from the entry, not copied). Only the kernels of kernels/matmul.py and the modules
of kernels/linear.py are rebuilt, by setting their recorded settings, so what a load makes is kept as
it was made; anything else (an unknown kernel, a setting of an unknown type) is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lmcli.io import packed_cache
from lmcli.io.packed_cache import DTYPES, Damaged  # the file format's (io/packed_cache.py)

_PLAIN = (bool, int, float, str, type(None))


def _module_classes() -> dict[str, Any]:
    from lmcli.kernels.linear import QuantEmbedding, QuantHead, QuantLinear

    return {cls.__name__: cls for cls in (QuantLinear, QuantHead, QuantEmbedding)}


MODEL_SETTINGS = ("kernel_choices", "batch_invariant", "activation_dtype")  # a load's Numerics, as the entry keeps it


def _kernel_classes() -> dict[str, Any]:
    from lmcli.kernels.matmul import DequantiseKernel, Int4PackKernel
    from lmcli.kernels.native_kernel import NativeKernel

    return {cls.__name__: cls for cls in (Int4PackKernel, DequantiseKernel, NativeKernel)}


# The buffers each kernel registers (kernels/matmul.py), some None: an entry must give every one, or the
# rebuilt kernel fails at its first product (an AttributeError where the entry should have been refused).
KERNEL_BUFFERS = {"Int4PackKernel": frozenset({"packed", "scales_and_zeros"}),
                  "DequantiseKernel": frozenset({"codes", "scales", "offsets"}),
                  "NativeKernel": frozenset({"codes", "scales", "offsets"})}


def _plain(value: Any) -> Any:
    """A kernel setting as JSON; ValueError for anything this format does not know how to keep."""
    from lmcli.kernels.matmul import PackLayout

    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, PackLayout):
        return {"layout": [value.block, list(value.rows)]}
    raise ValueError(f"a kernel setting of type {type(value).__name__}")


def _unplain(value: Any) -> Any:
    from lmcli.kernels.matmul import PackLayout

    if isinstance(value, _PLAIN):  # most settings: first, as a load reads about 2,000 of them
        return value
    if isinstance(value, dict) and set(value) == {"dtype"}:
        return DTYPES[value["dtype"]]
    if isinstance(value, dict) and set(value) == {"layout"}:  # torch's, for the torch and CPU of the key
        block, rows = value["layout"]
        return PackLayout(int(block), tuple(int(r) for r in rows))
    raise ValueError("an unknown kernel setting")


def describe(model: nn.Module) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header's description of `model` and the tensors to store, in order (each stored once)."""
    from lmcli.kernels.linear import QuantEmbedding, QuantLinear

    tensors: list[torch.Tensor] = []
    index: dict[tuple, int] = {}

    def stored(tensor: torch.Tensor) -> dict[str, Any]:
        if tensor.device.type != "cpu" or str(tensor.dtype).removeprefix("torch.") not in DTYPES:
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
            if type(module).__name__ not in _module_classes():
                raise ValueError(f"a module of type {type(module).__name__}")
            settings = {k: _plain(v) for k, v in vars(module).items() if not k.startswith("_")}
            modules.append({"path": path, "type": type(module).__name__, "kernel": kernel_index[id(kernel)],
                            "settings": settings})
    parameters = {name: stored(p) for name, p in model.named_parameters(remove_duplicate=False)
                  if not _inside_kernel(name)}
    buffers = {name: stored(b) for name, b in model.named_buffers(remove_duplicate=False) if not _inside_kernel(name)}
    paths = [path for path, _ in model.named_modules(remove_duplicate=False) if path]
    from dataclasses import asdict

    choices = {kind: asdict(choice) for kind, choice in getattr(model, "kernel_choices", {}).items()}
    return {"modules": modules, "paths": paths, "kernels": kernels, "parameters": parameters, "buffers": buffers,
            "kernel_choices": choices, "batch_invariant": bool(getattr(model, "batch_invariant", False)),
            "activation_dtype": _plain(getattr(model, "activation_dtype", None))}, tensors


def _inside_kernel(name: str) -> bool:
    return ".kernel." in f".{name}"


def apply(model: nn.Module, header: dict[str, Any], views: list[torch.Tensor]) -> None:
    from lmcli.kernels.numerics import HasNumerics, Numerics
    from lmcli.kernels.plan import KernelChoice, kernel_plan

    module_classes = _module_classes()

    def tensor(ref: dict[str, Any]) -> torch.Tensor:
        view = views[ref["tensor"]]
        return view.t() if ref["transposed"] else view

    choices = {kind: KernelChoice(**fields) for kind, fields in header["kernel_choices"].items()}
    for kind, choice in choices.items():  # the plan this process would choose (a re-probe may change it)
        plan = kernel_plan(kind, DTYPES[choice.dtype], "cpu")
        if (plan.kernel, plan.large_rows) != (choice.kernel, choice.large_rows):
            raise Damaged(f"the {kind} kernel plan changed")
    classes = _kernel_classes()
    kernels = []
    for entry in header["kernels"]:
        cls = classes[entry["class"]]
        if {*entry["buffers"], *entry["none"]} != KERNEL_BUFFERS[entry["class"]] or \
                len(entry["buffers"]) + len(entry["none"]) != len(KERNEL_BUFFERS[entry["class"]]):
            raise Damaged(f"a {entry['class']} without its buffers")
        kernel = cls.__new__(cls)
        nn.Module.__init__(kernel)
        _set_plain(kernel, cls, entry["settings"])
        for name, ref in entry["buffers"].items():
            kernel.register_buffer(_settable(cls, name), tensor(ref), persistent=False)
        for name in entry["none"]:
            kernel.register_buffer(_settable(cls, name), None, persistent=False)
        kernels.append(kernel)

    def parent_of(path: str) -> tuple[nn.Module, str]:
        owner, _, leaf = path.rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        # A name the entry sets must be a plain attribute: never one of the class's (a method, a property).
        if not leaf.isidentifier() or leaf.startswith("_") or hasattr(type(parent), leaf):
            raise Damaged(f"a module or tensor named {path!r}")
        return parent, leaf

    for entry in header["modules"]:
        parent, leaf = parent_of(entry["path"])
        if entry["type"] is None:
            setattr(parent, leaf, None)
        else:  # a module of kernels/linear.py, its settings as recorded, over its kernel
            cls = module_classes[entry["type"]]
            module = cls.__new__(cls)
            nn.Module.__init__(module)
            _set_plain(module, cls, entry["settings"])
            module.kernel = kernels[entry["kernel"]]
            setattr(parent, leaf, module)
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
    assert isinstance(model, HasNumerics)
    model.install_numerics(Numerics(kernel_choices=choices, batch_invariant=bool(header["batch_invariant"]),
                                    activation_dtype=_unplain(header["activation_dtype"])))
    model.eval()


def _set_plain(module: nn.Module, cls: type, settings: dict[str, Any]) -> None:
    """Set a freshly made module's recorded settings, each name checked by `_settable`. Their values
    are plain (`_unplain`: never a tensor or module), so they go straight into the instance's
    attributes, as nn.Module.__setattr__ would put them after its checks for tensors and modules."""
    module.__dict__.update({_settable(cls, name): _unplain(value) for name, value in settings.items()})


@functools.lru_cache(maxsize=256)  # one answer per class and name: a load asks about 2,000 times
def _settable(cls: type, name: str) -> str:
    """`name`, if it may be set on a kernel: a public attribute that is not one of the class's methods
    or properties (a plain class default, like `name`, may be)."""
    default = getattr(cls, name, None)
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_") or callable(default) \
            or isinstance(default, property | functools.cached_property):
        raise Damaged(f"a kernel setting named {name!r}")
    return name


def save(model: nn.Module, tokenizer: Any, hf_config: dict[str, Any], path: Any, key: dict[str, Any],
         tokenizer_json: torch.Tensor | None = None) -> None:
    """Keep `model` (after loading, fusing and tying) in the packed cache (io/packed_cache.py's `save`);
    a one-line note (and no entry) for a model this format cannot describe."""
    import sys

    try:
        header, tensors = describe(model)
    except (ValueError, TypeError) as exc:  # loaded from the GGUF each time, then
        sys.stderr.write(f"note: the loaded weights are not kept in the packed cache ({exc})\n")
        return
    packed_cache.save(header, tensors, tokenizer, hf_config, path, key, tokenizer_json=tokenizer_json)


def fill(model: nn.Module, entry: packed_cache.Entry) -> None:
    """Fill `model`, built from the entry's `hf_config` with its weights not yet placed (Damaged where the
    entry does not fit it: `model` may then be half-filled)."""
    apply(model, entry.header, entry.views)
