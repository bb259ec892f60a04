"""Resolving and reading checkpoints: presets, strict tensor accounting, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_reference

import lmcli
from lmcli import registry
from lmcli.errors import CheckpointError, ConfigError, UsageError


@pytest.fixture
def llama_dir(tmp_path):
    save_reference("llama", tmp_path)
    return tmp_path


def rewrite_weights(directory, change):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)
    return path


def preset(name: str) -> dict:
    config = registry.preset_config(name)
    assert config is not None, f"no preset {name}"
    return config


def test_missing_tensor_names_file_and_tensor(llama_dir):
    path = rewrite_weights(llama_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as error:
        lmcli.load(llama_dir)
    message = str(error.value)
    assert str(path) in message and "missing tensor 'model.layers.1.mlp.up_proj.weight' [48, 32]" in message
    assert "\n" not in message


def test_unexpected_tensor_is_an_error(llama_dir):
    rewrite_weights(llama_dir, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight' \[3\]"):
        lmcli.load(llama_dir)


def test_shape_mismatch_names_both_shapes(llama_dir):
    path = rewrite_weights(llama_dir, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(CheckpointError) as error:
        lmcli.load(llama_dir)
    assert str(error.value) == (
        f"{path}: tensor 'model.norm.weight' has shape [31] but the model expects [32]"
    )


def test_known_buffers_are_skipped(llama_dir):
    rewrite_weights(llama_dir, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    model, _ = lmcli.load(llama_dir)
    assert model.num_parameters() > 0


def test_gpt2_mask_buffers_are_skipped(tmp_path):
    save_reference("gpt2", tmp_path)
    rewrite_weights(tmp_path, lambda t: t.update({
        "transformer.h.0.attn.bias": torch.ones(1, 1, 64, 64), "transformer.h.0.attn.masked_bias": torch.tensor(-1e4)}))
    lmcli.load(tmp_path)


def test_truncated_file_is_an_error(llama_dir):
    path = llama_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"^{path}: cannot read safetensors file"):
        lmcli.load(llama_dir)


def test_garbage_file_is_an_error(llama_dir):
    (llama_dir / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(CheckpointError, match="cannot read safetensors file"):
        lmcli.load(llama_dir)


def with_model_type(directory, model_type: str):
    """The checkpoint in `directory`, its config.json now saying `model_type`."""
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": model_type}))
    return directory


def test_unknown_architecture(llama_dir):
    with pytest.raises(ConfigError, match="unknown architecture 'bert'"):
        lmcli.load(with_model_type(llama_dir, "bert"))


def test_model_name_supplies_architecture_for_unusual_model_type(llama_dir):
    model, _ = lmcli.load(with_model_type(llama_dir, "my-finetune"), model="llama")
    assert model.config.architecture == "llama"


def test_model_name_disagreeing_with_config_is_an_error(llama_dir):
    with pytest.raises(ConfigError, match="--model gpt2 is a gpt2 model but the checkpoint's config says model_type 'llama'"):
        lmcli.load(llama_dir, model="gpt2")


def test_naming_mistral_for_a_llama_checkpoint_is_allowed(llama_dir):
    """llama.cpp files mistral weights under "llama"; --model mistral must be able to say what they are."""
    model, _ = lmcli.load(llama_dir, model="mistral")
    assert model.config.architecture == "mistral"
    with pytest.raises(ConfigError, match="--model mixtral is a mixtral model"):
        lmcli.load(tiny_dir("qwen2", llama_dir.parent / "qwen"), model="mixtral")


def test_model_without_checkpoint_needs_one():
    with pytest.raises(UsageError, match="mistral is not on disk"):  # the suite runs offline (conftest)
        lmcli.load(model="mistral")
    with pytest.raises(ConfigError, match="unknown model 'foo'"):
        lmcli.load(model="foo")


def test_mixtral_config_without_experts_is_a_config_error(llama_dir):
    with pytest.raises(ConfigError, match="missing field 'num_local_experts'"):
        lmcli.load(llama_dir, model="mixtral")


def tiny_dir(case, directory):
    save_reference(case, directory)
    return directory


def test_unknown_model_name(llama_dir):
    with pytest.raises(ConfigError, match="unknown model 'llama-99b'"):
        lmcli.load(llama_dir, model="llama-99b")


def test_single_safetensors_file_with_config_beside_it(llama_dir):
    model, _ = lmcli.load(llama_dir / "model.safetensors")
    assert model.config.architecture == "llama"


def test_single_safetensors_file_needs_a_model(llama_dir, tmp_path_factory):
    lonely = tmp_path_factory.mktemp("lonely") / "weights.safetensors"
    lonely.write_bytes((llama_dir / "model.safetensors").read_bytes())
    with pytest.raises(UsageError, match="needs --model"):
        lmcli.load(lonely)
    # With a preset the config comes from configs/; the tiny weights cannot hold the model it describes
    # (refused before the model is built: tests/test_claimed_size.py).
    with pytest.raises(CheckpointError, match=r"describes a model of at least 48,218,112 weights \(30 layers of "
                                              r"width 576\), more than its files' 89,016 bytes can hold"):
        lmcli.load(lonely, model="smollm2-135m")


def test_pickle_weights_are_refused(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(registry.preset_config("gpt2")))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load must never be called"))
    with pytest.raises(CheckpointError, match="reads safetensors only"):
        lmcli.load(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        lmcli.load(tmp_path / "nope")


def test_bad_dtype_and_device(llama_dir):
    with pytest.raises(UsageError, match="--dtype float8"):
        lmcli.load(llama_dir, dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device"):
            lmcli.load(llama_dir, device="cuda")


def test_every_preset_builds_a_config():
    names = registry.list_presets()
    for required in ("gpt2", "llama-2-7b", "llama-3.2-1b", "mistral-7b-v0.1", "mixtral-8x7b-v0.1",
                     "qwen2.5-0.5b", "gemma-3-270m", "smollm2-135m"):
        assert required in names
    for name in names:
        config = registry.config_from_hf(preset(name))
        assert config.vocab_size > 1000


def test_bare_architecture_names_resolve():
    for arch in registry.list_architectures():
        assert registry.model_type_for_name(arch) == arch
        assert registry.preset_config(arch) is not None  # the flagship preset
    mistral = registry.config_from_hf(preset("mistral"))
    assert mistral.sliding_window == 4096 and mistral.uses_sliding_window
    gemma3 = registry.config_from_hf(preset("gemma-3-270m"))
    assert gemma3.layer_types.count("full_attention") == 3
    assert gemma3.rope_local is not None and gemma3.rope_local.theta == 10000.0
