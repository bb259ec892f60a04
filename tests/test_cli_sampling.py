"""The sampling flags, job-row fields and model defaults on the command line, each checked against
`model.generate` called directly with transformers' processors (or OpenAI's penalty formula, which
transformers lacks) in transformers' order."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from transformers.generation import logits_process as hf
from typer.testing import CliRunner

import lmcli
from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()
EOS = 1  # the tiny checkpoint's </s>


def cli(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def run_json(checkpoint, prompt, *flags) -> dict:
    result = cli("generate", "-c", checkpoint, "--format", "jsonl", "--logprobs", 0, *flags, prompt)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def ids_of(row) -> list[int]:
    return [step["id"] for step in row["logprobs"]]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return lmcli.load(tiny_checkpoint)


def direct(loaded, prompt, n, do_sample, processors, seed=None, eos=None) -> list[int]:
    """model.generate called directly; the new tokens up to and including EOS."""
    model, tokenizer = loaded
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(ids, n, do_sample, seed=None if seed is None else [seed], logits_processors=processors,
                         eos_token_id=eos, pad_token_id=2)[0, ids.shape[1]:].tolist()
    return out[: out.index(EOS) + 1] if eos is not None and EOS in out else out


def one_token_text(tokenizer) -> tuple[str, int]:
    for token_id in range(200, 400):
        text = tokenizer.decode([token_id])
        if text.strip() and not text.isdigit() and "=" not in text and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            return text, token_id
    raise AssertionError("no single-token text in the tiny vocabulary")


def test_sampling_flags_equal_transformers_processors(tiny_checkpoint, loaded):
    text, text_id = one_token_text(loaded[1])
    flags = ["--temperature", 0.9, "--top-k", 30, "--min-p", 0.05, "--typical-p", 0.95, "--repetition-penalty", 1.3,
             "--no-repeat-ngram-size", 2, "--logit-bias", "5=3", "--logit-bias", f"{text}=-100",
             "--seed", 7, "-n", 16, "--ignore-eos"]
    row = run_json(tiny_checkpoint, "Once upon", *flags)
    processors = [hf.SequenceBiasLogitsProcessor([[[5], 3.0], [[text_id], -100.0]]), hf.RepetitionPenaltyLogitsProcessor(1.3),
                  hf.NoRepeatNGramLogitsProcessor(2), hf.TemperatureLogitsWarper(0.9), hf.TopKLogitsWarper(30),
                  hf.MinPLogitsWarper(0.05), hf.TypicalLogitsWarper(0.95)]
    assert ids_of(row) == direct(loaded, "Once upon", 16, True, processors, seed=7)
    assert text_id not in ids_of(row)
    assert row["settings"] == {"max_new_tokens": 16, "temperature": 0.9, "top_k": 30, "min_p": 0.05, "typical_p": 0.95,
                               "repetition_penalty": 1.3, "no_repeat_ngram_size": 2,
                               "logit_bias": {"5": 3.0, text: -100.0}}
    # the same settings as row fields give the same text
    job = tiny_checkpoint.parent / "sampling-job.jsonl"
    job.write_text(json.dumps({"prompt": "Once upon", "temperature": 0.9, "top_k": 30, "min_p": 0.05,
                               "typical_p": 0.95, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2,
                               "logit_bias": {"5": 3, text: -100}, "seed": 7, "max_new_tokens": 16}) + "\n")
    result = cli("generate", "-c", tiny_checkpoint, "--input", job, "--ignore-eos")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["completion"] == row["completion"]


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties over the generated tokens, written out per token."""

    def __init__(self, prompt_length, presence, frequency):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row in range(len(input_ids)):
            generated = input_ids[row, self.prompt_length:].tolist()
            for token in set(generated):
                scores[row, token] -= self.presence + self.frequency * generated.count(token)
        return scores


def test_presence_and_frequency_penalties_equal_openais_formula(tiny_checkpoint, loaded):
    flags = ["--presence-penalty", 1.5, "--frequency-penalty", 2, "--greedy", "-n", 40, "--ignore-eos"]
    row = run_json(tiny_checkpoint, "Hello", *flags)
    prompt_length = len(loaded[1].encode("Hello"))
    assert ids_of(row) == direct(loaded, "Hello", 40, False, [OpenAIPenalties(prompt_length, 1.5, 2.0)])
    assert ids_of(row) != direct(loaded, "Hello", 40, False, [])  # the penalties mattered


def test_min_new_tokens_holds_back_eos(tiny_checkpoint, loaded):
    """EOS made all but certain by a bias comes only after --min-new-tokens tokens."""
    forced = run_json(tiny_checkpoint, "Hello", "--greedy", "--logit-bias", f"{EOS}=100", "-n", 10)
    assert forced["completion_tokens"] == 1 and forced["finish_reason"] == "eos"
    row = run_json(tiny_checkpoint, "Hello", "--greedy", "--logit-bias", f"{EOS}=100", "--min-new-tokens", 4, "-n", 10)
    prompt_length = len(loaded[1].encode("Hello"))
    processors = [hf.SequenceBiasLogitsProcessor([[[EOS], 100.0]]), hf.MinNewTokensLengthLogitsProcessor(prompt_length, 4, EOS)]
    assert ids_of(row) == direct(loaded, "Hello", 10, False, processors, eos=EOS)
    assert row["completion_tokens"] == 5 and row["finish_reason"] == "eos"


