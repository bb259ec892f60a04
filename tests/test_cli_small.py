"""Small things users noticed: the final newline in a pipe, `--stop '\\n'`, `--tokenizer PATH`, "1 row", info on GGUF."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_fixtures import run_lmcli, tiny_checkpoint  # noqa: F401 (fixtures)
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def as_json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_pipe_gets_one_line_ending_in_a_newline(tiny_checkpoint):
    flags = ["-c", tiny_checkpoint, "--greedy", "-n", "6", "--ignore-eos"]
    row = as_json(cli("generate", *flags, "--format", "jsonl", "Hello"))
    assert "\n" not in row["completion"]  # otherwise wc -l would rightly count more
    result = run_lmcli("generate", *map(str, flags), "Hello")  # a real pipe
    assert result.returncode == 0 and result.stdout.decode() == row["completion"] + "\n"
    assert result.stdout.count(b"\n") == 1  # what `| wc -l` counts


def test_stop_backslash_n_means_a_newline(tiny_checkpoint):
    """`--stop '\\n'` cuts at the first newline of the unstopped completion; `'\\\\n'` is a backslash and n."""
    base = ["generate", "-c", tiny_checkpoint, "-n", "60", "--ignore-eos", "--format", "jsonl"]
    prompt = "def main():\n    print('hi')\n"  # the tokenizer learned newlines from code like this
    for seed in range(40):
        free = as_json(cli(*base, "--seed", seed, prompt))
        if "\n" in free["completion"]:
            break
    else:
        pytest.fail("no completion with a newline in 40 seeds")
    cut = as_json(cli(*base, "--seed", seed, "--stop", r"\n", prompt))
    assert cut["completion"] == free["completion"][: free["completion"].index("\n")]
    assert cut["finish_reason"] == "stop"
    literal = as_json(cli(*base, "--seed", seed, "--stop", r"\\n", prompt))  # a backslash, then n
    assert literal["completion"] == free["completion"].split("\\n")[0]


def test_a_lone_safetensors_file_takes_its_tokenizer_from_the_flag(tiny_checkpoint, tmp_path):
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copy(tiny_checkpoint / name, lonely / name)
    weights = lonely / "model.safetensors"
    flags = ["--greedy", "-n", "8", "--ignore-eos", "--format", "jsonl", "Hello world"]

    missing = cli("generate", "-c", weights, *flags)
    assert missing.exit_code == 1 and "--tokenizer PATH" in missing.stderr and missing.stderr.count("\n") == 1

    reference = as_json(cli("generate", "-c", tiny_checkpoint, *flags))
    for tokenizer in (tiny_checkpoint / "tokenizer.json", tiny_checkpoint):
        got = as_json(cli("generate", "-c", weights, "--tokenizer", tokenizer, *flags))
        assert (got["completion"], got["prompt_tokens"]) == (reference["completion"], reference["prompt_tokens"])

    (tmp_path / "vocab.txt").write_text("a\n")
    wrong = cli("generate", "-c", weights, "--tokenizer", tmp_path / "vocab.txt", *flags)
    assert wrong.exit_code == 2 and "expected a tokenizer.json, a tokenizer.model or an HF directory" in wrong.stderr


def test_one_row_is_one_row(tiny_checkpoint, tmp_path):
    (tmp_path / "in.txt").write_text("Hello\n")
    result = cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", "2", "--input", tmp_path / "in.txt",
                 "--output", tmp_path / "out.jsonl")
    assert result.exit_code == 0 and "1 row written" in result.stderr and "1 rows" not in result.stderr


def test_info_on_a_quantized_gguf_shows_its_quantization(smollm2_gguf):
    """The tensor types and file type as gguf's own reader sees them."""
    from collections import Counter

    import gguf

    reader = gguf.GGUFReader(smollm2_gguf)
    counts = Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors)
    file_type = gguf.LlamaFileType(int(reader.fields["general.file_type"].parts[-1][0])).name.removeprefix("MOSTLY_")
    result = cli("info", smollm2_gguf)
    assert result.exit_code == 0, result.output
    facts = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    label, _, kinds = facts["quantization"].partition(" (")
    assert label == file_type == "Q4_1"
    listed = dict(part.split(" ×") for part in kinds.rstrip(")").split(", "))
    assert {name: int(n) for name, n in listed.items()} == dict(counts)
