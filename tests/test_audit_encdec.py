"""An encoder-decoder's rows with processors that count the decoder's text (found by the planted-bug
audit, docs/testing.md): min_new_tokens with an end-of-text bias that ends the row as soon as it may,
and n-gram blocking, in a job whose encoder inputs have other lengths. Each completion is compared with
transformers' generate on the same T5 files (test_encdec_cli's). And a BART without scale_embedding (as
facebook/bart-base and bart-large-cnn are; test_encdec's BART scales), by logits against transformers.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_encdec_cli import t5_dir  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli.cli import app

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["summarize: a cat sat on the mat and slept", "the quick brown fox"]
EOS = 1


def reference(directory, prompt: str, **generate) -> str:
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                                     eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    model = transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()
    config = model.generation_config
    config.eos_token_id, config.pad_token_id = EOS, 0
    with torch.no_grad():
        out = model.generate(**tokenizer(prompt, return_tensors="pt"), do_sample=False, num_beams=1,
                             generation_config=config, **generate)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def test_decoder_side_processors_equal_transformers(t5_dir, tmp_path):
    rows = []
    for i, prompt in enumerate(PROMPTS):
        rows.append({"id": f"min{i}", "prompt": prompt, "max_new_tokens": 9, "min_new_tokens": 4,
                     "logit_bias": {str(EOS): 8.0}})
        rows.append({"id": f"ngram{i}", "prompt": prompt, "max_new_tokens": 9, "no_repeat_ngram_size": 1})
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = CliRunner().invoke(app, ["generate", "-c", str(t5_dir), "--greedy", "--input", str(source),
                                      "--output", str(out)])
    assert result.exit_code == 0, result.output
    got = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    for i, prompt in enumerate(PROMPTS):
        assert got[f"min{i}"]["completion"] == reference(t5_dir, prompt, max_new_tokens=9, min_new_tokens=4,
                                                         sequence_bias={(EOS,): 8.0})
        assert got[f"min{i}"]["completion_tokens"] == 5  # 4 tokens, then the end-of-text it was pushed to
        assert got[f"ngram{i}"]["completion"] == reference(t5_dir, prompt, max_new_tokens=9, no_repeat_ngram_size=1)


def test_bart_without_embedding_scale_equals_transformers(tmp_path):
    from test_encdec import VOCAB, _randomise, inputs

    from lmcli import load

    reference = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=40,
        scale_embedding=False))
    _randomise(reference)
    reference.save_pretrained(tmp_path)
    reference = type(reference).from_pretrained(tmp_path).eval()
    model, _ = load(tmp_path, device="cpu", dtype="float32")
    ids, mask = inputs([7, 4], seed=4)  # right padding, as transformers numbers BART's positions
    decoder_ids = torch.tensor([[reference.config.decoder_start_token_id, 7, 8, 9]] * 2)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(model(ids, mask, decoder_ids), expected, atol=1e-4, rtol=0)
