"""The one-token decode step as a program built ahead of time (torch.export + AOTInductor).

`torch.compile` traces the step again in every process; here it is exported once (every tensor an
input: the token, its position, the cache's keys and values, which it updates in place), compiled to
a shared library with the weights inside, and loaded back in later processes in about a second
(io/compiled_cache.py keeps the builds). Only what the exported graph can express is built: full
(non-rolling) caches, and, on the batch-invariant path, the one-call-per-row attention (bfloat16,
no window, no softcap), whose per-row key plan is computed here on the host as two tensors.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmcli.config import SLIDING
from lmcli.errors import first_line
from lmcli.io import compiled_cache
from lmcli.models.row_attention import KEY_BLOCK

if TYPE_CHECKING:
    from lmcli.models.cache import LayerCache, ModelCache

BaseModel = Any  # models/base.py's BaseModel, which imports this module (no import circle, even for types)


# Batch sizes a program is built for. Measured: inductor's program for a batch of 2 rows (a tiny int4
# llama, torch 2.13 CPU) computed the unpadded row's logits wrongly (max error 2.6 on logits of 3.4),
# while at batch 1 it agrees with eager within bfloat16 rounding; so larger batches decode eagerly.
BATCH_SIZES = (1,)


def unsupported(model: BaseModel) -> str | None:
    """Why the step of `model` cannot be built (one line), or None."""
    config = model.config
    if getattr(model, "tensor_parallel", None) is not None:
        return "tensor-parallel models stay eager"
    if config.sliding_window is not None and SLIDING in config.layer_types:
        return "sliding-window layers (a rolling cache) are not exported"
    if model.batch_invariant and (model.dtype != torch.bfloat16 or config.attn_logit_softcapping is not None):
        return "batch-invariant attention is exported only in bfloat16 without a softcap"
    return None


def decode_plan(slot_is_token: torch.Tensor, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keys for a one-token step at slot end - 1: the slots before `end` that hold tokens,
    in slot order, padded with masked keys to a common multiple of KEY_BLOCK (as `row_plans` pads
    each row's own call; the padding adds exactly nothing). -> index [B, P] long, mask [B, 1, 1, P]."""
    is_token = slot_is_token[:, :end]  # (B, end)
    counts = is_token.sum(-1)  # (B,)
    longest = max(int(counts.max()), 1)
    padded = -(-longest // KEY_BLOCK) * KEY_BLOCK
    slots = torch.arange(end, device=is_token.device)
    order = torch.argsort(torch.where(is_token, slots, slots + end), dim=-1, stable=True)  # tokens first
    index = torch.zeros((is_token.shape[0], padded), dtype=torch.long, device=is_token.device)
    width = min(end, padded)
    index[:, :width] = order[:, :width]
    visible = torch.arange(padded, device=is_token.device)[None] < counts.clamp(min=1)[:, None]  # (B, P)
    mask = torch.zeros(visible.shape, dtype=dtype, device=is_token.device).masked_fill_(~visible, float("-inf"))
    return index, mask[:, None, None]


class DecodeStep(nn.Module):
    """model._forward_slots for one token a row, on flat tensors: what torch.export sees."""

    def __init__(self, model: BaseModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                slot_is_token: torch.Tensor, history: torch.Tensor, index: torch.Tensor, mask: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], slots: list[torch.Tensor]) -> torch.Tensor:
        from lmcli.models.cache import KVCache, ModelCache

        layers: list[LayerCache] = []
        for k, v, s in zip(keys, values, slots, strict=True):
            layer = KVCache.__new__(KVCache)
            layer.keys, layer.values, layer.slots = k, v, s
            layers.append(layer)
        row_gather = (index, mask) if self.model.batch_invariant else None
        return self.model._forward_slots(input_ids, positions, query_slots, slot_is_token, ModelCache(layers),
                                         history.shape[0], True, row_gather)


def step_inputs(model: BaseModel, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                slot_is_token: torch.Tensor, cache: ModelCache, slot_end: int) -> tuple[Any, ...]:
    index, mask = decode_plan(slot_is_token, slot_end, model.dtype)
    history = torch.empty(slot_end, dtype=torch.bool)  # only its length is read: the step's history as a size
    return (input_ids, positions, query_slots, slot_is_token, history, index, mask,
            [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers],
            [layer.slots for layer in cache.layers])


