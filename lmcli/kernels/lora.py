"""LoRA adapters on a loaded model: merged into float weights, or beside any weight (`LoraLinear`).

An adapter (io/lora_files.py) adds x·Aᵀ·Bᵀ·scale to a projection's output. Where the command has one
set of adapters for every row (generate, chat) and the weights are float, the update is merged into
them at load (W += scale·B·A): no cost per token. Otherwise (quantized weights, whose int4 codes are never
dequantised to merge; or a job or server whose rows pick adapters) each adapted projection becomes a
`LoraLinear`: the base module as it was, and beside it the adapters' A and B, one table entry per
adapter, scale folded into B.

Which adapters a row gets travels beside the forward call, not in the model: the scheduler that knows
the rows sets a `Routing` (`routed(...)`) around its forward passes; with none set, every row gets the
command's adapters (all of them, stacked). A row's update is computed with the same per-row arithmetic
whatever else its batch holds: with lmcli's C++ library (native/csrc/lora.cpp, one call per module, each
row of a mixed batch reading its own adapter's tables), each row's x·Aᵀ summed over the input in order,
then ·Bᵀ summed over the rank in order, added to the row's output in float32 and rounded once; without
it, elementwise products and torch sums over the same axes (`(x[:, None, :] * A).sum(-1)`), rows grouped
by adapter. The adapters of a stack are summed in their fixed order, then added once. A batch of rows
with different adapters therefore gives each row what it gets alone (docs/guarantees.md; checked on the
default model with 4 adapters, the command's and none in a batch of 8, greedy and sampled).

The targets are the projections every architecture has, by their HF names: q/k/v/o, gate/up/down, a
mixtral expert's w1/w2/w3, and GPT-2's c_attn/c_proj/c_fc. After loading, q/k/v and gate/up are fused
into one projection (models/layers.py); an adapter of q_proj then covers that projection's first rows.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lmcli.errors import UsageError
from lmcli.io.lora_files import AdapterError, AdapterFile, Target

NONE = "none"  # a row's "lora": "none": no adapter at all


# --- which adapters each row gets --------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """Each row's adapters for one forward call: `levels[i]` is the i-th adapter of every row's stack,
    either one table index for every row (an int; -1: none) or one per row [B] long (-1 for none).
    `per_token`: the tensors index the flattened tokens instead (the subset of tokens an expert sees:
    `narrowed`)."""

    levels: tuple[int | torch.Tensor, ...]
    per_token: bool = False
    _groups: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = field(default_factory=dict, compare=False)
    _indices: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, compare=False)

    def groups(self, level: int, tokens: int) -> list[tuple[int, torch.Tensor]]:
        """For a per-row level and `tokens` flattened tokens: [(adapter, token indices (m,))], each adapter
        once, in its order; worked out once per forward call (every adapted layer asks)."""
        key = (level, tokens)
        found = self._groups.get(key)
        if found is None:
            index = self.token_index(level, tokens)
            found = [(int(v), (index == v).nonzero().view(-1)) for v in index.unique().tolist() if v >= 0]
            self._groups[key] = found
        return found

    def token_index(self, level: int, tokens: int) -> torch.Tensor:
        """For a per-row level: each of the `tokens` flattened tokens' adapter (-1: none), (tokens,) int64,
        contiguous (the C++ update reads it); worked out once per forward call."""
        key = (level, tokens)
        found = self._indices.get(key)
        if found is None:
            index = self.levels[level]
            assert isinstance(index, torch.Tensor)
            if not self.per_token:
                index = index.repeat_interleave(tokens // index.shape[0])  # rows -> tokens (B*T,)
            found = index.to(torch.int64).contiguous()
            self._indices[key] = found
        return found


_ROUTING: ContextVar[Routing | None] = ContextVar("lmcli_lora_routing", default=None)


@contextlib.contextmanager
def routed(routing: Routing | None) -> Iterator[None]:
    """Forward passes in this block give each row the adapters `routing` says (None: the command's)."""
    token = _ROUTING.set(routing)
    try:
        yield
    finally:
        _ROUTING.reset(token)


@contextlib.contextmanager
def narrowed(token_index: torch.Tensor, tokens: int) -> Iterator[None]:
    """Inside a mixture-of-experts block: the expert sees `token_index` of the `tokens` flattened tokens,
    so a per-row routing becomes a per-token one for those tokens."""
    routing = _ROUTING.get()
    if routing is None or all(isinstance(level, int) for level in routing.levels):
        yield
        return
    levels: list[int | torch.Tensor] = []
    for level in routing.levels:
        if isinstance(level, torch.Tensor):
            per_token = level if routing.per_token else level.repeat_interleave(tokens // level.shape[0])  # (N,)
            level = per_token[token_index]  # (n,)
        levels.append(level)
    with routed(Routing(tuple(levels), per_token=True)):
        yield


# --- the module --------------------------------------------------------------------------------------


class LoraLinear(nn.Module):
    """`base` (nn.Linear or kernels/linear.QuantLinear, unchanged) plus each row's adapters' updates.

    a: (E + 1, R, K) and b: (E + 1, N, R), float32: entry e is adapter e's A and scale·B over this
    module's rows (zeros where it adapts none of them; several segments of a fused projection side by
    side in R); entry E is all zeros (a row without an adapter in a mixed batch). `adapted`: the entries
    that are not all zeros here."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, adapted: frozenset[int], stack: int,
                 tables: torch.dtype = torch.float32):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = a.shape[-1], b.shape[1]
        self.rank = a.shape[1]
        self.b_dtype = b.dtype
        # lmcli's C++ update (native/csrc/lora.cpp: one call a module) where the library is there and the
        # tables are float32 on the CPU; else torch's elementwise products and sums (`_update`).
        self.native = _native_entry() if a.device.type == "cpu" and a.dtype == b.dtype == torch.float32 else None
        self.a: torch.Tensor
        self.b_t: torch.Tensor
        # The C++ update reads its tables in `tables` (bfloat16 for a bfloat16 model: a decode step reads
        # every adapted module's A and B, and in float32 they were 29% of the int4 model's bytes; the
        # products and sums stay float32); torch's path keeps them float32.
        self.tables_bf16 = self.native is not None and tables == torch.bfloat16
        dtype = torch.bfloat16 if self.tables_bf16 else a.dtype
        if self.native is not None:
            # (E + 1, K, R): A transposed, so the kernel's sum over K runs along an outer dim, vectorised over R.
            self.register_buffer("a", a.transpose(1, 2).to(dtype).contiguous(), persistent=False)
        else:
            self.register_buffer("a", a, persistent=False)  # (E + 1, R, K)
        # (E + 1, R, N): B transposed, so the sum over the rank runs along an outer dim, vectorised over N.
        self.register_buffer("b_t", b.transpose(1, 2).to(dtype).contiguous(), persistent=False)
        self.adapted = adapted
        # The command's adapters, stacked (routing None), those adapting this module.
        self.default = tuple(e for e in range(stack) if e in adapted)
        self.views: list[tuple[torch.Tensor, torch.Tensor]]
        # Each entry's A (or Aᵀ) and B as plain attributes: a forward reads them without nn.Module's lookup.
        self.__dict__["views"] = list(zip(self.a.unbind(0), self.b_t.unbind(0)))
        self.pointers: list[tuple[int, int]]
        self.__dict__["pointers"] = [(a.data_ptr(), b.data_ptr()) for a, b in self.views]  # the views are contiguous
        # For a mixed batch's one call: the tables' bases and which entries adapt this module (uint8, (E + 1,)).
        self.adapted_mask: torch.Tensor
        self.register_buffer("adapted_mask", torch.tensor([e in adapted for e in range(a.shape[0])],
                                                          dtype=torch.uint8), persistent=False)
        self.bases: tuple[int, int, int]
        self.__dict__["bases"] = (self.a.data_ptr(), self.b_t.data_ptr(), self.adapted_mask.data_ptr())

    @property
    def weight(self) -> Any:  # what code asking a projection for its weight (dtype, device) finds
        return getattr(self.base, "weight", None)

    @property
    def bias(self) -> Any:
        return getattr(self.base, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (..., N), a new tensor: the update is added in place
        routing = _ROUTING.get()
        flat = x.reshape(-1, self.in_features)  # (M, K)
        out = y.view(-1, self.out_features)  # (M, N)
        if routing is None:  # the command's adapters for every row: the common case, kept short
            if len(self.default) == 1:
                self._add(flat, self.default[0], out)
            elif self.default:  # a stack: summed in float32 in its order, then added once (as in a mixed batch)
                stacked = self._update(flat, self.default[0])  # (M, N)
                for adapter in self.default[1:]:
                    stacked += self._update(flat, adapter)
                out += stacked
            return y
        levels = routing.levels
        if len(levels) == 1:  # one adapter a row (or none): each row's update added straight to its output
            level = levels[0]
            if isinstance(level, int):
                if level in self.adapted:
                    self._add(flat, level, out)
                return y
            if self.native is not None:
                if not routing.per_token and x.shape[0] != level.shape[0]:
                    raise RuntimeError(f"LoRA routing for {level.shape[0]} rows given a batch of {x.shape[0]}")
                if _native_dtypes(flat, out):  # one C++ call, each token its own adapter's tables
                    self._add_routed(flat, routing.token_index(0, flat.shape[0]), out)
                    return y
                # Each group's rows out and back: the same out + update, rounded once, that a row alone gets.
                for adapter, tokens in routing.groups(0, flat.shape[0]):
                    if adapter in self.adapted:
                        rows = out.index_select(0, tokens)  # (m, N)
                        self._add(flat.index_select(0, tokens), adapter, rows)
                        out.index_copy_(0, tokens, rows)
                return y
        delta: torch.Tensor | None = None
        for position, level in enumerate(levels):
            if isinstance(level, int):
                if level not in self.adapted:
                    continue  # an exact zero
                up = self._update(flat, level)  # (M, N)
                delta = up if delta is None else delta + up
                continue
            if not routing.per_token and x.shape[0] != level.shape[0]:
                raise RuntimeError(f"LoRA routing for {level.shape[0]} rows given a batch of {x.shape[0]}")
            # Rows grouped by adapter, each group with the arithmetic a row alone gets (`_update`).
            total = torch.zeros(flat.shape[0], self.out_features, dtype=self.b_dtype, device=flat.device) \
                if delta is None else delta
            for adapter, tokens in routing.groups(position, flat.shape[0]):
                if adapter in self.adapted:
                    total.index_add_(0, tokens, self._update(flat.index_select(0, tokens), adapter))
            delta = total
        if delta is not None:
            out += delta
        return y

    def _add(self, flat: torch.Tensor, adapter: int, out: torch.Tensor) -> None:
        """out += x·Aᵀ·(scale·B)ᵀ for rows `flat` (m, K) into `out` (m, N): one C++ call where the library
        is there (the sum in float32, rounded once to out's dtype: what `out += update` gives)."""
        if self.native is None or not _native_dtypes(flat, out):
            out += self._update(flat, adapter)
            return
        at, b_t = self.pointers[adapter]  # Aᵀ (K, R), Bᵀ (R, N): their addresses, read once at load
        self._native_call(flat, at, b_t, out, accumulate=True)

    def _add_routed(self, flat: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] += x[i]·Aᵀ·(scale·B)ᵀ with token i's adapter `index[i]` (-1: none), one C++ call: each
        row's arithmetic is the one `_add` gives it alone."""
        a, b_t, adapted = self.bases
        self._native_call(flat, a, b_t, out, accumulate=True, index=index.data_ptr(), adapted=adapted,
                          entries=self.a.shape[0])

    def _native_call(self, flat: torch.Tensor, at: int, b_t: int, out: torch.Tensor, accumulate: bool,
                     index: int | None = None, adapted: int | None = None, entries: int = 0) -> None:
        """csrc/lora.cpp on rows `flat` (m, K) into `out` (m, N, rows dense): tables at addresses `at`, `b_t`
        (or, with `index`, every entry's tables from those bases)."""
        assert self.native is not None
        if not flat.is_contiguous():
            flat = flat.contiguous()
        status = self.native(flat.data_ptr(), flat.dtype is torch.bfloat16, flat.shape[0], self.in_features, at,
                             self.rank, b_t, self.out_features, self.tables_bf16, out.data_ptr(),
                             out.dtype is torch.bfloat16, out.stride(0), accumulate, index, adapted, entries,
                             _PORTABLE)
        if status != 0:
            raise RuntimeError(f"native LoRA kernel: status {status} for rank {self.rank}")

    def _update(self, flat: torch.Tensor, adapter: int) -> torch.Tensor:
        """x·Aᵀ·(scale·B)ᵀ for rows `flat` (m, K) -> (m, N) float32, each row on its own. Not a matrix
        product: BLAS may block one by the row count, and a batched product (one per row) measured faster
        but changed a row's tokens in a batch of 8 on the default model. With the C++ library: its per-row
        sums (native/csrc/lora.cpp); else elementwise products summed over K, then over the rank."""
        a, b_t = self.views[adapter]  # (K, R) with the library, else (R, K); (R, N)
        if self.native is not None and _native_dtypes(flat, b_t):
            up = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)  # (m, N)
            self._native_call(flat, *self.pointers[adapter], up, accumulate=False)
            return up
        if self.native is not None:
            a, b_t = a.t().float(), b_t.float()  # (R, K), (R, N)
        down = (flat[:, None, :] * a).sum(-1)  # (m, R)
        return (down[:, :, None] * b_t).sum(1)  # (m, N)

    def extra_repr(self) -> str:
        return (f"adapters={len(self.adapted)}, rank={self.rank}, native={self.native is not None}, "
                f"tables={'bfloat16' if self.tables_bf16 else 'float32'}")


_PORTABLE = False  # tests: True runs csrc/lora.cpp's portable build where the CPU has AVX-512


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native_dtypes(flat: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the C++ update takes these: float32 or bfloat16 rows and output on the CPU, out's rows dense."""
    return flat.dtype in _NATIVE_DTYPES and out.dtype in _NATIVE_DTYPES and flat.device.type == "cpu" \
        and out.stride(-1) == 1


def _native_entry() -> Any:
    """csrc/lora.cpp's entry point, or None where lmcli's C++ library is off or could not be built."""
    from lmcli import native

    lib = native.library()
    return None if lib is None else lib.lora


# --- putting adapters on a model ---------------------------------------------------------------------


@dataclass
class LoadedAdapters:
    """What `apply` left on a model: the adapters by name (table index = position), merged or beside."""

    names: list[str]
    merged: bool
    files: list[AdapterFile]

    def index(self, name: str) -> int:
        return self.names.index(name)


_GPT2 = re.compile(r"transformer\.h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)")
_DECODER = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj|"
                      r"block_sparse_moe\.experts\.\d+\.w[123])")
_GPT2_NAMES = {"attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}


def _logical(model: Any, module: str, adapter: AdapterFile) -> list[tuple[str, int, int]]:
    """The lmcli modules (as named before fusing) a target adapts: (path, first row of B, rows)."""
    config = model.config
    if config.architecture == "gpt2":
        match = _GPT2.fullmatch(module.removeprefix("base_model.model."))
        if match is None:
            raise AdapterError(f"{adapter.path}: target module {module} is not one lmcli adapts on GPT-2 "
                               "(c_attn, c_proj, c_fc)")
        layer, part = match.groups()
        prefix = f"model.layers.{layer}"
        if part == "attn.c_attn":
            h = config.hidden_size
            return [(f"{prefix}.self_attn.{p}_proj", i * h, h) for i, p in enumerate("qkv")]
        return [(f"{prefix}.{_GPT2_NAMES[part]}", 0, -1)]
    match = _DECODER.fullmatch(module)
    if match is None:
        raise AdapterError(f"{adapter.path}: target module {module} is not one lmcli adapts (q/k/v/o_proj, "
                           "gate/up/down_proj, MoE experts' w1/w2/w3)")
    if int(match.group(1)) >= config.num_hidden_layers:
        raise AdapterError(f"{adapter.path}: target module {module} is past the model's "
                           f"{config.num_hidden_layers} layers")
    return [(module, 0, -1)]


def _physical(model: nn.Module, path: str) -> tuple[str, int, int]:
    """Where the pre-fusion module `path` lives now: (module path, its first output row, its rows)."""
    owner, _, leaf = path.rpartition(".")
    parent: Any = model.get_submodule(owner)
    found = parent._modules.get(leaf)
    if found is not None:
        base: Any = found.base if isinstance(found, LoraLinear) else found
        return path, 0, int(base.out_features)
    if leaf in ("q_proj", "k_proj", "v_proj") and getattr(parent, "qkv_proj", None) is not None:
        sizes = parent.qkv_sizes
        i = "qkv".index(leaf[0])
        return f"{owner}.qkv_proj", sum(sizes[:i]), sizes[i]
    if leaf in ("gate_proj", "up_proj") and getattr(parent, "gate_up_proj", None) is not None:
        half = _base(parent.gate_up_proj).out_features // 2
        return f"{owner}.gate_up_proj", 0 if leaf == "gate_proj" else half, half
    raise AdapterError(f"the model has no module {path}")


def _base(module: nn.Module) -> Any:
    return module.base if isinstance(module, LoraLinear) else module


def _unpermute_b(b: torch.Tensor, heads: int) -> torch.Tensor:
    from lmcli.io.gguf import unpermute_rope_rows

    return unpermute_rope_rows(b, heads)


def _segments(model: Any, adapters: Sequence[AdapterFile]) -> dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]]:
    """module path -> [(adapter index, first row, A (r, K), scale·B (rows, r))], every shape checked."""
    out: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    config = model.config
    for index, adapter in enumerate(adapters):
        if adapter.architecture is not None:
            ours = {"gemma3_text": "gemma3"}.get(config.model_type, config.model_type)
            family = {"mistral": "llama", "mixtral": "llama"}
            if family.get(ours, ours) != family.get(adapter.architecture, adapter.architecture):
                raise AdapterError(f"{adapter.path}: a LoRA for {adapter.architecture}, but the model is "
                                   f"{config.model_type}")
        for module, target in _expanded(model, adapter).items():
            logical = _logical(model, module, adapter)
            rows_total = sum(n for _, _, n in logical) if all(n > 0 for _, _, n in logical) else None
            first = 0
            for path, _, rows in logical:
                try:
                    where, offset, size = _physical(model, path)
                except (AttributeError, AdapterError):
                    raise AdapterError(f"{adapter.path}: target module {module} is not in this model") from None
                base = _base(model.get_submodule(where))
                take = size if rows < 0 else rows
                b = target.b
                if adapter.rope_permuted and path.endswith(("q_proj", "k_proj")):
                    heads = config.num_attention_heads if path.endswith("q_proj") else config.num_key_value_heads
                    b = _unpermute_b(b, heads)
                expected_out = rows_total if rows_total is not None else size
                if target.a.shape[1] != base.in_features or b.shape[0] != expected_out:
                    raise AdapterError(
                        f"{adapter.path}: {module} has lora_A {list(target.a.shape)} and lora_B {list(b.shape)}, "
                        f"but the model's module takes {base.in_features} inputs and gives {expected_out} outputs")
                piece = b[first:first + take] * target.scale  # (rows, r)
                out.setdefault(where, []).append((index, offset, target.a, piece))
                first += take
    return out


def _expanded(model: Any, adapter: AdapterFile) -> dict[str, Target]:
    """The adapter's targets, a stacked experts' update (io/lora_files.Target.stacked) split into one
    target per expert and projection: lmcli's experts are modules of their own (w1 gate, w3 up, w2 down)."""
    import math

    config = model.config
    out: dict[str, Target] = {}
    for module, target in adapter.targets.items():
        if target.stacked is None:
            out[module] = target
            continue
        experts = getattr(config, "num_local_experts", 0) or 0
        prefix = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts@\d+x\d+", module)
        a, b = target.a, target.b
        hidden, inner = config.hidden_size, config.intermediate_size
        if prefix is None or not experts or a.shape[0] % experts:
            raise AdapterError(f"{adapter.path}: a stacked experts' update of {module.split('@')[0]} with lora_A "
                               f"{list(a.shape)}, but the model has {experts or 'no'} experts of that shape")
        if a.shape[1] == hidden and b.shape[0] == 2 * inner:
            parameter, parts = "gate_up_proj", [("w1", 0, inner), ("w3", inner, inner)]
        elif a.shape[1] == inner and b.shape[0] == hidden:
            parameter, parts = "down_proj", [("w2", 0, hidden)]
        else:
            raise AdapterError(f"{adapter.path}: {module.split('@')[0]}: lora_A {list(a.shape)} and lora_B "
                               f"{list(b.shape)} fit neither the experts' gate_up_proj nor their down_proj")
        rank = a.shape[0] // experts
        info = target.stacked
        if parameter not in info["alphas"] or info["ranks"][parameter] != rank:
            raise AdapterError(f"{adapter.path}: the experts' {parameter} update has rank {rank}, not what "
                               "adapter_config.json says")
        scale = info["alphas"][parameter] / (math.sqrt(rank) if info["rslora"] else rank) * target.scale
        per_a = a.reshape(experts, rank, a.shape[1])  # (E, r, in): expert e's rows e*r .. e*r + r
        per_b = b.reshape(b.shape[0], rank, experts)  # (out, r, E): expert e's columns r_i*E + e
        for e in range(experts):
            for leaf, first, rows in parts:
                name = f"model.layers.{prefix.group(1)}.block_sparse_moe.experts.{e}.{leaf}"
                out[name] = Target(per_a[e].contiguous(), per_b[first:first + rows, :, e].contiguous(), scale)
    return out


def check_base_model(adapter: AdapterFile, model_names: Sequence[str], strict: bool) -> None:
    """A warning (an error with --strict) when adapter_config.json names another base model."""
    if not adapter.base_model:
        return
    wanted = adapter.base_model.rstrip("/").rsplit("/", 1)[-1].lower()
    if any(wanted and wanted in name.lower() for name in model_names if name):
        return
    message = (f"{adapter.path}: the adapter was trained on {adapter.base_model}, which does not look like the "
               f"loaded model ({model_names[0] if model_names else '?'})")
    if strict:
        raise AdapterError(message + " (--strict)")
    sys.stderr.write(f"warning: {message}\n")


def apply(model: Any, adapters: Sequence[AdapterFile], merge: bool) -> LoadedAdapters:
    """Put `adapters` on `model` (loaded: fused, quantized or not): merged into float nn.Linear weights
    where `merge` allows it and every adapted weight is float, else as LoraLinear modules. Raises
    AdapterError (one line) for a target the model does not have or a shape that does not fit."""
    names = [a.name for a in adapters]
    for i, name in enumerate(names):
        if name == NONE or name in names[:i]:
            raise UsageError(f"--lora: two adapters named {name!r} (or the reserved name 'none'); rename one's "
                             "directory or file")
    segments = _segments(model, adapters)
    modules = {path: model.get_submodule(path) for path in segments}
    if merge and all(type(m) is nn.Linear for m in modules.values()):
        for path, parts in segments.items():
            linear = modules[path]
            weight = linear.weight.detach().clone()  # (N, K): a copy (the old one may map the file)
            for _, offset, a, b in parts:
                weight[offset:offset + b.shape[0]] += (b @ a).to(weight.dtype)  # (rows, K)
            linear.weight = nn.Parameter(weight, requires_grad=False)
        model.lora = LoadedAdapters(names, True, list(adapters))
        return model.lora
    count = len(adapters)
    for path, parts in segments.items():
        base = _base(modules[path])
        rank = max(sum(a.shape[0] for i, _, a, _ in parts if i == e) for e in range(count))
        device = model.device
        a_table = torch.zeros(count + 1, rank, base.in_features, device=device)  # (E + 1, R, K)
        b_table = torch.zeros(count + 1, base.out_features, rank, device=device)  # (E + 1, N, R)
        used = [0] * count
        for e, offset, a, b in parts:
            r = a.shape[0]
            a_table[e, used[e]:used[e] + r] = a
            b_table[e, offset:offset + b.shape[0], used[e]:used[e] + r] = b
            used[e] += r
        owner, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(owner), leaf,
                LoraLinear(base, a_table, b_table, frozenset(e for e, _, _, _ in parts), count,
                           tables=getattr(model, "dtype", torch.float32)))
    model.lora = LoadedAdapters(names, False, list(adapters))
    return model.lora


