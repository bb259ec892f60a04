"""Tiny random reference models (transformers) for every architecture, saved as HF directories.

Each case varies the shapes that matter: GQA vs MHA, tied vs untied heads, explicit head_dim,
biases, and sliding windows shorter than the test prompts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 97

BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

CASES: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                          bos_token_id=1, eos_token_id=2)),
    "llama": ("llama", dict(BASE, tie_word_embeddings=False)),
    "llama-mha-tied-bias": ("llama", dict(BASE, num_key_value_heads=4, tie_word_embeddings=True,
                                          attention_bias=True, mlp_bias=True)),
    "llama-headdim-rope3": ("llama", dict(BASE, head_dim=16, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, rope_theta=500000.0)),
    "llama-linear-rope": ("llama", dict(BASE, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("mistral", dict(BASE, sliding_window=5)),
    "mixtral": ("mixtral", dict(BASE, sliding_window=6, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("qwen2", dict(BASE, tie_word_embeddings=True)),
    "qwen2-window": ("qwen2", dict(BASE, num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                                   max_window_layers=1)),
    "gemma": ("gemma", dict(BASE, head_dim=16)),
    "gemma2": ("gemma2", dict(BASE, head_dim=16, num_hidden_layers=3, sliding_window=4,
                              query_pre_attn_scalar=24, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0)),
    "gemma3_text": ("gemma3_text", dict(BASE, head_dim=16, num_hidden_layers=3, sliding_window=4,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_theta=100000.0, rope_local_base_freq=10000.0,
                                        query_pre_attn_scalar=24)),  # != head_dim: the scale shows
}


PAD = 0


def random_reference(model_type: str, fields: dict, seed: int = 0):
    """A transformers model with random weights scaled up so the logits are not flat."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name:
                # gemma norms are applied as (1 + w): keep w near 0; others near 1
                param.normal_(0.0, 0.3) if "gemma" in model_type else param.uniform_(0.7, 1.3)
            else:
                param.normal_(0.0, 0.2)
    return model.float().eval()


def build_reference(case: str, seed: int = 0):
    model_type, fields = CASES[case]
    return random_reference(model_type, fields, seed)


def save_reference(case: str, directory: Path, seed: int = 0, **save_kwargs):
    model = build_reference(case, seed)
    model.save_pretrained(directory, **save_kwargs)
    return model


def prompts(lengths, seed: int = 1) -> list[torch.Tensor]:
    """Random prompts of the given lengths (ids >= 3: clear of pad, bos and eos)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


def left_pad(rows, pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one left-padded batch: (ids [B, T], attention_mask [B, T])."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


@pytest.fixture
def tiny_int4(tmp_path, cache, monkeypatch):
    """A tiny llama quantized to int4 at load: bfloat16 products, batch-invariant attention (as the default
    model). `cache`: the requesting module's fixture that points LMCLI_CACHE_DIR at a scratch cache."""
    import lmcli
    from lmcli.kernels import plan as kernel_plan

    monkeypatch.delenv("LMCLI_KERNEL", raising=False)
    monkeypatch.setattr(kernel_plan, "_PROBE_SHAPE", (128, 256))
    kernel_plan._cached_plans.cache_clear()
    save_reference("llama", tmp_path / "llama")
    model, _ = lmcli.load(tmp_path / "llama", quantize="int4")
    assert model.batch_invariant and model.dtype == torch.bfloat16
    yield model
    kernel_plan._cached_plans.cache_clear()
