"""Tensor-parallel and data-parallel generation on torch.distributed, started by `torchrun`.

Processes, rendezvous and networking are torch's: `torchrun` starts the ranks and sets RANK /
WORLD_SIZE / MASTER_ADDR; lmcli joins the process group (gloo on CPU, NCCL on CUDA).

Tensor parallel (Megatron-style) leaves the architectures as they are. Each rank builds the
ordinary BaseModel from a per-rank config (query heads / N, key/value heads / N, MLP units / N, a
slice of the vocabulary), reads only its own slices of the safetensors tensors, and a few hooks make
the pieces add up to the whole model:

  q, k, v, gate, up, experts' w1/w3   column-parallel: the rows of this rank's heads / hidden units
  o, down, experts' w2                row-parallel: the matching columns; one all-reduce sums the
                                      partial outputs of each attention / MLP / MoE block (the bias
                                      is kept by rank 0 only, so it is added once)
  embedding and head                  vocabulary-parallel: rows of the vocabulary; the embedding
                                      all-reduces masked lookups, the head all-gathers its logits
  norms, router, positions            replicated

Mixtral's experts are each split like an MLP (every rank holds every expert's slice), so routing
stays replicated and each MoE block needs one all-reduce. Sampling runs on every rank over the same
gathered logits with the same seeds; rank 0's tokens are broadcast each step all the same, so the
ranks cannot drift apart.

Data parallel (batch jobs without --tp), and a batch job under tensor parallel: lmcli.jobs.distributed,
above the jobs; this module sits below loading, which builds a rank's part.

Reading a rank's part of each tensor is io/checkpoint.py's (LazyTensor).
"""

from __future__ import annotations

import dataclasses
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmcli.errors import UsageError
from lmcli.io.checkpoint import LazyTensor
from lmcli.io.checkpoint import lazy_safetensors as lazy_safetensors  # where a rank's loading finds it

# --- the process group ----------------------------------------------------------------------------


def launched_by_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets torch's env:// variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# Data-parallel ranks meet only at the start and the end of a job, and the first to finish waits for
# the last: far longer than torch's default timeout (30 minutes on gloo, 10 on NCCL).
JOB_TIMEOUT = timedelta(days=7)


def start(device: str | None = None, timeout: timedelta | None = None) -> None:
    """Join the process group torchrun describes, once: NCCL when running on CUDA, else gloo."""
    if dist.is_initialized():
        return
    use_cuda = device not in ("cpu",) and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timeout)


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_output_rank() -> bool:
    """Only rank 0 prints and writes results."""
    return rank() == 0


def rank_device(device: torch.device) -> torch.device:
    """Each rank runs on its own GPU (cuda:LOCAL_RANK); CPU ranks share the CPU."""
    if device.type == "cuda" and device.index is None and dist.is_initialized():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


# --- tensor parallel ------------------------------------------------------------------------------