def attach(model: Any, specs: Sequence[str], merge: bool, strict: bool = False,
           model_names: Sequence[str] = ()) -> LoadedAdapters | None:
    """Read the adapters `specs` (--lora PATH[:SCALE] each) and `apply` them; None for no specs."""
    from lmcli.io.lora_files import read_adapter

    if not specs:
        return None
    files = [read_adapter(spec) for spec in specs]
    for adapter in files:
        if model_names:
            check_base_model(adapter, model_names, strict)
    return apply(model, files, merge)


def loaded(model: Any) -> LoadedAdapters | None:
    return getattr(model, "lora", None)


def routing_for(model: Any, choices: Sequence[str | None]) -> Routing | None:
    """The routing for rows choosing `choices` (a loaded adapter's name, "none", or None: the command's
    adapters); None where every row takes the command's (the default). RowError for an unknown name."""
    adapters = loaded(model)
    if all(choice is None for choice in choices):
        return None
    if adapters is None or adapters.merged:
        from lmcli.settings.generation_settings import RowError

        if adapters is None:
            raise RowError('"lora" picks an adapter, but none is loaded (give --lora PATH)')
        raise RowError('"lora" cannot pick an adapter here: the adapter is merged into the weights')
    count = len(adapters.names)
    stacks = [list(range(count)) if c is None else [] if c == NONE else [check_name(adapters, c)] for c in choices]
    depth = max(len(s) for s in stacks)
    levels: list[int | torch.Tensor] = []
    for i in range(depth):
        column = [s[i] if i < len(s) else -1 for s in stacks]  # -1: none
        if len(set(column)) == 1:
            levels.append(column[0])
        else:
            levels.append(torch.tensor(column, dtype=torch.long, device=model.device))
    return Routing(tuple(levels))


