"""The one-token decode step as a program built ahead of time (torch.export + AOTInductor).

`torch.compile` traces the step again in every process; here it is exported once (every tensor an
input: the token, its position, the cache's keys and values, which it updates in place), compiled to
a shared library without the weights (the model's own packed tensors are handed to it at load, not
copied), and loaded back in later processes in a fraction of a second (io/compiled_cache.py keeps the
builds). Only what the exported graph can express is built: full
(non-rolling) caches, and, on the batch-invariant path, the one-call-per-row attention (bfloat16,
no window, no softcap), whose per-row key plan is computed here on the host as two tensors.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmcli.config import SLIDING
from lmcli.errors import UsageError, first_line
from lmcli.io import compiled_cache
from lmcli.models.row_attention import KEY_BLOCK

if TYPE_CHECKING:
    from lmcli.models.cache import LayerCache, ModelCache

BaseModel = Any  # models/base.py's BaseModel, which imports this module (no import circle, even for types)


# A program is built per batch size, up to this many rows (a larger batch decodes eagerly). The program
# takes each input with the strides it was exported with: the loop's token and position columns are
# views of wider buffers, so they are made contiguous first (a row > 0 read another row's memory).
MAX_BATCH = 16
# Constants the program holds itself, not the model's tensors: the int4 kernel's group sizes inductor
# makes, the rotary frequencies. Kept in the entry as numbers; more than this many values is refused.
MAX_EXTRA_VALUES = 1 << 16
EXTRA_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32", "bool")


COMPILE_VAR = "LMCLI_COMPILE"


def compile_mode(flag: bool | None, job: bool, env: Mapping[str, str] = os.environ) -> str:
    """How the CLI decodes: "build" (--compile, LMCLI_COMPILE=1: programs built where missing), "cached"
    (the default for a single prompt and chat: the programs already built run, nothing is built), "off"
    (--no-compile, LMCLI_COMPILE=0, and a job by default: its rows' tokens stay those of eager decoding,
    whatever --batch-size). The flag wins over the variable."""
    if flag is not None:
        return "build" if flag else "off"
    value = env.get(COMPILE_VAR, "").strip().lower()
    if value in ("0", "off", "no", "false"):
        return "off"
    if value in ("1", "on", "yes", "true"):
        return "build"
    if value not in ("", "auto"):
        raise UsageError(f"{COMPILE_VAR}={value!r}: use 0 (eager), 1 (as --compile) or auto")
    return "off" if job else "cached"


def unsupported(model: BaseModel) -> str | None:
    """Why the step of `model` cannot be built (one line), or None."""
    config = model.config
    if getattr(model, "tensor_parallel", None) is not None:
        return "tensor-parallel models stay eager"
    if config.sliding_window is not None and SLIDING in config.layer_types:
        return "sliding-window layers (a rolling cache) are not exported"
    if model.batch_invariant and (model.dtype != torch.bfloat16 or config.attn_logit_softcapping is not None):
        return "batch-invariant attention is exported only in bfloat16 without a softcap"
    if getattr(getattr(model, "lora", None), "merged", True) is False:
        return "LoRA adapters beside the weights are not exported"
    if holds_native_kernels(model):
        return "lmcli's native kernels are not exported (LMCLI_KERNEL=int4pack compiles with torch's)"
    return None


def holds_native_kernels(model: torch.nn.Module) -> bool:
    """Whether some weight of `model` multiplies through lmcli's C++ kernels (a ctypes call)."""
    return any(getattr(getattr(m, "kernel", None), "name", "") == "native" for m in model.modules())


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
    return program_inputs(input_ids, positions, query_slots, slot_is_token, cache, slot_end,
                          decode_plan(slot_is_token, slot_end, model.dtype))


