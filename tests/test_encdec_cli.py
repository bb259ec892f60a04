"""`lmcli generate` and `lmcli info` on an encoder-decoder checkpoint with a tokenizer.json, against
transformers' generate and decode of the same files."""

from __future__ import annotations

import json

import pytest
import torch
from cli_fixtures import run_lmcli
from typer.testing import CliRunner

from lmcli.cli import app

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

CORPUS = ["translate English to German: the house is wonderful", "summarize: a cat sat on the mat and slept",
          "the quick brown fox jumps over the lazy dog", "ein kleines Haus am See"] * 10


def _t5_tokenizer(directory) -> int:
    """A Metaspace BPE that appends </s> to every input, as T5's own tokenizer.json does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=160, special_tokens=["<pad>", "</s>", "<unk>"], show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    return tokenizer.get_vocab_size()


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("t5-cli")
    vocab = _t5_tokenizer(directory)
    config = transformers.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   feed_forward_proj="gated-gelu", decoder_start_token_id=0, eos_token_id=1,
                                   pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(directory)
    return directory


def _reference_text(directory, prompt: str, new_tokens: int) -> tuple[list[int], str]:
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                                     eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    model = transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()
    encoded = tokenizer(prompt, return_tensors="pt")
    assert encoded.input_ids[0, -1].item() == 1  # the tokenizer.json appends </s>
    config = model.generation_config
    config.eos_token_id, config.pad_token_id = 1, 0
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                             generation_config=config)
    return out[0, 1:].tolist(), tokenizer.decode(out[0], skip_special_tokens=True)


def test_generate_prints_transformers_decoded_text(t5_dir):
    prompt = "translate English to German: the house is wonderful"
    _, expected = _reference_text(t5_dir, prompt, 12)
    result = CliRunner().invoke(app, ["generate", "-c", str(t5_dir), "--greedy", "-n", "12", "--format", "jsonl",
                                      prompt])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["completion"] == expected and expected.strip()
    piped = run_lmcli("generate", "-c", str(t5_dir), "--greedy", "-n", "12", prompt)  # streamed through a pipe
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.decode() == expected + "\n"


def test_info_shows_encoder_and_decoder(t5_dir):
    result = CliRunner().invoke(app, ["info", str(t5_dir)])
    assert result.exit_code == 0, result.output
    assert "encoder: 2 layers, 4 heads of 8, feed-forward 64" in result.stdout
    assert "decoder: 2 layers, 4 heads of 8, feed-forward 64" in result.stdout


def test_chat_without_a_template_is_the_usual_error(t5_dir):
    result = CliRunner().invoke(app, ["generate", "-c", str(t5_dir), "--chat", "-n", "3", "hi"])
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "chat template" in lines[0], lines


def test_a_job_of_openai_completion_rows_gives_transformers_text(t5_dir, tmp_path):
    """Rows of different lengths, batched together (the encoder input padded), each as transformers alone."""
    prompts = ["summarize: a cat sat on the mat and slept", "the quick brown fox", "ein kleines Haus am See"]
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": prompt, "temperature": 0, "max_tokens": 10}} for i, prompt in enumerate(prompts)]
    source, out = tmp_path / "requests.jsonl", tmp_path / "responses.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = CliRunner().invoke(app, ["generate", "-c", str(t5_dir), "--input", str(source), "--output", str(out)])
    assert result.exit_code == 0, result.output
    answers = {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    for i, prompt in enumerate(prompts):
        _, expected = _reference_text(t5_dir, prompt, 10)
        assert answers[f"r{i}"]["response"]["body"]["choices"][0]["text"] == expected
