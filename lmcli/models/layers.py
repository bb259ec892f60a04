"""The building blocks every architecture shares: norms, RoPE, attention, MLP and MoE.

Parameter names follow HuggingFace's llama family (q_proj, gate_proj, input_layernorm, ...) so that
most checkpoints load by name; architectures with other names rename at load time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmcli.config import ACTIVATIONS as ACTIVATION_NAMES
from lmcli.config import SLIDING, ModelConfig, RopeConfig
from lmcli.kernels import lora
from lmcli.kernels.linear import QuantLinear, fuse_linears


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32: half precision loses too much in mean(x^2). F.rms_norm computes
        # x * rsqrt(mean(x^2) + eps) as the formula does, in fewer calls. The result is in the wider
        # of x's and the weight's dtypes: a quantized model's float32 residual stream (see
        # `Attention.forward`) takes a half-precision sublayer's output through a float32 norm.
        out = torch.promote_types(x.dtype, self.weight.dtype)
        # (Each cast only where it changes the dtype: a decode step runs 60 norms, and a cast to the
        # dtype a tensor already has is a dispatch for nothing.)
        normed = F.rms_norm(x if x.dtype == torch.float32 else x.float(), (x.shape[-1],), eps=self.eps)
        if self.unit_offset:  # gemma applies (1 + w) in float32, then casts
            return (normed * (1.0 + self.weight.float())).to(out)
        return self.weight * (normed if out == torch.float32 else normed.to(out))


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or config.hidden_size
    if config.norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, config.norm_eps, config.norm_unit_offset)


_ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Every hidden_act name config.py accepts, as the function it stands for.
ACTIVATIONS = {name: _ACTIVATION_FUNCTIONS[function] for name, function in ACTIVATION_NAMES.items()}


# --- rotary position embeddings -------------------------------------------------------------------


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        original = rope.original_max_position_embeddings or max_position_embeddings
        low_freq_wavelen = original / rope.low_freq_factor
        high_freq_wavelen = original / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, blended, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin, each [B, 1, T, head_dim], for integer positions [B, T] (see `apply_rope`)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # (B, T, hd/2)
    sin = freqs.sin()
    signed_sin = torch.cat((-sin, sin), dim=-1)  # (B, T, hd)
    return freqs.cos().repeat(1, 1, 2).to(dtype)[:, None], signed_sin.to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1): the sign is folded into
    `signed_sin` once per forward, so a layer only swaps the halves. Exact: negation rounds nothing."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


# --- attention ------------------------------------------------------------------------------------


@dataclass
class AttentionInputs:
    """What every attention layer of one forward call needs besides its hidden states.

    Slots are column indices of the (left-padded) token sequence; a cache stores keys by slot.
    """

    query_slots: torch.Tensor  # [T] long: slot of each query
    slot_is_token: torch.Tensor  # [B, S_total] bool: False where the slot holds a pad
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer type -> (cos, signed sin) [B, 1, T, hd]
    slot_end: int | None = None  # last query slot + 1, known on the host (no device sync per layer)
    # layer type -> additive mask [B, 1, rep * T, S] (0 or -inf, in the activation dtype), built by the
    # first layer of each type: layers of one type share their key slots.
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    # Batch-invariant attention (models/row_attention.py): layer type -> which keys each query reads.
    by_row: bool = False
    row_plans: dict[str, Any] = field(default_factory=dict)  # a list of RowCall, or one JoinedCall
    # The dtype attention and the cache compute in, where the hidden states are wider (a quantized
    # model's float32 residual stream around bfloat16 matrix products); None: the hidden states' own.
    dtype: torch.dtype | None = None
    # Batch-invariant attention as tensors, for a one-token step or a prefill chunk (gather index [B, P],
    # additive mask [B, T, 1, P]; models/compiled_step.py, compiled_prefill.py): what a compiled program
    # takes instead of `row_plans`.
    row_gather: tuple[torch.Tensor, torch.Tensor] | None = None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window if layer_type == SLIDING else None
        self.layer_type = layer_type
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.softcap = config.attn_logit_softcapping
        self.use_rope = config.position_embedding == "rope"
        hidden, q_dim, kv_dim = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.attention_out_bias)
        # After loading, q/k/v become one projection (`fuse_projections`): one matrix call, not three.
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = [q_dim, kv_dim, kv_dim]
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps, config.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None

    def fuse_projections(self) -> None:
        """Replace q_proj, k_proj and v_proj by one `qkv_proj` (their weights joined by rows), if they join."""
        if self.qkv_proj is None:
            fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
            if fused is not None:
                self.qkv_proj = fused
                del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nkv = self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None:
            heads = self.qkv_proj(x).view(B, T, nh + 2 * nkv, self.head_dim).transpose(1, 2)  # (B, nh+2nkv, T, hd)
            qk, v = heads[:, :nh + nkv], heads[:, nh + nkv:]  # (B, nh+nkv, T, hd), (B, nkv, T, hd)
        else:
            q = self.q_proj(x).view(B, T, nh, self.head_dim)  # (B, T, nh, hd)
            k = self.k_proj(x).view(B, T, nkv, self.head_dim)  # (B, T, nkv, hd)
            qk = torch.cat((q, k), dim=2).transpose(1, 2)  # (B, nh+nkv, T, hd)
            v = self.v_proj(x).view(B, T, nkv, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])), dim=1)
        if self.use_rope:  # one rotation for the query and key heads together, in the tables' dtype
            qk = apply_rope(qk, *inputs.rope[self.layer_type])
        if inputs.dtype is not None:  # rotated in float32, attended in the cache's dtype
            qk, v = qk.to(inputs.dtype), v.to(inputs.dtype)
        q, k = qk[:, :nh], qk[:, nh:]  # (B, nh, T, hd), (B, nkv, T, hd)

        if cache is None:
            key_slots = inputs.query_slots
        else:
            k, v, key_slots = cache.update(k, v, inputs.query_slots, inputs.slot_end)  # (B, nkv, S, hd), [S]
        if inputs.by_row and inputs.row_gather is not None:
            from lmcli.models.row_attention import attend_rows

            out = attend_rows(q, k, v, *inputs.row_gather, self.scale)  # (B, T, nh*hd)
            return self.o_proj(_projection_input(self.o_proj, out, x.dtype))
        if inputs.by_row:
            by_row = self._attend_by_row(q, k, v, key_slots, inputs)  # (B, T, nh*hd)
            return self.o_proj(_projection_input(self.o_proj, by_row, x.dtype))
        mask = inputs.masks.get(self.layer_type)
        if mask is None:
            mask = inputs.masks[self.layer_type] = self._mask(inputs, key_slots, q.dtype)  # (B, 1, rep * T, S)

        # Grouped-query attention without copying the cache: the query heads that share a kv head
        # become extra query rows of that head. (B, nh, T, hd) -> (B, nkv, rep * T, hd)
        q = q.reshape(B, nkv, (nh // nkv) * T, self.head_dim)
        if self.softcap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            scores = (q @ k.transpose(-2, -1)) * self.scale  # (B, nkv, rep * T, S)
            scores = torch.tanh(scores / self.softcap) * self.softcap + mask
            out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        out = out.reshape(B, self.num_heads, T, self.head_dim)  # (B, nh, T, hd)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, nh*hd)
        return self.o_proj(_projection_input(self.o_proj, out, x.dtype))

    def _attend_by_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_slots: torch.Tensor,
                       inputs: AttentionInputs) -> torch.Tensor:
        from lmcli.models import native_attention
        from lmcli.models.row_attention import JoinedCall, attend_by_row, attend_joined, joined_plan, row_plans

        B, _, T, _ = q.shape
        if native_attention.isa() is not None:  # one kernel call, invariant by construction (csrc/attention.cpp)
            native = inputs.row_plans.get(f"{self.layer_type}:native")
            if native is None:
                native = inputs.row_plans[f"{self.layer_type}:native"] = native_attention.plan(
                    key_slots, inputs.query_slots, inputs.slot_is_token, self.window)
            got = native_attention.attend(q, k, v, native, self.scale, self.softcap)  # (B, T, nh*hd)
            if got is not None:
                return got
        plans = inputs.row_plans.get(self.layer_type)
        if plans is None:
            one_call = q.dtype == torch.bfloat16 and self.window is None and self.softcap is None
            joined = joined_plan(key_slots, inputs.query_slots, inputs.slot_is_token, q.dtype,
                                 self.num_kv_heads * self.head_dim) if one_call else None
            plans = inputs.row_plans[self.layer_type] = joined or row_plans(
                key_slots, inputs.query_slots, inputs.slot_is_token, self.window, q.dtype, one_call)
        rep = self.num_heads // self.num_kv_heads
        q = q.reshape(B, self.num_kv_heads, rep * T, self.head_dim)
        if isinstance(plans, JoinedCall):
            out = attend_joined(q, k, v, plans, self.scale, rep)  # (B, nkv, rep * T, hd)
        else:
            out = attend_by_row(q, k, v, plans, self.scale, self.softcap, rep)
        out = out.reshape(B, self.num_heads, T, self.head_dim).transpose(1, 2)
        return out.reshape(B, T, self.num_heads * self.head_dim)  # (B, T, nh*hd)

    def _mask(self, inputs: AttentionInputs, key_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive [B, 1, rep * T, S] in `dtype`: 0 where a query may attend to a key, -inf elsewhere;
        repeated for the query heads sharing a kv head (see `forward`). What SDPA would make of a
        boolean mask in every layer, made once."""
        q = inputs.query_slots[:, None]  # (T, 1)
        k = key_slots[None, :]  # (1, S)
        allowed = (k <= q) & (k >= 0)  # causal; slot -1 marks an empty cache entry
        if self.window is not None:
            allowed &= k > q - self.window  # the last `window` keys, the query's own included
        is_token = inputs.slot_is_token[:, key_slots.clamp(min=0)]  # (B, S)
        mask = allowed[None] & is_token[:, None, :]  # (B, T, S)
        # A pad query would attend to nothing (NaN); let it see itself. Its output is never used.
        mask |= (k == q)[None]
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return additive[:, None].repeat(1, 1, self.num_heads // self.num_kv_heads, 1)  # (B, 1, rep * T, S)


def _projection_input(projection: nn.Module, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`hidden` (attention's output, in the cache's dtype) as `projection` takes it: widened to the
    residual dtype `dtype`, except for a quantized projection whose kernel computes in `hidden`'s own
    dtype, which would round the widened copy straight back to `hidden` (exactly: widening loses
    nothing), so it takes `hidden` as it is: two copies a layer fewer, the same product."""
    if isinstance(projection, QuantLinear) and projection.kernel.dtype == hidden.dtype:
        return hidden
    return hidden.to(dtype)


# --- feed-forward ---------------------------------------------------------------------------------


class MLP(nn.Module):
    """Gated (SwiGLU/GeGLU: down(act(gate(x)) * up(x))) or plain (down(act(up(x))))."""

    def __init__(self, config: ModelConfig, hidden: int | None = None, intermediate: int | None = None):
        super().__init__()
        hidden = hidden or config.hidden_size
        intermediate = intermediate or config.intermediate_size
        self.act = ACTIVATIONS[config.hidden_act]
        self.gate_proj = nn.Linear(hidden, intermediate, bias=config.mlp_bias) if config.gated_mlp else None
        self.up_proj = nn.Linear(hidden, intermediate, bias=config.mlp_bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=config.mlp_bias)
        # After loading, a gated MLP's gate and up become one projection (`fuse_projections`).
        self.gate_up_proj: nn.Module | None = None

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one `gate_up_proj` (gate rows, then up rows), if they join."""
        if self.gate_proj is not None and self.gate_up_proj is None:
            fused = fuse_linears([self.gate_proj, self.up_proj])
            if fused is not None:
                self.gate_up_proj = fused
                self.gate_proj = None
                del self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, intermediate) each
            return self.down_proj(self.act(gate) * up)
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One mixtral expert, named as the checkpoints name it: w1 gate, w3 up, w2 down."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[config.hidden_act]
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-k routed experts; routing weights are a softmax renormalised over the chosen experts."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config) for _ in range(config.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, hidden)
        router_probs = torch.softmax(self.gate(tokens).float(), dim=-1)  # (N, E)
        weights, chosen = router_probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(tokens)
        for expert_index in chosen.unique().tolist():
            token_index, slot = (chosen == expert_index).nonzero(as_tuple=True)
            with lora.narrowed(token_index, tokens.shape[0]):  # per-row LoRA adapters, for these tokens
                expert_out = self.experts[expert_index](tokens[token_index])  # (n, hidden)
            out.index_add_(0, token_index, expert_out * weights[token_index, slot, None])
        return out.view(shape)