def test_max_tokens_is_an_alias_of_n(tiny_checkpoint):
    a = run_json(tiny_checkpoint, "Hello", "--greedy", "--ignore-eos", "--max-tokens", 6)
    b = run_json(tiny_checkpoint, "Hello", "--greedy", "--ignore-eos", "-n", 6)
    assert a["completion_tokens"] == 6 and a["completion"] == b["completion"]


@pytest.mark.parametrize("flags,message", [
    (["--logit-bias", "5"], "--logit-bias takes TOKEN=BIAS"),
    (["--logit-bias", "5=lots"], "--logit-bias takes TOKEN=BIAS"),
    (["--logit-bias", "99999=1"], "--logit-bias: token id 99999 is outside the vocabulary"),
    (["--logit-bias", "Once upon a time=1"], "not one; give one token or its id"),
    (["--min-p", 2], "--min-p must be in [0, 1]"),
    (["--greedy", "--typical-p", 0.5], "--typical-p only applies to sampling"),
])
def test_bad_sampling_flags_exit_2_naming_the_flag(tiny_checkpoint, flags, message):
    result = cli("generate", "-c", tiny_checkpoint, "-n", 2, *flags, "Hello")
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def with_defaults(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with sampling defaults in its generation_config.json."""
    directory = tmp_path_factory.mktemp("tiny-with-defaults") / "model"
    shutil.copytree(tiny_checkpoint, directory)
    config = json.loads((directory / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.7, top_k=10, repetition_penalty=1.2, max_new_tokens=9)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_model_defaults_apply_under_the_flags(with_defaults, loaded):
    row = run_json(with_defaults, "Once upon", "--seed", 3, "--ignore-eos")
    processors = [hf.RepetitionPenaltyLogitsProcessor(1.2), hf.TemperatureLogitsWarper(0.7), hf.TopKLogitsWarper(10)]
    assert ids_of(row) == direct(loaded, "Once upon", 9, True, processors, seed=3)  # same weights as the tiny model
    assert row["settings"] == {"max_new_tokens": 9, "temperature": 0.7, "top_k": 10, "repetition_penalty": 1.2}
    greedy = run_json(with_defaults, "Once upon", "--temperature", 0, "-n", 6, "--ignore-eos")
    assert ids_of(greedy) == direct(loaded, "Once upon", 6, False, [hf.RepetitionPenaltyLogitsProcessor(1.2)])
    assert greedy["settings"] == {"max_new_tokens": 6, "temperature": 0.0, "repetition_penalty": 1.2}


def test_info_shows_each_default_and_its_source(with_defaults):
    result = cli("info", with_defaults)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "default top_k: 10 (generation_config.json)" in [line.replace(str(with_defaults) + "/", "") for line in lines]
    assert "default top_p: off (lmcli default)" in lines
    assert "default max_new_tokens: 9 (" in result.stdout


def test_flag_beats_row_beats_model_default(with_defaults, loaded):
    """Issue 10's order end to end: a flag > a job row > the model's generation_config.json > lmcli."""
    job = with_defaults.parent / "precedence-job.jsonl"
    SHOWN = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty")

    def run_job(row, *flags) -> dict:
        job.write_text(json.dumps({"prompt": "Once upon", **row}) + "\n")
        result = cli("generate", "-c", with_defaults, "--input", job, "--logprobs", 0, "--ignore-eos", *flags)
        assert result.exit_code == 0, result.stderr
        assert result.stderr.strip() == ""  # a flag beating a row is silent
        out = json.loads(result.stdout)
        out["settings"] = {name: out["settings"][name] for name in SHOWN if out["settings"].get(name) is not None}
        return out

    row = run_job({"temperature": 0.5, "top_k": 5, "repetition_penalty": 1.1, "max_new_tokens": 12, "seed": 4},
                  "--temperature", 0.9, "--top-p", 0.8)
    # temperature and truncation from the flags (the row's top_k does not mix in), the repetition penalty
    # and max_new_tokens from the row (not the model's 1.2 and 9), the seed from the row
    assert row["settings"] == {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.8, "repetition_penalty": 1.1}
    assert row["seed"] == 4
    processors = [hf.RepetitionPenaltyLogitsProcessor(1.1), hf.TemperatureLogitsWarper(0.9), hf.TopPLogitsWarper(0.8)]
    assert ids_of(row) == direct(loaded, "Once upon", 12, True, processors, seed=4)

    # a greedy flag makes a sampling row greedy (the model's top-k does not apply)
    greedy = direct(loaded, "Once upon", 6, False, [hf.RepetitionPenaltyLogitsProcessor(1.2)])
    row = run_job({"temperature": 0.5, "top_k": 5, "max_new_tokens": 6}, "--greedy")
    assert row["settings"] == {"max_new_tokens": 6, "temperature": 0.0, "repetition_penalty": 1.2}
    assert ids_of(row) == greedy
    # with no temperature flag, a row's temperature 0 beats the model's 0.7 and drops its top-k
    row = run_job({"temperature": 0, "max_new_tokens": 6})
    assert row["settings"] == {"max_new_tokens": 6, "temperature": 0.0, "repetition_penalty": 1.2}
    assert ids_of(row) == greedy
