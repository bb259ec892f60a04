"""Quantized weights in a model: `QuantLinear` / `QuantEmbedding` over a kernel (kernels/matmul.py).

The architectures build plain `nn.Linear` / `nn.Embedding` modules; at load, `QuantizedInstaller`
swaps the ones whose checkpoint tensor is a `GroupQuantized` for `QuantLinear` / `QuantEmbedding`,
with the kernel kernels/plan.py chose for that weight kind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmcli.io.group_quantized import GroupQuantized
from lmcli.kernels.matmul import Kernel, build_kernel, concat_kernels
from lmcli.kernels.plan import KernelChoice, kernel_plan

# --- modules ---------------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """nn.Linear over a quantized weight: `kernel` for few rows, dequantise + F.linear from `large_rows` on.

    The kernel multiplies in its own dtype (bfloat16 by default); `dtype`, the model's residual dtype
    (float32 around half-precision kernels), is what it takes and gives: inputs are rounded to the
    kernel's dtype here and only here, and what comes out is widened at once, so that the sums,
    activation functions and norms between the products keep float32's precision."""

    def __init__(self, kernel: Kernel, bias: torch.Tensor | None, large_rows: int | None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.kernel, self.large_rows = kernel, large_rows
        self.in_features, self.out_features = kernel.k, kernel.n
        self.dtype = dtype or kernel.dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.kernel.dtype)  # (M, K)
        weight = self.kernel.dequantise() if self.large_rows is not None and flat.shape[0] >= self.large_rows else None
        y = (F.linear(flat, weight) if weight is not None else self.kernel.matmul(flat)).to(self.dtype)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel.name}"


class QuantHead(QuantLinear):
    """The output head over a quantized matrix, whose logits near each row's top are float32.

    A half-precision kernel rounds logits to 8 significant bits (0.125 apart between 16 and 32), so a
    near-tie for the most likely token was decided by that rounding (the default model answered
    "L'Etoile" for "The" at a tie, where float32 is 0.08 apart). The tokens within `TOP_MARGIN` of a
    row's largest logit (relative; several roundings wide, and a few tokens of the vocabulary) are
    computed again from the float32 input and the kernel's weights in float32, each on its own
    (a product summed over one row of K), so the value is the same whatever else the batch holds."""

    TOP_MARGIN = 2**-5  # of the largest logit's magnitude: 4 to 8 bfloat16 roundings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)  # (..., V)
        if self.kernel.dtype.itemsize >= 4:
            return logits
        flat, inputs = logits.float().reshape(-1, self.out_features), x.reshape(-1, self.in_features).float()  # (M, V), (M, K)
        top = flat.amax(dim=-1, keepdim=True)  # (M, 1)
        rows, tokens = (flat >= top - self.TOP_MARGIN * top.abs().clamp(min=1.0)).nonzero(as_tuple=True)  # (C,) each
        weights = self.kernel.rows(tokens, torch.float32)  # (C, K)
        if weights is None:  # a stored form without row lookup: the kernel's logits as they are
            return logits
        exact = (inputs[rows] * weights).sum(dim=-1)  # (C,)
        if self.bias is not None:
            exact = exact + self.bias.float()[tokens]
        flat[rows, tokens] = exact
        return flat.view(logits.shape)  # float32


class QuantEmbedding(nn.Module):
    """nn.Embedding over a quantized matrix: gather the rows, dequantise only those."""

    def __init__(self, kernel: Kernel, large_rows: int | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.kernel, self.large_rows = kernel, large_rows  # large_rows: for a head tied to this matrix
        self.num_embeddings, self.embedding_dim = kernel.n, kernel.k
        self.dtype = dtype or kernel.dtype  # of the rows returned: the residual stream's (exact widening)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.kernel.rows(ids.reshape(-1))
        assert rows is not None, "an embedding kernel must support row lookup"
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)


# --- installing into a model ------------------------------------------------------------------------


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    owner, _, leaf = path.rpartition(".")
    return (model.get_submodule(owner) if owner else model), leaf