def program_inputs(input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                   slot_is_token: torch.Tensor, cache: ModelCache, slot_end: int,
                   plan: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, ...]:
    """`DecodeStep`'s inputs, flat, for a call whose history ends at `slot_end`, with its key `plan`
    (index, mask): a one-token step's (`decode_plan`) or a prefill chunk's (compiled_prefill.chunk_plan)."""
    index, mask = plan
    history = torch.empty(slot_end, dtype=torch.bool)  # only its length is read: the step's history as a size
    # The program reads its inputs with export's (contiguous) strides; the cache is written in place, so
    # it must already be contiguous (it is allocated so).
    if not all(t.is_contiguous() for layer in cache.layers for t in (layer.keys, layer.values, layer.slots)):
        raise compiled_cache.Unavailable("the KV cache is not contiguous")
    input_ids, positions = input_ids.contiguous(), positions.contiguous()
    query_slots, slot_is_token = query_slots.contiguous(), slot_is_token.contiguous()
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


def decode_example(model: BaseModel, batch: int) -> tuple[ModelCache, tuple[Any, ...]]:
    """A scratch cache and a one-token step's inputs to export on, the same whatever the prompt: history
    2 * KEY_BLOCK + 5 slots, its key plan padded to 3 * KEY_BLOCK, a cache of 3 * KEY_BLOCK + 7 slots and a
    slot mask 6 wider. No dynamic length is 0 or 1, or equal to another that may differ from it, either of
    which export would specialise or tie (the program was built on the user's first step: one built on
    "Hi" failed with IndexError on other prompts)."""
    end, capacity = 2 * KEY_BLOCK + 5, 3 * KEY_BLOCK + 7
    cache = model.init_cache(batch, capacity)
    slot_is_token = torch.ones((batch, capacity + 6), dtype=torch.bool)
    input_ids = torch.zeros((batch, 1), dtype=torch.long)
    positions = torch.full((batch, 1), end - 1, dtype=torch.long)
    return cache, step_inputs(model, input_ids, positions, torch.tensor([end - 1]), slot_is_token, cache, end)


def build(model: BaseModel, cache: ModelCache, example: tuple[Any, ...], package: Path) -> dict[str, Any]:
    """Export the step on `example`'s shapes (the lengths left dynamic; `decode_example`'s) and compile it to
    `package`, without the weights; then run it against eager decoding on a fixed text (`check_against_eager`,
    Rejected where it strays), before the cache keeps it. -> what the entry keeps to load it
    (`extra_constants`, `weight_layout`)."""
    with warnings.catch_warnings():  # torch's own deprecation notices, which would break the progress line
        warnings.simplefilter("ignore")
        program = _build(model, cache, example, package)
    check_against_eager(model, load(package, model, program), example[0].shape[0])
    return program


class Rejected(RuntimeError):
    """A built program whose logits stray from eager decoding's on the fixed text (or that fails on it)."""


# The fixed text a new program must decode as eager does before it is kept: a 3-token prompt (rows of a
# batch left-padded by 0 or 1), then KEY_BLOCK + 2 forced tokens, so the history outgrows a key block.
CHECK_PROMPT, CHECK_STEPS = 3, KEY_BLOCK + 2
# Within the compiled step's stated tolerance (README; tests/test_compile_cache.py measures both on the tiny
# and the default model): a mean KL from eager's next-token distributions of at most 1e-3, and no step
# further than 2^-4 of the row's largest logit from eager's (inductor fuses norms and rotary differently,
# 2^-6 measured); a broken program (rotary tables scaled, another row's tokens) is far outside both.
CHECK_KL, CHECK_ATOL = 1e-3, 2.0**-4