def check_name(adapters: LoadedAdapters, name: str) -> int:
    if name not in adapters.names:
        from lmcli.settings.generation_settings import RowError

        raise RowError(f'"lora": no adapter named {name!r} is loaded (loaded: {", ".join(adapters.names)}; '
                       f'"none" for no adapter)')
    return adapters.index(name)


def check_row(model: Any, name: str | None) -> None:
    """RowError now (before the row runs) for a row naming an adapter that is not loaded."""
    if name is not None:
        routing_for(model, [name])


def describe(adapter: AdapterFile) -> list[tuple[str, str]]:
    """`lmcli info --lora PATH`'s facts about one adapter."""
    layers = sorted({int(m) for m in re.findall(r"(?:layers|\.h)\.(\d+)\.", " ".join(adapter.targets))})
    span = f"layers {layers[0]}-{layers[-1]}" if layers else "?"
    scale = sorted({round(t.scale, 6) for t in adapter.targets.values()})
    facts = [("adapter", f"{adapter.name} ({'PEFT directory' if adapter.kind == 'peft' else 'GGUF LoRA'}: {adapter.path})"),
             ("targets", f"{', '.join(adapter.module_kinds())} in {span} ({len(adapter.targets)} modules)"),
             ("rank", ", ".join(map(str, adapter.ranks))),
             ("scale", ", ".join(f"{s:g}" for s in scale) + (f" (alpha {adapter.alpha:g})" if adapter.alpha else "")),
             ("size", f"{adapter.parameters:,} parameters ({adapter.parameters * 4 / 2**20:,.1f} MiB in float32)")]
    if adapter.base_model:
        facts.append(("trained on", adapter.base_model))
    facts.extend(("note", note) for note in adapter.notes)
    return facts
