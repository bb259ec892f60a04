"""Each generation flag of `lmcli generate` against `model.generate` called directly with the same arguments.

The CLI path (flags -> settings -> job rows -> generate_batch) is compared with something independent of
it: the model's own `generate` on prompt ids from transformers' tokenizer (and chat template), logprobs
recomputed from one full forward pass. Each test also checks that the flag changes the reference output,
so a CLI that dropped the flag would fail.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from typer.testing import CliRunner

import lmcli
from lmcli.cli import app
from lmcli.generation.sampling import RepetitionPenalty

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "Once upon a time there was"
N = 24


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    import transformers

    model, _ = lmcli.load(tiny_checkpoint)
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    return model, reference_tokenizer


def cli_row(checkpoint, *flags, prompt=PROMPT) -> dict:
    """The one JSON row `lmcli generate --format jsonl --logprobs 2 FLAGS PROMPT` writes."""
    args = ["generate", "-c", str(checkpoint), "--format", "jsonl", "--logprobs", "2", *map(str, flags), prompt]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    [line] = result.stdout.splitlines()
    return json.loads(line)


def cli_ids(row: dict) -> list[int]:
    return [step["id"] for step in row["logprobs"]]


def direct(loaded, prompt_ids: list[int], n: int = N, *, eos: bool = False, **kwargs) -> list[int]:
    """New token ids from model.generate itself; with `eos`, up to and including the first EOS."""
    model, reference_tokenizer = loaded
    out = model.generate(torch.tensor([prompt_ids]), n, eos_token_id=reference_tokenizer.eos_token_id if eos else None,
                         **kwargs)
    new = out[0, len(prompt_ids):].tolist()
    if eos and reference_tokenizer.eos_token_id in new:
        new = new[: new.index(reference_tokenizer.eos_token_id) + 1]
    return new


def prompt_ids(loaded, prompt: str = PROMPT) -> list[int]:
    return loaded[1](prompt).input_ids  # transformers' tokenizer: adds BOS as tokenizer_config says


def text_of(loaded, ids: list[int]) -> str:
    return loaded[1].decode(ids, skip_special_tokens=True)


def assert_same(row: dict, loaded, expected: list[int]) -> None:
    assert cli_ids(row) == expected
    assert row["completion"] == text_of(loaded, expected)


# --- each flag -----------------------------------------------------------------------------------------


def test_greedy_and_max_new_tokens(tiny_checkpoint, loaded):
    ids = prompt_ids(loaded)
    row = cli_row(tiny_checkpoint, "--greedy", "--ignore-eos", "-n", 7)
    expected = direct(loaded, ids, 7, do_sample=False)
    assert_same(row, loaded, expected)
    assert row["completion_tokens"] == 7 and row["prompt_tokens"] == len(ids)


def test_default_stops_at_eos_like_generate(tiny_checkpoint, loaded):
    # Seeds until one ends in EOS within N tokens, so the EOS path is exercised.
    ids = prompt_ids(loaded)
    for seed in range(40):
        expected = direct(loaded, ids, do_sample=True, temperature=1.5, seed=seed, eos=True)
        if expected[-1] == loaded[1].eos_token_id:
            break
    else:
        pytest.fail("no seed reached EOS")
    row = cli_row(tiny_checkpoint, "--temperature", 1.5, "--seed", seed)
    assert cli_ids(row) == expected and row["finish_reason"] == "eos"
    assert row["completion"] == text_of(loaded, expected)


@pytest.mark.parametrize("temperature", [0.3, 2.5])
def test_temperature_and_seed(tiny_checkpoint, loaded, temperature):
    ids = prompt_ids(loaded)
    expected = direct(loaded, ids, do_sample=True, temperature=temperature, seed=11)
    assert expected != direct(loaded, ids, do_sample=True, temperature=0.8, seed=11)  # the flag matters here
    assert expected != direct(loaded, ids, do_sample=True, temperature=temperature, seed=12)  # and the seed
    row = cli_row(tiny_checkpoint, "--temperature", temperature, "--seed", 11, "--ignore-eos", "-n", N)
    assert_same(row, loaded, expected)
    assert row["seed"] == 11


@pytest.mark.parametrize(("flag", "argument", "value"), [("--top-k", "top_k", 3), ("--top-p", "top_p", 0.5)])
def test_top_k_and_top_p(tiny_checkpoint, loaded, flag, argument, value):
    ids = prompt_ids(loaded)
    expected = direct(loaded, ids, do_sample=True, temperature=3.0, seed=5, **{argument: value})
    assert expected != direct(loaded, ids, do_sample=True, temperature=3.0, seed=5)
    row = cli_row(tiny_checkpoint, "--temperature", 3.0, flag, value, "--seed", 5, "--ignore-eos", "-n", N)
    assert_same(row, loaded, expected)


@pytest.mark.parametrize("sampled", [False, True])
def test_repetition_penalty(tiny_checkpoint, loaded, sampled):
    ids = prompt_ids(loaded)
    how = dict(do_sample=True, temperature=1.0, seed=3) if sampled else dict(do_sample=False)
    expected = direct(loaded, ids, logits_processors=[RepetitionPenalty(3.0)], **how)
    assert expected != direct(loaded, ids, **how)
    flags = ["--temperature", 1.0, "--seed", 3] if sampled else ["--greedy"]
    row = cli_row(tiny_checkpoint, *flags, "--repetition-penalty", 3.0, "--ignore-eos", "-n", N)
    assert_same(row, loaded, expected)


def test_stop(tiny_checkpoint, loaded):
    ids = prompt_ids(loaded)
    expected = direct(loaded, ids, 40, do_sample=False)
    full = text_of(loaded, expected)
    stop = full[12:15]  # some text the model does write
    assert stop and full.index(stop) >= 1
    row = cli_row(tiny_checkpoint, "--greedy", "--ignore-eos", "-n", 40, "--stop", stop)
    assert row["completion"] == full[: full.index(stop)] and row["finish_reason"] == "stop"
    assert cli_ids(row) == expected[: len(cli_ids(row))]  # stopped early on the same tokens


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_chat_and_system(tiny_checkpoint, loaded, system):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": PROMPT}]
    chat_ids = loaded[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)  # BatchEncoding in v5
    expected = direct(loaded, chat_ids, do_sample=False)
    assert expected != direct(loaded, prompt_ids(loaded), do_sample=False)
    row = cli_row(tiny_checkpoint, "--greedy", "--ignore-eos", "-n", N, "--chat", *(["--system", system] if system else []))
    assert_same(row, loaded, expected)
    assert row["prompt_tokens"] == len(chat_ids)


@pytest.mark.parametrize("flags", [["--greedy"], ["--temperature", 2.0, "--seed", 9], ["--temperature", 2.0, "--top-k", 5, "--seed", 9]])
def test_logprobs_of_the_tokens_written(tiny_checkpoint, loaded, flags):
    """Each entry's logprob is log_softmax of the raw logits at that position for the token actually
    written (sampled or not), and the top-K alternatives are the K best there; from one full forward pass."""
    model, _ = loaded
    ids = prompt_ids(loaded)
    row = cli_row(tiny_checkpoint, *flags, "--ignore-eos", "-n", 12)
    new = cli_ids(row)
    with torch.no_grad():
        logits = model(torch.tensor([ids + new]))[0, len(ids) - 1 : -1].float()  # (n, V): predicts each new token
    logprobs = torch.log_softmax(logits, dim=-1)
    written = logprobs.gather(1, torch.tensor(new)[:, None]).squeeze(1)
    got = torch.tensor([step["logprob"] for step in row["logprobs"]])
    torch.testing.assert_close(got, written, atol=2e-4, rtol=0)
    if "--greedy" not in flags:  # sampling at temperature 2 writes tokens other than the most likely
        assert (written < logprobs.max(dim=-1).values - 1e-3).any()
    top = logprobs.topk(2, dim=-1)
    for step, values, top_ids in zip(row["logprobs"], top.values, top.indices):
        assert [alt["id"] for alt in step["top"]] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([alt["logprob"] for alt in step["top"]]), values, atol=2e-4, rtol=0)


def test_compile_flag_compiles_the_decode_step_and_keeps_the_tokens(tiny_checkpoint, loaded, monkeypatch):
    """--compile reaches BaseModel.compile_decode (here a stand-in that records the call: real compiling
    takes a minute and is checked against transformers in tests/test_compile.py), and the tokens are
    model.generate's own."""
    from lmcli.models.base import BaseModel

    compiled: list[BaseModel] = []

    def record(self: BaseModel) -> bool:
        compiled.append(self)
        return True

    monkeypatch.setattr(BaseModel, "compile_decode", record)
    row = cli_row(tiny_checkpoint, "--compile", "--greedy", "-n", N)
    assert len(compiled) == 1
    prompt_ids = loaded[1](PROMPT)["input_ids"]
    assert cli_ids(row) == direct(loaded, prompt_ids, do_sample=False)
    assert not compiled[1:] and cli_row(tiny_checkpoint, "--greedy", "-n", N) and len(compiled) == 1
