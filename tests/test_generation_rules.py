"""A model's generation_config.json rules (forced_bos_token_id, forced_eos_token_id, multi-token
bad_words_ids, suppress_tokens, begin_suppress_tokens) against transformers: each processor against
transformers' processor of the same name on random scores, and `lmcli generate` on a tiny T5 whose
generation_config.json holds them all against transformers' generate of the same files."""

from __future__ import annotations

import json

import pytest
import torch
from test_beams_cli import PROMPTS, reference
from test_encdec_cli import _t5_tokenizer
from typer.testing import CliRunner

from lmcli.cli import app
from lmcli.generation.sampling import BadWords, ForcedBOS, ForcedEOS, SuppressTokens

transformers = pytest.importorskip("transformers")
logits_process = pytest.importorskip("transformers.generation.logits_process")
pytestmark = pytest.mark.usefixtures("one_thread")


def _pairs():
    lp = logits_process
    bad = [[5], [7, 8], [3, 4, 9], [2]]
    return [
        (ForcedBOS(6), lp.ForcedBOSTokenLogitsProcessor(6)),
        (ForcedEOS(5, [2, 4]), lp.ForcedEOSTokenLogitsProcessor(5, [2, 4])),
        (BadWords(bad, [2]), lp.NoBadWordsLogitsProcessor(bad, 2)),
        (SuppressTokens([1, 9]), lp.SuppressTokensLogitsProcessor([1, 9])),
        (SuppressTokens([3, 8], 3), lp.SuppressTokensAtBeginLogitsProcessor([3, 8], 3)),
    ]


@pytest.mark.parametrize("index", range(5))
@pytest.mark.parametrize("width", [1, 2, 3, 4, 6])
def test_each_rule_equals_transformers_processor(index, width):
    ours, theirs = _pairs()[index]
    generator = torch.Generator().manual_seed(width)
    ids = torch.randint(0, 10, (6, width), generator=generator)
    ids[0, -2:] = torch.tensor([3, 4])[-width:]  # a row that ends like a bad word's prefix
    ids[1, -1:] = 7
    scores = torch.randn(6, 12, generator=generator)
    assert torch.equal(ours(ids, scores.clone()), theirs(ids, scores.clone()))


RULES = {"forced_bos_token_id": 7, "forced_eos_token_id": 1, "suppress_tokens": [9, 11],
         "begin_suppress_tokens": [12]}


@pytest.fixture(scope="module")
def ruled_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("t5-rules")
    vocab = _t5_tokenizer(directory)
    config = transformers.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   feed_forward_proj="gated-gelu", decoder_start_token_id=0, eos_token_id=1,
                                   pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(directory)
    # Bad words: a pair the model would write unbanned (its 2nd and 3rd tokens after the forced one).
    bos = RULES["forced_bos_token_id"]
    with torch.no_grad():
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
        out = model.generate(**tokenizer(PROMPTS[0], return_tensors="pt"), max_new_tokens=4, do_sample=False,
                             forced_bos_token_id=bos, eos_token_id=1, pad_token_id=0)
    pair = out[0, 2:4].tolist()
    generation = dict(decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, bad_words_ids=[pair, [13]], **RULES)
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory, pair


@pytest.mark.parametrize("beams", ["1", "3"])
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_generate_applies_the_models_rules_as_transformers(ruled_dir, prompt, beams):
    directory, _ = ruled_dir
    want = reference(directory, prompt, 8, num_beams=int(beams), do_sample=False)
    result = CliRunner().invoke(app, ["generate", "-c", str(directory), "-n", "8", "--greedy", "--num-beams", beams,
                                      "--format", "jsonl", prompt])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["completion"] == want


def test_a_bad_rule_is_a_one_line_error(tmp_path, ruled_dir):
    import shutil

    directory, _ = ruled_dir
    shutil.copytree(directory, tmp_path / "bad")
    (tmp_path / "bad" / "generation_config.json").write_text(json.dumps({"bad_words_ids": [[1, "x"]]}))
    result = CliRunner().invoke(app, ["generate", "-c", str(tmp_path / "bad"), "-n", "3", "hi"])
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad_words_ids" in lines[0], lines
