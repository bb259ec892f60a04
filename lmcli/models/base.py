"""BaseModel: the one decoder every architecture is built from.

An architecture module supplies a ModelConfig (from its HF config) and, where its checkpoint names
differ from the llama-style names used here, a `convert_checkpoint` that renames tensors. Everything
else — embeddings, the layer stack, the head and caching — lives here once; generation sits above, in
lmcli.generation, which runs a model through its slot contract (models/slots.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmcli.config import SLIDING, ModelConfig
from lmcli.errors import first_line
from lmcli.kernels.linear import WeightCounting
from lmcli.kernels.numerics import HasNumerics, Numerics
from lmcli.models.layers import (
    MLP,
    Attention,
    AttentionInputs,
    SparseMoE,
    make_norm,
    rope_cos_sin,
    rope_inverse_frequencies,
)
from lmcli.models.slots import positions_from_mask

if TYPE_CHECKING:
    from lmcli.models.cache import LayerCache, ModelCache


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str):
        super().__init__()
        self.self_attn = Attention(config, layer_type)
        self.input_layernorm = make_norm(config)
        # llama: the norm before the MLP; gemma2/3 (sandwich): the norm after attention.
        self.post_attention_layernorm = make_norm(config)
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(config)
            self.post_feedforward_layernorm = make_norm(config)
        if config.num_local_experts:
            self.block_sparse_moe = SparseMoE(config)
        else:
            self.mlp = MLP(config)
        self.sandwich = config.sandwich_norms

    @property
    def feed_forward(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, cache: LayerCache | None = None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), inputs, cache)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.feed_forward(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.feed_forward(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, t) for t in config.layer_types)
        self.norm = make_norm(config)


class BaseModel(HasNumerics, WeightCounting, nn.Module):
    """A decoder-only language model. `model(input_ids, attention_mask)` returns logits [B, T, vocab]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # What a load chose for the arithmetic (kernel plan, invariance, activation dtype) is one frozen
        # record, `self.numerics` (kernels/numerics.py), installed by the loader: no switch of its own here.
        self._inverse_frequencies: dict[str, torch.Tensor] = {}
        self._compiled_decode: Callable[..., torch.Tensor] | None = None  # see compile_decode
        self._compiled_prefill: Any = None  # models/compiled_prefill.CachedPrefill, see compile_decode
        self.eval()

    def use_fast_layout(self) -> None:
        """Store the output head column-major on CPU: same [vocab, hidden] shape, but `F.linear` then
        reads a contiguous [hidden, vocab] matrix, which CPU BLAS streams about 1.8x faster for the
        head's large matrix-vector product (measured: 6.5 -> 11.8 GB/s for SmolLM2's 49152 x 576).
        The layers' smaller matrices gained nothing measurable, so they keep the loaded layout, as
        does everything on GPUs."""
        if self.device.type == "cpu" and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight.data = self.lm_head.weight.data.t().contiguous().t()

    def fuse_projections(self, after_each_layer: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Join each layer's q/k/v into one projection and a gated MLP's gate/up into another, so a
        token takes 4 matrix calls per layer instead of 7. Called once the weights are in: checkpoints
        load by their own names. Layer by layer, so only one layer's parts are ever held twice;
        `after_each_layer` is given the float weights just replaced (still alive while it runs), so
        the loader can hand their memory back: file pages of a mapped checkpoint, and what glibc
        keeps of freed memory (without that the default model's peak grew by 23 MiB).
        Projections that cannot be joined (see `linear.fuse_linears`) stay as they are; mixture-of-
        experts blocks are left alone."""
        layer: Any
        for layer in self.model.layers:
            attention, feed_forward = layer.self_attn, layer.feed_forward
            parts = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
            if isinstance(feed_forward, MLP):
                parts += [feed_forward.gate_proj, getattr(feed_forward, "up_proj", None)]
            weights = [part.weight for part in parts if isinstance(part, nn.Linear)]
            attention.fuse_projections()
            if isinstance(feed_forward, MLP):
                feed_forward.fuse_projections()
            if after_each_layer is not None:
                after_each_layer(weights)
            del weights, parts

    def tie_weights(self) -> None:
        from lmcli.kernels.linear import tie_quantized_head

        if self.config.tie_word_embeddings and not tie_quantized_head(self):
            self.lm_head.weight = self.model.embed_tokens.weight

    # --- forward ----------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for a whole (possibly left-padded) batch, without a cache."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        slot_is_token = attention_mask.bool()
        positions = positions_from_mask(slot_is_token)
        query_slots = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.forward_slots(input_ids, positions, query_slots, slot_is_token)

    def forward_slots(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] position of each token in its own row's text
        query_slots: torch.Tensor,  # [T] the sequence columns these tokens occupy
        slot_is_token: torch.Tensor,  # [B, S_total] False for pad columns
        cache: ModelCache | None = None,
        last_only: bool = False,
        numerics: Numerics | None = None,
    ) -> torch.Tensor:
        """Logits for the tokens `input_ids` at `query_slots`, reading and writing `cache`, with the
        arithmetic `numerics` chose (None: the load's, `self.numerics`). Here the step decides between
        the eager pass and a compiled program (built for the load's numerics: only those run it)."""
        if numerics is None or numerics is self.numerics or numerics == self.numerics:
            compiled = self._compiled_decode
            if compiled is not None and cache is not None and input_ids.shape[1] == 1:
                return self._decode_compiled(compiled, input_ids, positions, query_slots, slot_is_token, cache,
                                             last_only)
            prefill = self._compiled_prefill
            if prefill is not None and cache is not None and last_only and prefill.takes(input_ids, query_slots,
                                                                                         slot_is_token, cache):
                return prefill(input_ids, positions, query_slots, slot_is_token, cache)
        slot_end = int(query_slots[-1]) + 1 if cache is not None else None  # one host sync per call
        return self._forward_slots(input_ids, positions, query_slots, slot_is_token, cache, slot_end, last_only,
                                   numerics=numerics)

    def _forward_slots(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                       slot_is_token: torch.Tensor, cache: ModelCache | None, slot_end: int | None,
                       last_only: bool, row_gather: tuple[torch.Tensor, torch.Tensor] | None = None,
                       numerics: Numerics | None = None) -> torch.Tensor:
        """forward_slots, given the last query slot + 1 (`slot_end`) on the host: what `compile_decode` compiles
        (`row_gather`: a one-token step's batch-invariant attention as tensors, models/compiled_step.py)."""
        config = self.config
        numerics = self.numerics if numerics is None else numerics
        x = self.model.embed_tokens(input_ids)  # (B, T, hidden), in the residual dtype
        if config.scale_embeddings:
            x = x * torch.tensor(config.hidden_size**0.5, dtype=x.dtype)
        if config.position_embedding == "learned":
            x = x + self.model.embed_positions(positions)
        inputs = AttentionInputs(query_slots, slot_is_token, self._rope_tables(positions, x.dtype), slot_end,
                                 by_row=numerics.batch_invariant, dtype=numerics.activation_dtype,
                                 row_gather=row_gather)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, inputs, None if cache is None else cache.layers[index])
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x))  # (B, T, vocab)
        if config.final_logit_softcapping is not None:
            cap = config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    # --- torch.compile for decode steps (opt-in) -----------------------------------------------------

    def compile_decode(self, builds: bool = True) -> bool:
        """Run single-token decode steps through torch.compile from now on (prefill stays eager).

        `builds` False (`--compile auto`): only the CPU programs already in the cache are used, nothing is
        built or compiled, and nothing is said; returns whether any may run.

        CPU: inductor, the step's length of history left dynamic (one recompile after the first step,
        then none). CUDA: mode "reduce-overhead" (CUDA graphs), attending over the whole cache so
        that every step has the same shapes and needs no host sync; untested here, for want of a GPU.
        If compiling fails, a one-line warning says so and decoding goes on eagerly. Tensor-parallel
        models (collectives in forward hooks) stay eager; returns False for them, else True.
        """
        if getattr(self, "tensor_parallel", None) is not None:
            if builds:
                sys.stderr.write("warning: --compile is not supported with --tp; decoding without it\n")
            return False
        if self.device.type == "cpu" and not os.environ.get("LMCLI_COMPILE_JIT"):
            from lmcli.models import compiled_step

            # `auto` only where the eager path is itself not pinned to transformers' numbers (quantized
            # weights on the batch-invariant path): float checkpoints stay eager unless asked.
            why = compiled_step.unsupported(self) or (None if builds or self.batch_invariant else "float weights")
            if why is None:  # a program built once per model, machine and batch size (io/compiled_cache.py)
                self._compiled_decode = compiled_step.CachedDecode(self, builds)
                from lmcli.models import compiled_prefill

                if builds and compiled_prefill.pays_here():  # batch-1 prompts in chunks, beside the step
                    self._compiled_prefill = compiled_prefill.CachedPrefill(self)
                return True
            if not builds:
                return False
            if compiled_step.holds_native_kernels(self):  # torch.compile would break its graph at every call
                sys.stderr.write(f"note: --compile: {why}; decoding eagerly\n")
                return False
            sys.stderr.write(f"note: --compile: {why}; compiling with torch.compile in this process\n")
        if not builds:
            return False
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        self._compiled_decode = torch.compile(self._forward_slots, mode=mode)
        return True

    def _decode_compiled(self, compiled: Callable[..., torch.Tensor], input_ids: torch.Tensor,
                         positions: torch.Tensor, query_slots: torch.Tensor, slot_is_token: torch.Tensor,
                         cache: ModelCache, last_only: bool) -> torch.Tensor:
        if self.device.type == "cuda":
            slot_end = self._static_slot_end(cache, slot_is_token)
        else:
            slot_end = int(query_slots[-1]) + 1  # one host sync per step, cheap on a CPU
        try:
            return compiled(input_ids, positions, query_slots, slot_is_token, cache, slot_end, last_only)
        except Exception as exc:  # any compiler failure: no C compiler, an op inductor cannot lower, ...
            self._compiled_decode = None
            # One line, long enough for where a failed program is recorded (io/compiled_cache.record_bad).
            sys.stderr.write(f"warning: --compile failed ({first_line(exc)[:400]}); decoding without it\n")
            # Writing the same keys and values again at the same slots is harmless.
            return self._forward_slots(input_ids, positions, query_slots, slot_is_token, cache,
                                       int(query_slots[-1]) + 1, last_only)

    @staticmethod
    def _static_slot_end(cache: ModelCache, slot_is_token: torch.Tensor) -> int:
        """Every slot a full cache layer holds (the unwritten ones lie after the query, so the causal
        mask hides them): the same for every step, unlike the last query slot, and known on the host.
        The cache's tensors keep their addresses, which CUDA graphs are told once."""
        from lmcli.models.cache import KVCache

        full = [layer for layer in cache.layers if isinstance(layer, KVCache)]
        for layer in cache.layers:
            for tensor in (layer.keys, layer.values, getattr(layer, "slots", None)):
                if tensor is not None:
                    torch._dynamo.mark_static_address(tensor)
        return min([layer.keys.shape[2] for layer in full] + [slot_is_token.shape[1]])

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        config = self.config
        if config.position_embedding != "rope":
            return {}
        tables = {}
        for layer_type in set(config.layer_types):
            rope = config.rope_local if (layer_type == SLIDING and config.rope_local) else config.rope
            key = f"{layer_type}:{positions.device}"
            if key not in self._inverse_frequencies:
                inv = rope_inverse_frequencies(rope, config.head_dim, config.max_position_embeddings)
                self._inverse_frequencies[key] = inv.to(positions.device)
            tables[layer_type] = rope_cos_sin(self._inverse_frequencies[key], positions, dtype)
        return tables

    # --- cache and generation ---------------------------------------------------------------------

    def init_cache(self, batch_size: int, max_length: int, rollback: int = 0) -> ModelCache:
        """A cache for `batch_size` rows of up to `max_length` tokens, allocated once.

        Sliding-window layers get a rolling buffer of `sliding_window` slots (plus `rollback` spare ones,
        so that it can be trimmed by that many: see ModelCache.trim); the others a static one.
        """
        from lmcli.models.cache import ModelCache

        return ModelCache.for_model(self, batch_size, max_length, rollback)

    def traverse_cache(self, cache: ModelCache, fn: Callable[[torch.Tensor], torch.Tensor]) -> ModelCache:
        """Apply `fn` to every batched tensor of `cache` (move, cast, select rows); returns the cache."""
        return cache.traverse(fn)

    @property
    def device(self) -> torch.device:
        return next(self.model.norm.parameters()).device  # the embedding may be quantized; the norm never is

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype: of the matrix products, attention and the cache (weights may be stored
        quantized: see `weight_formats`)."""
        return self.activation_dtype or self.residual_dtype

    @property
    def residual_dtype(self) -> torch.dtype:
        """The dtype of the residual stream, the norms and rotary: the float parameters'."""
        return next(self.model.norm.parameters()).dtype


