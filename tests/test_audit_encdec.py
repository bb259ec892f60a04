"""An encoder-decoder's rows with processors that count the decoder's text (found by the planted-bug
audit, docs/testing.md): min_new_tokens with an end-of-text bias that ends the row as soon as it may,
and n-gram blocking, in a job whose encoder inputs have other lengths. Each completion is compared with
transformers' generate on the same T5 files (test_encdec_cli's).
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