# Parameter names (the shared decoder's) and how each is split.
_COLUMN_PARALLEL = re.compile(r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj|experts\.\d+\.w[13])\.(weight|bias)$")
_ROW_PARALLEL = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj|experts\.\d+\.w2)\.weight$")
_ROW_PARALLEL_BIAS = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.bias$")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def _sum_over_ranks(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a row-parallel block: the ranks' partial outputs add up to the whole."""
    dist.all_reduce(output)
    return output


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [vocab_start, vocab_start + rows) of the embedding; other ids look up zeros,
    and the all-reduce fills them in from the rank that holds them."""

    def __init__(self, rows: int, dim: int, vocab_start: int):
        super().__init__(rows, dim)
        self.vocab_start = vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start  # (B, T)
        held = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # (B, T, hidden)
        out = out.masked_fill(~held[..., None], 0.0)
        dist.all_reduce(out)
        return out


def check_world(tp: int | None) -> None:
    """`--tp N` needs a process group of N ranks (torchrun --nproc-per-node N)."""
    if tp is None or (tp == 1 and world_size() == 1):
        return
    if not dist.is_initialized():
        raise UsageError(f"--tp {tp} needs {tp} processes started by torchrun "
                         f"(torchrun --nproc-per-node {tp} -m lmcli generate --tp {tp} ...)")
    if dist.get_world_size() != tp:
        raise UsageError(f"--tp {tp} but torchrun started {dist.get_world_size()} processes "
                         f"(use --nproc-per-node {tp}, or --tp {dist.get_world_size()})")


def check_divides(config, tp: int) -> None:
    """Heads and MLP units must split evenly over the ranks (the vocabulary need not)."""
    sizes = {"query heads": config.num_attention_heads, "key/value heads": config.num_key_value_heads,
             "MLP hidden units": config.intermediate_size}
    uneven = [f"{count} {what}" for what, count in sizes.items() if count % tp]
    if uneven:
        divisors = [n for n in range(1, max(sizes.values()) + 1) if all(c % n == 0 for c in sizes.values())]
        raise UsageError(
            f"--tp {tp}: the model's {' and '.join(uneven)} do not divide among {tp} ranks "
            f"(it has {', '.join(f'{c} {w}' for w, c in sizes.items())}; --tp may be "
            f"{', '.join(map(str, divisors))})"
        )


class TensorParallel:
    """How one model is split over the `size` ranks of the default process group."""

    def __init__(self, config, size: int, rank: int):
        self.config = config
        self.size = size
        self.rank = rank
        # Vocabularies rarely divide evenly: every rank holds ceil(V / N) rows, the last padded with
        # zeros, so the gathered logits have equal parts; the padding is cut off after the gather.
        self.vocab_rows = -(-config.vocab_size // size)
        self.vocab_start = rank * self.vocab_rows

    @classmethod
    def for_config(cls, config, tp: int) -> TensorParallel:
        """Check that the process group has `tp` ranks and the model divides among them, before any
        weight is read."""
        check_divides(config, tp)
        check_world(tp)
        return cls(config, tp, dist.get_rank())

    def local_config(self):
        """The config this rank's modules are built from: its share of heads, units and vocabulary."""
        config = self.config
        return dataclasses.replace(
            config,
            num_attention_heads=config.num_attention_heads // self.size,
            num_key_value_heads=config.num_key_value_heads // self.size,
            intermediate_size=config.intermediate_size // self.size,
            vocab_size=self.vocab_rows,
        )

    def build_model(self, cls: type | None = None) -> Any:
        """This rank's BaseModel, of class `cls` (loading's, which generates) where given (parameters
        uninitialised if the caller says so), hooked up."""
        from lmcli.models.base import BaseModel

        model: Any = (cls or BaseModel)(self.local_config())
        # The rest of lmcli sees the whole vocabulary: the head's gathered logits span all of it.
        model.config = dataclasses.replace(model.config, vocab_size=self.config.vocab_size)
        decoder = model.model
        decoder.embed_tokens = VocabParallelEmbedding(self.vocab_rows, self.config.hidden_size, self.vocab_start)
        model.tie_weights()
        layer: Any
        for layer in decoder.layers:
            # After o_proj and after down_proj (or the whole MoE block): one all-reduce each.
            layer.self_attn.register_forward_hook(_sum_over_ranks)
            layer.feed_forward.register_forward_hook(_sum_over_ranks)
        model.lm_head.register_forward_hook(self._gather_logits)
        model.tensor_parallel = self  # the generation loop asks it to share rank 0's tokens
        return model

    def _gather_logits(self, _module: nn.Module, _args: Any, logits: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(logits) for _ in range(self.size)]  # each (B, T, V / N)
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[..., : self.config.vocab_size]  # (B, T, V)

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's choice of next tokens [B], on every rank."""
        dist.broadcast(tokens, src=0)
        return tokens

    def take_shards(self, tensors: dict[str, LazyTensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read this rank's part of every tensor, one at a time; floating-point ones cast to `dtype`."""
        shards = {}
        for name, lazy in tensors.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # a tied head saved explicitly: the embedding's rows serve as the head
            shard = self._shard(name, lazy)
            if not shard.is_floating_point():
                raise UsageError(f"--tp {self.size}: {lazy.path}: tensor '{lazy.name}' is {shard.dtype}; "
                                 "tensor parallel shards float weights only (float32, bfloat16, float16)")
            shards[name] = shard.to(dtype)
        return shards

    def _shard(self, name: str, lazy: LazyTensor) -> torch.Tensor:
        shape = lazy.shape
        if _COLUMN_PARALLEL.search(name):
            size = shape[0] // self.size
            return lazy.read(rows=slice(self.rank * size, (self.rank + 1) * size))
        if _ROW_PARALLEL.search(name):
            size = shape[1] // self.size
            return lazy.read(columns=slice(self.rank * size, (self.rank + 1) * size))
        if _ROW_PARALLEL_BIAS.search(name):
            return lazy.read() if self.rank == 0 else torch.zeros(shape)
        if name in _VOCAB_PARALLEL:
            end = min(self.vocab_start + self.vocab_rows, shape[0])
            part = lazy.read(rows=slice(min(self.vocab_start, end), end))  # (rows <= V / N, hidden)
            missing = self.vocab_rows - part.shape[0]
            return F.pad(part, (0, 0, 0, missing)) if missing else part
        return lazy.read()


def refuse_gguf(tp: int, path: Path) -> UsageError:
    return UsageError(
        f"--tp {tp}: {path} is a GGUF file; tensor parallel reads float safetensors "
        f"(convert it first: lmcli convert {path} DIR, then --checkpoint DIR)"
    )


def parallel_for(tp: int | None, config) -> TensorParallel | None:
    """The tensor-parallel split asked for (None for one process)."""
    if tp is None or (tp == 1 and world_size() == 1):
        return None
    return TensorParallel.for_config(config, tp)