class QuantizedInstaller:
    """Swaps the nn.Linear / nn.Embedding owning `<module>.weight` for its quantized counterpart, one
    weight at a time, so a loader can read, install and free each weight before the next.

    `choices` collects the kernel choice per weight format, for reports. A tied head (`lm_head` with
    no weight of its own) later shares the embedding's kernel (`tie_quantized_head`).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, source: str = "checkpoint",
                 residual: torch.dtype | None = None):
        self.model, self.dtype, self.device, self.source = model, dtype, device, source
        self.residual = residual or dtype  # what an embedding's rows are widened to
        self.choices: dict[str, KernelChoice] = {}

    def install(self, name: str, q: GroupQuantized) -> None:
        from lmcli.errors import CheckpointError

        module_path = name.removesuffix(".weight")
        old = None
        if name.endswith(".weight"):
            with contextlib.suppress(AttributeError):
                old = self.model.get_submodule(module_path)
        if not isinstance(old, (nn.Linear, nn.Embedding)):
            raise CheckpointError(f"{self.source}: unexpected quantized tensor '{name}' {list(q.shape)} "
                                  "(not the weight of a linear or embedding layer of this model)")
        if tuple(q.shape) != tuple(old.weight.shape):
            raise CheckpointError(f"{self.source}: tensor '{name}' has shape {list(q.shape)} but the model "
                                  f"expects {list(old.weight.shape)}")
        choice = self.choices.get(q.kind) or kernel_plan(q.kind, self.dtype, self.device)
        self.choices[q.kind] = choice
        kernel_name = choice.kernel
        kernel_group = 2 * q.group if q.bits == 8 else q.group  # int4pair doubles the columns
        if kernel_group % 32 and kernel_name not in ("dequantise", "native"):  # torch's int4 kernel groups 32+ values
            kernel_name = "dequantise"
        try:
            kernel = build_kernel(kernel_name, q, self.dtype, self.device)
        except RuntimeError:  # a shape torch's packing refuses (rows not a multiple of its block, ...)
            kernel_name = "dequantise"
            kernel = build_kernel(kernel_name, q, self.dtype, self.device)
        large_rows = choice.large_rows if kernel_name == choice.kernel else None
        parent, leaf = _parent(self.model, module_path)
        if isinstance(old, nn.Embedding):
            if kernel.rows(torch.zeros(1, dtype=torch.long, device=self.device)) is None:
                kernel = build_kernel("dequantise", q, self.dtype, self.device)
            setattr(parent, leaf, QuantEmbedding(kernel, large_rows, self.residual))
        else:
            bias = None if old.bias is None else torch.empty(old.out_features, dtype=self.residual, device=self.device)
            head = QuantHead if module_path == "lm_head" else QuantLinear
            setattr(parent, leaf, head(kernel, bias, large_rows, self.residual))  # bias: filled by name later


def tie_quantized_head(model: nn.Module) -> bool:
    """If the embedding is quantized, make the head a QuantLinear over the same kernel. True if done."""
    embedding: Any = model.get_submodule("model.embed_tokens")
    if not isinstance(embedding, QuantEmbedding):
        return False
    model.lm_head = QuantHead(embedding.kernel, None, embedding.large_rows, embedding.dtype)
    return True


class WeightCounting:
    """`weight_formats()` and `num_parameters()` for a model (decoders and encoder-decoders alike)."""

    def weight_formats(self) -> dict[str, int]:
        """How many weights are stored in each form: {"float32": n, "int4pack": n, ...}."""
        assert isinstance(self, nn.Module)
        return weight_formats(self)

    def num_parameters(self) -> int:
        return sum(self.weight_formats().values())


def weight_formats(model: nn.Module) -> dict[str, int]:
    """How many weights of each stored form: {"int4pack": n, "float32": n, ...}."""
    counts: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)) and id(module.kernel) not in seen:
            seen.add(id(module.kernel))
            counts[module.kernel.name] = counts.get(module.kernel.name, 0) + module.kernel.n * module.kernel.k
    for parameter in {id(p): p for p in model.parameters()}.values():
        key = str(parameter.dtype).removeprefix("torch.")
        counts[key] = counts.get(key, 0) + parameter.numel()
    return counts


# --- fused projections: one matrix call where a layer had several -----------------------------------


def _joined_bias(parts: list[Any]) -> torch.Tensor | None:
    """The parts' biases side by side (a missing one is 0), or None if none has one."""
    present = next((p.bias for p in parts if p.bias is not None), None)
    if present is None:
        return None
    return torch.cat([torch.zeros(p.out_features, dtype=present.dtype, device=present.device) if p.bias is None
                      else p.bias.detach() for p in parts])


def fuse_linears(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One linear layer computing what `parts` (same input size) compute, their outputs side by side:
    the weights (and biases) joined by rows. nn.Linear parts give an nn.Linear, QuantLinear parts a
    QuantLinear over `concat_kernels`. None where they cannot be joined (mixed forms, dtypes, devices;
    quantized kernels that do not concatenate); the caller then keeps the parts."""
    modules: list[Any] = list(parts)
    if len({m.in_features for m in modules}) != 1:
        return None
    bias = _joined_bias(modules)
    if all(type(m) is nn.Linear for m in modules):
        weights = [m.weight for m in modules]
        if len({(w.dtype, w.device) for w in weights}) != 1:
            return None
        # nn.Linear's own __init__ would allocate and initialise a weight only to drop it.
        fused = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features = modules[0].in_features, sum(m.out_features for m in modules)
        requires_grad = weights[0].requires_grad
        fused.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=requires_grad)  # (N, K)
        fused.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=requires_grad))
        return fused
    if all(type(m) is QuantLinear for m in modules) and len({(m.large_rows, m.dtype) for m in modules}) == 1:
        kernel = concat_kernels([m.kernel for m in modules])
        return None if kernel is None else QuantLinear(kernel, bias, modules[0].large_rows, modules[0].dtype)
    return None