def check_against_eager(model: BaseModel, run: Callable[..., torch.Tensor], batch: int) -> None:
    """Decode a fixed text (tokens forced, not chosen) at `batch` rows, each step through `run` (the program)
    and eagerly on the same cache; Rejected (one line) where `run` fails or its logits stray."""
    generator = torch.Generator().manual_seed(31)
    text = torch.randint(0, model.config.vocab_size, (batch, CHECK_PROMPT + CHECK_STEPS), generator=generator)
    ids, forced = text[:, :CHECK_PROMPT], text[:, CHECK_PROMPT:]  # (B, 3), (B, steps)
    mask = torch.ones(ids.shape, dtype=torch.long)
    mask[1::2, 0] = 0  # odd rows left-padded: each row its own key plan
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (program, eager) logits [B, vocab] of each step
    failures: list[BaseException] = []

    def both(input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
             slot_is_token: torch.Tensor, cache: ModelCache, slot_end: int, last_only: bool) -> torch.Tensor:
        saved = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        try:
            got = run(*step_inputs(model, input_ids, positions, query_slots, slot_is_token, cache, slot_end))
        except Exception as exc:  # any failure rejects the program
            failures.append(exc)
            got = None
        for layer, (k, v) in zip(cache.layers, saved, strict=True):  # eager writes the same keys again
            layer.keys.copy_(k)
            layer.values.copy_(v)
        want = model._forward_slots(input_ids, positions, query_slots, slot_is_token, cache, slot_end, last_only)
        if got is not None:
            pairs.append((got[:, -1].float(), want[:, -1].float()))
        return want

    def force(input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - CHECK_PROMPT
        return torch.full_like(logits, float("-inf")).scatter_(-1, forced[:, step:step + 1], 0.0)

    installed = model._compiled_decode, model._compiled_prefill
    model._compiled_decode, model._compiled_prefill = both, None
    try:
        model.generate(ids, CHECK_STEPS, False, attention_mask=mask, logits_processors=[force])
    finally:
        model._compiled_decode, model._compiled_prefill = installed
    if failures:
        failure = failures[0]
        raise Rejected(f"it failed on the check's fixed text ({type(failure).__name__}: {first_line(failure)[:120]})")
    if len(pairs) != CHECK_STEPS - 1:
        raise Rejected(f"it ran {len(pairs)} of the check's {CHECK_STEPS - 1} steps")
    got = torch.cat([g for g, _ in pairs]).log_softmax(-1)  # (steps * B, vocab)
    want = torch.cat([w for _, w in pairs]).log_softmax(-1)
    kl = float((want.exp() * (want - got)).sum(-1).mean())
    worst = max(float(((g - w).abs().amax(-1) / w.abs().amax(-1).clamp(min=1e-6)).max()) for g, w in pairs)
    if not kl <= CHECK_KL or not worst <= CHECK_ATOL:  # `not <=`: a NaN rejects too
        raise Rejected(f"its logits differ from eager decoding's on the check's fixed text (mean KL {kl:.2g}, "
                       f"largest difference {worst:.2g} of the largest logit)")


def _build(model: BaseModel, cache: ModelCache, example: tuple[Any, ...], package: Path) -> dict[str, Any]:
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    program = export_step(model, cache, example)
    made: dict[str, torch.Tensor] = {}  # the constants inductor adds itself (the int4 kernel's group size)
    add_constant = GraphLowering.add_tensor_constant

    def add_and_keep(graph: Any, data: torch.Tensor, name: str | None = None) -> Any:
        buffer = add_constant(graph, data, name)
        made[buffer.get_name()] = data.detach().clone()
        return buffer

    # Half-precision intermediates rounded where eager rounds them (inductor otherwise keeps a fused
    # chain in float32): the program's logits then follow eager's more closely. The weights stay out
    # of the library: the model's own tensors are given to it at load (`load`).
    configs = {"emulate_precision_casts": True, "aot_inductor.package_constants_in_so": False}
    with mock.patch.object(GraphLowering, "add_tensor_constant", add_and_keep):
        torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=configs)
    loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
    extra, layout = {}, {}
    for fqn in loader.get_constant_fqns():
        tensor = _model_tensor(model, fqn)
        if tensor is not None:
            layout[fqn] = _layout(tensor)
            continue
        value = program.constants.get(fqn, made.get(fqn))
        if value is None:
            raise RuntimeError(f"the program takes a constant {fqn} that is neither the model's nor known")
        extra[fqn] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                      "values": value.reshape(-1).tolist()}
    if sum(len(value["values"]) for value in extra.values()) > MAX_EXTRA_VALUES:
        raise RuntimeError("the program's own constants are larger than the entry keeps")
    return {"extra_constants": extra, "weight_layout": layout}


def _model_tensor(model: BaseModel, fqn: str) -> torch.Tensor | None:
    """The model's tensor at `fqn` (DecodeStep's name: "model." then the attribute path), or None."""
    head, _, path = fqn.partition(".")
    found: Any = model if head == "model" else None
    for part in path.split(".") if found is not None else ():
        found = getattr(found, part, None)
    return found if isinstance(found, torch.Tensor) else None