def export_step(model: BaseModel, cache: ModelCache, example: tuple[Any, ...]) -> torch.export.ExportedProgram:
    auto = torch.export.Dim.AUTO
    n = len(cache.layers)
    shapes: tuple[Any, ...] = ({}, {}, {}, {1: auto}, {0: auto}, {1: auto}, {3: auto},
              [{2: auto}] * n, [{2: auto}] * n, [{0: auto}] * n)
    with torch.inference_mode(False), torch.no_grad():  # tensors made under inference mode cannot be traced
        example = torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, example)
        return torch.export.export(DecodeStep(model), example, dynamic_shapes=shapes, strict=False)


def build(model: BaseModel, cache: ModelCache, example: tuple[Any, ...], package: Path) -> None:
    """Export the step on `example`'s shapes (the lengths left dynamic) and compile it to `package`."""
    with warnings.catch_warnings():  # torch's own deprecation notices, which would break the progress line
        warnings.simplefilter("ignore")
        _build(model, cache, example, package)


def _build(model: BaseModel, cache: ModelCache, example: tuple[Any, ...], package: Path) -> None:
    program = export_step(model, cache, example)
    # Half-precision intermediates rounded where eager rounds them (inductor otherwise keeps a fused
    # chain in float32): the program's logits then follow eager's more closely.
    configs = {"emulate_precision_casts": True}
    torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=configs)


def label(model: BaseModel) -> str:
    """A readable name for the model's entries: architecture, width and depth."""
    config = model.config
    return f"{getattr(config, 'model_type', 'model')}-{config.hidden_size}x{config.num_hidden_layers}"


def _load(package: Path) -> Callable[..., torch.Tensor]:
    """The package's program as a function of `step_inputs`' tuple. Through torch's loader itself:
    `torch._inductor.aoti_load_package` first imports inductor (5 s of a fresh process here, 0.2 s this)."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)

    def run(*args: Any) -> torch.Tensor:
        *tensors, keys, values, slots = args
        (logits,) = loader.boxed_run([*tensors, *keys, *values, *slots])  # the inputs in export's order
        return logits
    return run


class CachedDecode:
    """What `BaseModel.compile_decode` installs on CPU: a one-token step runs the program built for its
    batch size, read from the cache of compiled programs (io/compiled_cache.py) or built at its first step.
    Raises compiled_cache.Unavailable (one line) where there is none; the model then decodes eagerly."""

    def __init__(self, model: BaseModel):
        self.model = model
        self.runners: dict[int, Callable[..., torch.Tensor]] = {}
        self.noted = False  # the note on a batch size without a program, said once

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                 slot_is_token: torch.Tensor, cache: ModelCache, slot_end: int, last_only: bool) -> torch.Tensor:
        from lmcli.models.cache import KVCache

        if not all(type(layer) is KVCache for layer in cache.layers):
            raise compiled_cache.Unavailable("this cache has rolling layers, which the program does not take")
        batch = input_ids.shape[0]
        if batch not in BATCH_SIZES:
            if not self.noted:
                self.noted = True
                sys.stderr.write(f"note: --compile: a batch of {batch} rows decodes eagerly (programs are built "
                                 f"for batch {', '.join(map(str, BATCH_SIZES))} only)\n")
            return self.model._forward_slots(input_ids, positions, query_slots, slot_is_token, cache, slot_end,
                                             last_only)
        args = step_inputs(self.model, input_ids, positions, query_slots, slot_is_token, cache, slot_end)
        runner = self.runners.get(batch)
        if runner is None:
            runner = self.runners[batch] = self._runner(batch, cache, args)
        return runner(*args)

    def _runner(self, batch: int, cache: ModelCache, example: tuple[Any, ...]) -> Callable[..., torch.Tensor]:
        model, name = self.model, label(self.model)
        key = compiled_cache.cache_key(model, batch)
        what = f"the decode step of {name} for batch {batch}"
        for attempt in range(2):
            package = compiled_cache.obtain(name, key, lambda path: build(model, cache, example, path), what)
            try:
                return _load(package)
            except Exception as exc:  # checked, yet not loadable (or replaced meanwhile): build it once more
                if attempt:
                    raise compiled_cache.Unavailable(f"loading {package} failed: {first_line(exc)[:160]}") from None
                compiled_cache.discard(package.parent, f"it does not load ({first_line(exc)[:120]})")
        raise AssertionError("unreachable")
