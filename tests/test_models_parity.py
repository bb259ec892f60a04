"""Logits of every architecture equal the reference implementation (transformers) on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import CASES, VOCAB, left_pad, prompts, save_reference

import lmcli

TOLERANCE = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(case, transformers model, lmcli model) loaded from the same saved HF directory."""
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_reference(request.param, directory)
    model, _ = lmcli.load(directory)
    return request.param, reference, model


def test_is_a_base_model_in_eval_mode(pair):
    case, _reference, model = pair
    assert isinstance(model, lmcli.BaseModel)
    assert not model.training
    assert model.config.model_type == CASES[case][0]
    assert model.config.vocab_size == VOCAB
    assert model.config.max_position_embeddings == 64


def test_logits_equal_reference(pair):
    _, reference, model = pair
    (ids,) = prompts([12])
    with torch.no_grad():
        want = reference(ids[None]).logits
    got = model(ids[None])
    assert got.shape == (1, 12, VOCAB)
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=0)


def test_logits_past_the_sliding_window_equal_reference(pair):
    _, reference, model = pair
    (ids,) = prompts([40], seed=2)  # longer than every window in tests/tiny.py
    with torch.no_grad():
        want = reference(ids[None]).logits
    torch.testing.assert_close(model(ids[None]), want, atol=TOLERANCE, rtol=0)


def test_left_padded_rows_equal_each_row_alone(pair):
    _, _, model = pair
    rows = prompts([11, 3, 7])
    ids, mask = left_pad(rows)
    batched = model(ids, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = model(row[None])[0]
        torch.testing.assert_close(batched[i, ids.shape[1] - len(row):], alone, atol=TOLERANCE, rtol=0)


def test_left_padded_batch_equals_reference_at_token_positions(pair):
    """The reference derives positions from the mask too (as its generate() does)."""
    _, reference, model = pair
    rows = prompts([9, 4])
    ids, mask = left_pad(rows)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=positions).logits
    got = model(ids, attention_mask=mask)
    token = mask.bool()
    torch.testing.assert_close(got[token], want[token], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", ["llama", "gemma3_text"])
def test_sharded_checkpoint_loads(case, tmp_path):
    reference = save_reference(case, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    model, _ = lmcli.load(tmp_path)
    (ids,) = prompts([10])
    with torch.no_grad():
        want = reference(ids[None]).logits
    torch.testing.assert_close(model(ids[None]), want, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case,tied", [("llama", False), ("qwen2", True), ("gpt2", True)])
def test_tied_and_untied_heads(case, tied, tmp_path):
    save_reference(case, tmp_path)
    model, _ = lmcli.load(tmp_path)
    same = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert same == tied


@pytest.mark.parametrize("case", ["llama-headdim-rope3", "gemma3_text"])
def test_older_config_style_loads(case, tmp_path):
    """config.json files written before `rope_parameters` carry `rope_theta` and `rope_scaling`."""
    reference = save_reference(case, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    if "full_attention" in params:  # gemma3: per layer type
        config["rope_theta"] = params["full_attention"]["rope_theta"]
        config["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
    else:
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    config["torch_dtype"] = config.pop("dtype", "float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = lmcli.load(tmp_path)
    (ids,) = prompts([20])
    with torch.no_grad():
        want = reference(ids[None]).logits
    torch.testing.assert_close(model(ids[None]), want, atol=TOLERANCE, rtol=0)


def test_eos_token_id_list_is_accepted(tmp_path):
    save_reference("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = [2, 5]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = lmcli.load(tmp_path)
    assert model.config.eos_token_ids == [2, 5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
def test_loads_in_requested_dtype(dtype, tmp_path):
    reference = save_reference("mistral", tmp_path)
    model, _ = lmcli.load(tmp_path, dtype=dtype, device="cpu")
    expected = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    (ids,) = prompts([8])
    with torch.no_grad():
        want = reference(ids[None]).logits
    got = model(ids[None]).float()
    # Half precision: close to the float32 reference, and the same argmax almost everywhere.
    assert (got - want).abs().max() < 0.25
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