def _layout(tensor: torch.Tensor) -> list[Any]:
    return [str(tensor.dtype), list(tensor.shape), list(tensor.stride())]


def _constants(model: BaseModel, fqns: list[str], extra: Any, layout: Any) -> dict[str, torch.Tensor]:
    """The tensors for the program's constants `fqns`: the model's own (each as laid out when built) and
    the entry's few numbers. Raises ValueError (one line) for an entry that does not fit the model."""
    if not isinstance(extra, dict) or not isinstance(layout, dict):
        raise ValueError("the entry does not list the program's constants")
    constants = {}
    for fqn in fqns:
        tensor = _model_tensor(model, fqn)
        if tensor is not None:
            if layout.get(fqn) != _layout(tensor):
                raise ValueError(f"the model's {fqn} is not laid out as when the program was built")
            constants[fqn] = tensor.detach()
            continue
        value = extra.get(fqn)
        if not isinstance(value, dict) or value.get("dtype") not in EXTRA_DTYPES:
            raise ValueError(f"the entry has no value for the program's constant {fqn}")
        shape, values = value.get("shape"), value.get("values")
        if (not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape)
                or not isinstance(values, list) or len(values) > MAX_EXTRA_VALUES or len(values) != _numel(shape)):
            raise ValueError(f"the entry's value for {fqn} is malformed")
        constants[fqn] = torch.tensor(values, dtype=getattr(torch, value["dtype"])).reshape(shape)
    return constants


