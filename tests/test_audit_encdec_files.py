"""Encoder-decoder files as they are found on the Hub, not as today's transformers writes them (issue 31's
audit): T5 v1.1 / Flan-T5 config.json files, written before `scale_decoder_outputs` existed, and BART
checkpoints that store the shared embedding under all three of its names. Each is compared, by logits,
with transformers' model loaded from the same files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_encdec import VOCAB, _randomise, inputs

from lmcli import load
from lmcli.errors import CheckpointError

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(reference, model, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = inputs([7, 4], seed=seed)
    decoder_ids = torch.tensor([[reference.config.decoder_start_token_id, 7, 8, 9]] * 2)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    return model(ids, mask, decoder_ids), expected


@pytest.mark.parametrize("tied", [False, True], ids=["v1.1 / Flan-T5 (own head)", "v1.0 (tied head)"])
def test_t5_files_without_scale_decoder_outputs(tied, tmp_path):
    """Files written before `scale_decoder_outputs` existed: the decoder's output is scaled exactly when the
    head is the tied embedding (T5 v1.0: no lm_head.weight), not for T5 v1.1 / Flan-T5, whose config.json
    says "tie_word_embeddings": false and whose lm_head.weight is a table of its own."""
    reference = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, decoder_start_token_id=0, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu"))
    _randomise(reference)
    reference.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("scale_decoder_outputs", None)
    if not tied:
        config["tie_word_embeddings"] = False
        tensors = load_file(tmp_path / "model.safetensors")
        assert "lm_head.weight" not in tensors
        tensors["lm_head.weight"] = torch.randn((VOCAB, 32), generator=torch.Generator().manual_seed(7)) * 0.3
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert reference.config.scale_decoder_outputs is tied  # transformers' own reading of the old file
    model, _ = load(tmp_path, device="cpu", dtype="float32")
    got, expected = _logits(reference, model, seed=5)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _bart(tmp_path):
    reference = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=40))
    _randomise(reference)
    reference.save_pretrained(tmp_path)
    return reference


def _with_all_three_names(tmp_path, change=None) -> None:
    """model.safetensors rewritten with the shared table under model.shared, model.encoder.embed_tokens and
    model.decoder.embed_tokens (as older BART checkpoints on the Hub store it); `change` alters one copy."""
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    [(name, table)] = [(n, t) for n, t in tensors.items() if n.endswith(("shared.weight", "embed_tokens.weight"))]
    del tensors[name]
    for copy in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        tensors[copy] = table.clone()
    if change is not None:
        tensors["model.decoder.embed_tokens.weight"] = change(table.clone())
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_bart_checkpoint_that_names_all_three_embedding_tensors(tmp_path):
    reference = _bart(tmp_path)
    _with_all_three_names(tmp_path)
    reference = transformers.BartForConditionalGeneration.from_pretrained(tmp_path).eval()
    model, _ = load(tmp_path, device="cpu", dtype="float32")
    got, expected = _logits(reference, model, seed=6)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_a_bart_checkpoint_whose_three_embedding_tensors_differ_is_refused(tmp_path):
    """One table serves both stacks and the head: three that differ cannot all be honoured, so the
    load says so in one line rather than keep whichever came last."""
    _bart(tmp_path)
    _with_all_three_names(tmp_path, change=lambda table: table * 2)
    with pytest.raises(CheckpointError, match=r"stores model\.embed_tokens\.weight under several names, and they differ"
                       ) as refused:
        load(tmp_path, device="cpu", dtype="float32")
    assert len(str(refused.value).splitlines()) == 1
