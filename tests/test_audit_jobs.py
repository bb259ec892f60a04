"""Job rows the earlier tests did not exercise (found by the planted-bug audit, docs/testing.md): an input
that starts with a UTF-8 byte order mark, rows without an id, rows of different max_new_tokens sharing
a batch, a prompt longer than the model's context, and a batch that fails after some of its rows finished.

One job runs them all; each completion is compared with `model.generate` called directly on
transformers' token ids (and the long row's first logprob with `model.forward` on the prompt's end),
and each id and length with the values this test wrote.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT = 512  # cli_fixtures' tiny Llama: max_position_embeddings
# Well past the context, and not periodic: its first and last 509 tokens differ.
LONG = " ".join(f"{word} {i}." for i, word in zip(range(400), ["fox", "dog", "cat", "owl", "elk"] * 80))


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """(prompt ids, greedy new ids) from model.generate with transformers' tokenizer, EOS ignored."""
    import transformers

    import lmcli

    model, _ = lmcli.load(tiny_checkpoint)
    hf = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)

    def run(prompt: str, n: int, keep: int | None = None):
        ids = list(hf(prompt)["input_ids"])
        if keep is not None:
            ids = ids[-keep:]
        out = model.generate(torch.tensor([ids]), n, do_sample=False)
        new = out[0, len(ids):].tolist()
        with torch.inference_mode():
            first = torch.log_softmax(model.forward(torch.tensor([ids]))[0, -1].float(), -1)[new[0]].item()
        return ids, new, hf.decode(ids + new)[len(hf.decode(ids)):], first

    return run


@pytest.fixture(scope="module")
def rows(tmp_path_factory, tiny_checkpoint):
    directory = tmp_path_factory.mktemp("job")
    source, out = directory / "in.jsonl", directory / "out.jsonl"
    lines = [{"prompt": "Hello there", "max_new_tokens": 2}, {"prompt": "Hello there", "max_new_tokens": 6},
             {"id": "long", "prompt": LONG, "max_new_tokens": 3}]
    source.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in lines).encode())
    result = CliRunner().invoke(app, ["generate", "-c", str(tiny_checkpoint), "--greedy", "--ignore-eos",
                                      "--logprobs", "0", "--input", str(source), "--output", str(out)])
    assert result.exit_code == 0, result.output
    return {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}


def test_a_byte_order_mark_and_rows_without_ids(rows):
    """The first row is read past the BOM; rows without an id take their 1-based line numbers."""
    assert set(rows) == {1, 2, "long"}
    assert rows[1]["prompt"] == "Hello there" and "error" not in rows[1]


def test_rows_of_different_lengths_in_one_batch_each_get_their_own(rows, reference):
    for row_id, n in ((1, 2), (2, 6)):
        ids, _, text, _ = reference("Hello there", n)
        row = rows[row_id]
        assert (row["completion_tokens"], row["finish_reason"], row["prompt_tokens"]) == (n, "length", len(ids))
        assert row["completion"] == text


def test_a_prompt_longer_than_the_context_keeps_its_end(rows, reference):
    """The start is dropped, leaving room for max_new_tokens: the model sees the prompt's last 509 tokens."""
    _, new, text, first = reference(LONG, 3, keep=CONTEXT - 3)
    row = rows["long"]
    assert (row["prompt_tokens"], row["completion_tokens"]) == (CONTEXT - 3, 3)
    assert row["completion"] == text
    assert [step["id"] for step in row["logprobs"]] == new
    assert row["logprobs"][0]["logprob"] == pytest.approx(first, abs=2e-4)  # what the model saw: the end


def test_a_batch_that_fails_after_a_row_finished_writes_each_row_once(tmp_path, tiny_checkpoint, reference,
                                                                       monkeypatch):
    """The three-row batch fails at its fourth step (as running out of memory would), after the 2-token
    row is written: the other two are run alone, and the finished one is neither run nor written again."""
    from lmcli.generation.continuous import SCHEDULER_ENV
    from lmcli.generation.models import GeneratingModel

    real_generate, batches = GeneratingModel.generate, []

    def failing(self, input_ids, *args, on_token=None, **kwargs):
        batches.append(input_ids.shape[0])
        steps = []

        def counted(event):
            steps.append(1)
            if len(steps) == 4 and input_ids.shape[0] > 1:
                raise RuntimeError("not enough memory")
            return on_token(event)

        return real_generate(self, input_ids, *args, on_token=counted if on_token else None, **kwargs)

    monkeypatch.setattr(GeneratingModel, "generate", failing)
    monkeypatch.setenv(SCHEDULER_ENV, "batches")  # planned batches (a float model's default, too)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"prompt": "Hello there", "max_new_tokens": n}) + "\n" for n in (2, 6, 6)))
    result = CliRunner().invoke(app, ["generate", "-c", str(tiny_checkpoint), "--greedy", "--ignore-eos",
                                      "--batch-size", "3", "--input", str(source), "--output", str(out)])
    assert result.exit_code == 0, result.output
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["id"] for row in written) == [1, 2, 3]  # each once
    assert batches == [3, 1, 1]
    for row in written:
        assert row["completion"] == reference("Hello there", row["completion_tokens"])[2]
