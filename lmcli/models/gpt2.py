"""GPT-2: learned absolute positions, LayerNorm, plain GELU (tanh) MLP, fused c_attn, tied head.

Its checkpoints use other names and Conv1D layers (weights stored [in, out]), so they are renamed,
split and transposed at load time onto the shared decoder.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lmcli.config import ModelConfig, token_and_source_fields

if TYPE_CHECKING:
    import torch

    from lmcli.io.gguf import GGUFFile

_RENAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.c_fc": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    hidden = int(hf.get("n_embd", 768))
    heads = int(hf.get("n_head", 12))
    fields = dict(
        model_type=hf.get("model_type", "gpt2"),
        architecture="gpt2",
        vocab_size=int(hf.get("vocab_size", 50257)),
        hidden_size=hidden,
        intermediate_size=int(hf.get("n_inner") or 4 * hidden),
        num_hidden_layers=int(hf.get("n_layer", 12)),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=int(hf.get("n_positions", 1024)),
        norm_type="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        gated_mlp=False,
        hidden_act=hf.get("activation_function", "gelu_new"),
        position_embedding="learned",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **token_and_source_fields(hf),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def convert_checkpoint(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2 names -> shared decoder names; Conv1D [in, out] -> Linear [out, in]; c_attn -> q, k, v."""
    from lmcli.io.checkpoint import IGNORED_TENSORS

    out = {}
    for name, tensor in tensors.items():
        if name.startswith("transformer."):
            name = name[len("transformer."):]
        if IGNORED_TENSORS.search(name):  # the causal-mask buffers GPT-2 checkpoints carry
            continue
        if name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
            target = {"wte": "model.embed_tokens", "wpe": "model.embed_positions", "ln_f": "model.norm"}
            prefix, leaf = name.split(".")
            out[f"{target[prefix]}.{leaf}"] = tensor
            continue
        match = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", name)
        if not match:
            out[name] = tensor  # lm_head.weight, or an unexpected name the strict check reports
            continue
        layer, module, leaf = match.groups()
        prefix = f"model.layers.{layer}"
        is_conv1d_weight = leaf == "weight" and not module.startswith("ln_")
        if is_conv1d_weight:
            tensor = tensor.t()
        if module == "attn.c_attn":
            for part, chunk in zip("qkv", tensor.chunk(3, dim=0)):
                out[f"{prefix}.self_attn.{part}_proj.{leaf}"] = chunk
            continue
        out[f"{prefix}.{_RENAMES.get(module, module)}.{leaf}"] = tensor
    return out


# --- GGUF

_GGUF_TOP_LEVEL = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                   "output_norm": "transformer.ln_f", "output": "lm_head"}
_GGUF_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
               "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


def config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    positions = gguf.integer("context_length")
    return {
        "model_type": "gpt2",
        "vocab_size": gguf.vocab_size(),
        "n_embd": gguf.integer("embedding_length"),
        "n_layer": gguf.integer("block_count"),
        "n_head": gguf.integer("attention.head_count"),
        "n_inner": gguf.integer("feed_forward_length", None),
        "n_positions": positions,
        "n_ctx": positions,
        "layer_norm_epsilon": gguf.require("attention.layer_norm_epsilon"),
        "activation_function": "gelu_new",
        # llama.cpp writes GPT-2's tied head out as a copy of the embedding: same bytes means tied.
        "tie_word_embeddings": ("output.weight" not in gguf.header.tensors
                                or gguf.same_bytes("output.weight", "token_embd.weight")),
        **gguf.token_ids(),
        "architectures": ["GPT2LMHeadModel"],
    }


def tensors_from_gguf(gguf: GGUFFile, name: str, tensor: torch.Tensor,
                      config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """GGUF names -> HF GPT-2 names (which `convert_checkpoint` then maps onto the shared decoder)."""
    stem, _, leaf = name.rpartition(".")
    if stem in _GGUF_TOP_LEVEL:
        if stem == "output" and config["tie_word_embeddings"]:
            return
        yield f"{_GGUF_TOP_LEVEL[stem]}.{leaf}", tensor
        return
    parts = gguf.block_parts(name)
    if parts is None or parts[2] is not None or parts[1] not in _GGUF_BLOCK:
        raise gguf.unexpected(name, config)
    layer, kind, _, leaf = parts
    if leaf == "weight" and not kind.endswith("_norm"):
        tensor = tensor.t().contiguous()  # HF GPT-2 keeps Conv1D weights as (in, out)
    yield f"transformer.h.{layer}.{_GGUF_BLOCK[kind]}.{leaf}", tensor