def _numel(shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def label(model: BaseModel) -> str:
    """A readable name for the model's entries: architecture, width and depth."""
    config = model.config
    return f"{getattr(config, 'model_type', 'model')}-{config.hidden_size}x{config.num_hidden_layers}"


def load(package: Path, model: BaseModel, meta: dict[str, Any]) -> Callable[..., torch.Tensor]:
    """The package's program as a function of `step_inputs`' tuple, running on the model's own weights
    (given by reference: nothing copied). Through torch's loader itself: `torch._inductor.aoti_load_package`
    first imports inductor (5 s of a fresh process here, 0.2 s this)."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
    constants = _constants(model, loader.get_constant_fqns(), meta.get("extra_constants"), meta.get("weight_layout"))
    loader.load_constants(constants, False, True, True)  # active buffer, every constant, the caller's memory
    run = _runner(loader)
    run.constants = constants  # type: ignore[attr-defined]  # kept alive as long as the program
    return run


def _load(package: Path) -> Callable[..., torch.Tensor]:
    """A package that holds its own weights (the prefill's, models/compiled_prefill.py) as a function of
    `step_inputs`' tuple."""
    return _runner(torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1))


def _runner(loader: Any) -> Callable[..., torch.Tensor]:
    def run(*args: Any) -> torch.Tensor:
        *tensors, keys, values, slots = args
        (logits,) = loader.boxed_run([*tensors, *keys, *values, *slots])  # the inputs in export's order
        return logits
    return run


class CachedDecode:
    """What `BaseModel.compile_decode` installs on CPU: a one-token step runs the program built for its
    batch size, read from the cache of compiled programs (io/compiled_cache.py) or built at its first step.
    Raises compiled_cache.Unavailable (one line) where there is none; the model then decodes eagerly."""

    def __init__(self, model: BaseModel, builds: bool = True):
        self.model = model
        self.builds = builds  # False: only programs already in the cache run, other batch sizes decode eagerly
        self.runners: dict[int, Callable[..., torch.Tensor]] = {}
        self.eager: set[int] = set()  # batch sizes without a program here
        self.threads: dict[int, int] = {}  # the thread count each batch size's program was built for
        self.keys: dict[int, dict[str, Any]] = {}  # the key each batch size's program was found or built under

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                 slot_is_token: torch.Tensor, cache: ModelCache, slot_end: int, last_only: bool) -> torch.Tensor:
        from lmcli.models.cache import KVCache

        if not all(type(layer) is KVCache for layer in cache.layers):
            raise compiled_cache.Unavailable("this cache has rolling layers, which the program does not take")
        batch = input_ids.shape[0]
        runner = self.runners.get(batch)
        if runner is None and batch not in self.eager:
            if batch > MAX_BATCH and self.builds:
                sys.stderr.write(f"note: --compile: a batch of {batch} rows decodes eagerly (programs are built "
                                 f"for at most {MAX_BATCH} rows)\n")
            if batch > MAX_BATCH or not (self.builds or self._built(batch)):
                self.eager.add(batch)
        if batch in self.eager:
            return self.model._forward_slots(input_ids, positions, query_slots, slot_is_token, cache, slot_end,
                                             last_only)
        args = step_inputs(self.model, input_ids, positions, query_slots, slot_is_token, cache, slot_end)
        if runner is None:
            try:
                runner = self.runners[batch] = self._runner(batch)
            except compiled_cache.Unavailable:
                if self.builds:
                    raise
                self.eager.add(batch)  # by default: the entry was damaged (said and deleted), so eager
                return self.model._forward_slots(input_ids, positions, query_slots, slot_is_token, cache,
                                                 slot_end, last_only)
        try:
            return self._run(runner, batch, args)
        except Exception as exc:  # the program itself failed: recorded, so no later run loads it again
            del self.runners[batch]
            self.eager.add(batch)
            failure = f"{type(exc).__name__}: {first_line(exc)[:120]}"
            why = compiled_cache.record_bad(label(self.model), self.keys[batch],
                                            f"the program failed at a step ({failure})")
            raise compiled_cache.KnownBad(why) from None

    def _run(self, runner: Callable[..., torch.Tensor], batch: int, args: tuple[Any, ...]) -> torch.Tensor:
        built = self.threads[batch]
        if torch.get_num_threads() <= built:
            return runner(*args)
        # More threads than it was built for: inductor sizes a parallel reduction's per-thread partials by
        # the build's count (seen in the generated C++: `tmp_acc0_arr[2]` indexed by omp_get_thread_num()),
        # so the program never runs on more (lmcli's count may rise with the load falling).
        more = torch.get_num_threads()
        torch.set_num_threads(built)
        try:
            return runner(*args)
        finally:
            torch.set_num_threads(more)

    def _runner(self, batch: int) -> Callable[..., torch.Tensor]:
        """The program for `batch` rows: the cache's, else (--compile) built now on `decode_example`, never
        on the user's own step, and checked against eager decoding before it is kept. A program that fails
        to build, check or load is recorded as bad (io/compiled_cache.record_bad): KnownBad, now and later."""
        model, name = self.model, label(self.model)
        key = self.keys[batch] = self._key(batch)
        self.threads[batch] = key["threads"]
        what = f"the decode step of {name} for batch {batch}"
        builder = (lambda path: build(model, *decode_example(model, batch), path)) if self.builds else None
        package, meta = compiled_cache.obtain_entry(name, key, builder, what)
        try:
            return load(package, model, meta)
        except Exception as exc:  # checked, yet not loadable here: recorded, not built or loaded again
            why = compiled_cache.record_bad(name, key, f"it does not load ({first_line(exc)[:120]})")
            raise compiled_cache.KnownBad(why) from None

    def _key(self, batch: int) -> dict[str, Any]:
        """The key of the program to run at `batch` rows: built for this thread count, else one already built
        for another (any runs at any count, never on more threads than its own: see __call__), more threads
        first; where there is none, this count's (to be built). A changed thread count builds nothing."""
        key = compiled_cache.cache_key(self.model, batch)
        threads, most = key["threads"], max(os.cpu_count() or 1, key["threads"])
        for count in [threads, *range(threads + 1, most + 1), *range(threads - 1, 0, -1)]:
            if compiled_cache.has_entry(label(self.model), dict(key, threads=count)):
                return dict(key, threads=count)
        return key

    def _built(self, batch: int) -> bool:
        """Whether the cache holds a whole entry for `batch` rows now (checked again when it is loaded)."""
        name = label(self.model)
        return compiled_cache.any_entry(name, batch) and compiled_cache.has_entry(name, self._key(batch))
