"""Llama (and SmolLM2, Llama 3.x): the reference shape of the shared decoder.

RMSNorm, RoPE (default / linear / llama3 scaling), SwiGLU, grouped-query attention,
optional attention and MLP biases, optional tied embeddings.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcli.config import ModelConfig, RopeConfig, common_decoder_fields, rope_from_hf
from lmcli.errors import GGUFError

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from lmcli.io.gguf import GGUFFile


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    fields = dict(
        architecture="llama",
        rope=rope_from_hf(hf),
        hidden_act=hf.get("hidden_act", "silu"),
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )
    fields.update(overrides)
    return ModelConfig(**common_decoder_fields(hf), **fields)


# --- GGUF: llama.cpp files llama, mistral and mixtral all as "llama" (sometimes "mistral")

_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}


def config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    """config.json's dict for a llama, mistral or mixtral GGUF file."""
    config = gguf.decoder_fields()
    experts = gguf.integer("expert_count", 0) or 0
    name = " ".join(str(gguf.metadata.get(k, "")) for k in ("general.name", "general.basename")).lower()
    if experts:
        model_type = "mixtral"
        config.update(num_local_experts=experts, num_experts_per_tok=gguf.integer("expert_used_count"),
                      intermediate_size=gguf.integer("expert_feed_forward_length", None) or config["intermediate_size"])
    elif gguf.arch == "mistral" or "mistral" in name:
        model_type = "mistral"
    else:
        model_type = "llama"
    if model_type == "llama":
        config.update(attention_bias=gguf.has_tensor(".attn_q.bias"), mlp_bias=gguf.has_tensor(".ffn_up.bias"))
    else:
        # llama.cpp keeps no window for these; Mistral 7B v0.1 had 4096, later ones none.
        config["sliding_window"] = gguf.integer("attention.sliding_window", None)
    if "rope_freqs.weight" in gguf.header.tensors and config["rope_scaling"] is None:
        factors = gguf.tensor("rope_freqs.weight")
        config["rope_scaling"] = llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"], gguf.path)
    return {"model_type": model_type, "hidden_act": "silu", **config, "architectures": [_HF_CLASSES[model_type]]}


def tensors_from_gguf(gguf: GGUFFile, name: str, tensor: torch.Tensor,
                      config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    # llama.cpp interleaves the q/k rows of llama-family files for its RoPE kernel.
    return gguf.decoder_tensors(name, tensor, config, unpermute_qk=True)


def llama3_rope_scaling(rope_factors: torch.Tensor, theta: float, head_dim: int,
                        path: Path | str = "") -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's `rope_freqs` tensor (one divisor per frequency).

    llama3 divides frequency i by `factor` when its wavelength is long, by 1 when short, and in between by
    1 / ((1 - s) / factor + s) with s linear in 1 / wavelength: s = old_ctx / ((high - low) * wavelen) - low / (high - low).
    Only the ratios of (old_ctx, low, high) show, so low_freq_factor is taken as 1 (Llama 3.x's value).
    The fit is checked against the formula the model itself applies (`rope_inverse_frequencies`).
    """
    import torch

    from lmcli.io.gguf import GGUFFile
    from lmcli.models.layers import rope_inverse_frequencies

    divisors = rope_factors.double()  # (head_dim / 2,)
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (head_dim / 2,)
    inverse_wavelength = inv_freq / (2 * math.pi)
    smooth = (1 / divisors - 1 / factor) / (1 - 1 / factor)  # 0 where fully scaled, 1 where untouched
    between = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if int(between.sum()) < 2:
        raise GGUFError(f"{path}: rope_freqs has no smooth band, so it cannot be read as llama3 RoPE scaling")
    x, y = inverse_wavelength[between], smooth[between]
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())  # old_ctx / (high - low)
    offset = float(slope * x.mean() - y.mean())  # low / (high - low)
    if slope <= 0 or offset <= 0:
        raise GGUFError(f"{path}: rope_freqs does not follow llama3 RoPE scaling")
    low = 1.0
    high = low + low / offset
    old_ctx = slope * (high - low)
    scaling: dict[str, Any] = {"rope_type": "llama3", "factor": GGUFFile.fitted(factor), "low_freq_factor": low,
               "high_freq_factor": GGUFFile.fitted(high), "original_max_position_embeddings": round(old_ctx)}
    rope = RopeConfig(theta=theta, **scaling)
    unscaled = rope_inverse_frequencies(RopeConfig(theta=theta), head_dim, scaling["original_max_position_embeddings"])
    expected = unscaled / rope_inverse_frequencies(rope, head_dim, scaling["original_max_position_embeddings"])
    if not torch.allclose(expected.double(), divisors, rtol=1e-3, atol=1e-4):
        raise GGUFError(f"{path}: rope_freqs does not follow llama3 RoPE scaling")
    return scaling
