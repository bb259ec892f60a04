"""The `lmcli` command, driven for real on a tiny random Llama with a trained tokenizer.

Most tests run in-process through Typer's CliRunner (where stdout is not a terminal, as
in a pipe); a few use a subprocess for what only a real process shows: pipes, a
terminal (pty), and a job killed with SIGKILL. The model writes gibberish, so the
tests check relationships between runs, not fixed strings.
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from cli_fixtures import (  # noqa: F401 (fixtures)
    REPO,
    run_lmcli,
    subprocess_env,
    tiny_checkpoint,
    tiny_spm_checkpoint,
)
from typer.testing import CliRunner

from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()


def cli(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def generate_json(checkpoint, prompt, *flags) -> dict:
    result = cli("generate", "-c", checkpoint, "--format", "jsonl", *flags, prompt)
    assert result.exit_code == 0, result.stderr
    [line] = result.stdout.splitlines()
    return json.loads(line)


def generated_ids(row: dict) -> list[int]:
    return [step["id"] for step in row["logprobs"]]


def tokenizer_of(checkpoint):
    from lmcli.io.tokenizer import load_tokenizer

    return load_tokenizer(checkpoint)


# ----------------------------------------------------------------------------- help, version, errors


def test_help_version_and_a_light_import():
    result = cli("--help")
    assert result.exit_code == 0 and "generate" in result.stdout and "models" in result.stdout
    result = cli("generate", "--help")
    assert result.exit_code == 0
    for flag in ("--max-new-tokens", "--top-p", "--stop", "--chat", "--input", "--resume", "--logprobs"):
        assert flag in result.stdout
    result = cli("--version")
    assert result.exit_code == 0 and re.fullmatch(r"lmcli \S+\n", result.stdout)
    # `import lmcli.cli` (and so `lmcli --help`) must not pay for torch.
    check = "import sys, lmcli.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], cwd=REPO).returncode == 0


USAGE_ERRORS = [
    (["--top-k", "5", "--top-p", "0.9"], "--top-k and --top-p cannot be used together"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["-n", "0"], "--max-new-tokens must be at least 1"),
    (["-n", "many"], "'--max-new-tokens'"),
    (["--greedy", "--temperature", "0.5"], "--greedy and --temperature 0.5 contradict"),
    (["--system", "be brief"], "--system only applies with --chat"),
    (["--logprobs", "3"], "--logprobs goes into JSON output"),
    (["--resume"], "--resume only applies to batch jobs"),
    (["--no-such-flag"], "No such option: --no-such-flag"),
    (["--device", "tpu"], "'--device'"),
    (["--checkpoint", "/no/such/model"], "does not exist"),
]


@pytest.mark.parametrize("flags, message", USAGE_ERRORS, ids=[" ".join(f) for f, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_one_line_before_loading(flags, message, monkeypatch):
    import lmcli.loading

    monkeypatch.setattr(lmcli.loading, "load", lambda *a, **k: pytest.fail("loaded a model for a usage error"))
    result = cli("generate", *flags, "a prompt")
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output and result.stdout == ""


def test_other_usage_errors(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("hi\n")
    cases = [
        (["generate", "x", "--input", source], "give either a PROMPT or --input FILE"),
        (["generate", "--input", source, "--resume"], "--resume needs --output FILE"),
        (["generate", "--input", tmp_path / "missing.jsonl"], "does not exist"),
        (["info", tmp_path / "missing"], "does not exist"),
        (["frobnicate"], "No such command"),
        (["generate", "--input", source, "--batch-size", "0"], "'--batch-size'"),
    ]
    for args, message in cases:
        result = cli(*args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_runtime_errors_are_one_line_exit_1(tiny_checkpoint, tmp_path):
    result = cli("generate", "-c", tiny_checkpoint, "-m", "no-such-model", "hi")
    assert result.exit_code == 1 and "unknown model 'no-such-model'" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output

    # A checkpoint whose tokenizer has no chat template: --chat is a clear error.
    plain = tmp_path / "no-template"
    plain.mkdir()
    for path in tiny_checkpoint.iterdir():
        (plain / path.name).write_bytes(path.read_bytes())
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    result = cli("generate", "-c", plain, "--chat", "hi")
    assert result.exit_code == 1 and "chat template" in result.stderr and result.stderr.count("\n") == 1

    # No tokenizer at all: text cannot be encoded.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (plain / name).unlink()
    result = cli("generate", "-c", plain, "hi")
    assert result.exit_code == 1 and "no tokenizer" in result.stderr and result.stderr.count("\n") == 1

    result = cli("--debug", "generate", "-c", plain, "hi")
    assert result.exit_code == 1 and "Traceback" in result.stderr


# ----------------------------------------------------------------------------- single prompts


def test_stream_equals_the_final_text_on_cyrillic_and_emoji(tiny_checkpoint):
    """Streamed pieces join to decode(prompt + new) - decode(prompt), even when characters split across tokens."""
    tokenizer = tokenizer_of(tiny_checkpoint)
    split_characters = 0
    for seed, prompt in enumerate(["Привет, мир!", "Emoji 🙂🚀", "Москва 🎉 — город"]):
        row = generate_json(tiny_checkpoint, prompt, "--seed", seed, "-n", 40, "--ignore-eos", "--logprobs", 0)
        ids = generated_ids(row)
        prompt_ids = tokenizer.encode(prompt)
        expected = tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)) :]
        assert row["completion"] == expected and row["completion_tokens"] == 40
        piped = cli("generate", "-c", tiny_checkpoint, "--seed", seed, "-n", 40, "--ignore-eos", prompt)
        assert piped.exit_code == 0 and piped.stdout == row["completion"] + "\n"  # a pipe gets a final newline
        split_characters += sum(tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    assert split_characters > 0  # the runs did split characters across tokens


def test_sentencepiece_leading_space_survives_streaming(tiny_spm_checkpoint):
    tokenizer = tokenizer_of(tiny_spm_checkpoint)
    spaced = 0
    for seed in range(3):
        row = generate_json(tiny_spm_checkpoint, "Hello", "--seed", seed, "-n", 12, "--ignore-eos", "--logprobs", 0)
        prompt_ids = tokenizer.encode("Hello")
        full = tokenizer.decode(prompt_ids + generated_ids(row))
        assert "Hello" + row["completion"] == full
        spaced += row["completion"].startswith(" ")
    assert spaced > 0  # a completion that starts a new word keeps its space


def test_stop_strings_cut_even_when_split_across_tokens(tiny_checkpoint):
    tokenizer = tokenizer_of(tiny_checkpoint)
    prompt, flags = "The quick brown fox", ["--greedy", "-n", 48, "--ignore-eos"]
    row = generate_json(tiny_checkpoint, prompt, *flags, "--logprobs", 0)
    text, ids = row["completion"], generated_ids(row)
    prompt_ids = tokenizer.encode(prompt)
    prompt_text = tokenizer.decode(prompt_ids)
    # A stop string made of the last character of one token and the first of the next,
    # at the first place it occurs.
    stop = None
    for i in range(1, len(ids)):
        seam = len(tokenizer.decode(prompt_ids + ids[:i])) - len(prompt_text)
        candidate = text[seam - 1 : seam + 1]
        if 0 < seam < len(text) and "\ufffd" not in candidate and text.find(candidate) == seam - 1:
            stop = candidate
            break
    assert stop is not None, "no token seam to test in this completion"
    stopped = generate_json(tiny_checkpoint, prompt, *flags, "--stop", "never-there", "--stop", stop)
    assert stopped["completion"] == text[: text.find(stop)]
    assert stopped["finish_reason"] == "stop" and stop not in stopped["completion"]
    piped = cli("generate", "-c", tiny_checkpoint, *flags, "--stop", stop, prompt)
    assert piped.stdout == stopped["completion"] + "\n"


def test_greedy_eos_length_and_stdin(tiny_checkpoint):
    row = generate_json(tiny_checkpoint, "Hello", "--greedy", "-n", 5)
    assert row["finish_reason"] in ("eos", "length") and row["completion_tokens"] <= 5
    assert row["prompt_tokens"] == len(tokenizer_of(tiny_checkpoint).encode("Hello"))
    assert row["seed"] is None and set(row) >= {"id", "prompt", "completion", "input_hash"}
    same = generate_json(tiny_checkpoint, "Hello", "--temperature", "0", "-n", 5)
    assert same["completion"] == row["completion"]
    # `-` and a piped stdin read the whole of stdin as the prompt.
    for args in (["-"], []):
        result = cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", 5, "--format", "jsonl", *args, input="Hello")
        assert json.loads(result.stdout)["completion"] == row["completion"]
    result = cli("generate", "-c", tiny_checkpoint, "--greedy", input="")
    assert result.exit_code == 2 and "the prompt is empty" in result.stderr


def test_sampling_records_its_seed_and_the_seed_reproduces_it(tiny_checkpoint):
    first = generate_json(tiny_checkpoint, "Once upon", "-n", 10, "--top-k", 20, "--ignore-eos")
    again = generate_json(tiny_checkpoint, "Once upon", "-n", 10, "--top-k", 20, "--ignore-eos", "--seed", first["seed"])
    assert again["completion"] == first["completion"] and again["seed"] == first["seed"]
    penalised = generate_json(tiny_checkpoint, "Once upon", "-n", 10, "--repetition-penalty", 1.3, "--seed", 1)
    assert penalised["completion_tokens"] >= 1


def test_chat_with_system_message(tiny_checkpoint):
    tokenizer = tokenizer_of(tiny_checkpoint)
    row = generate_json(tiny_checkpoint, "Hi there", "--chat", "--system", "Be brief.", "--greedy", "-n", 4)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert row["prompt_tokens"] == len(tokenizer.encode_chat(messages)) and row["prompt"] == "Hi there"


def test_logprobs_are_log_probabilities_with_top_k(tiny_checkpoint):
    row = generate_json(tiny_checkpoint, "Hello", "--greedy", "-n", 3, "--ignore-eos", "--logprobs", 3)
    assert len(row["logprobs"]) == 3
    for step in row["logprobs"]:
        assert len(step["top"]) == 3 and step["logprob"] <= 0
        assert step["top"][0]["id"] == step["id"]  # greedy takes the most likely token
        assert step["top"][0]["logprob"] >= step["top"][1]["logprob"] >= step["top"][2]["logprob"]


def test_models_and_info(tiny_checkpoint):
    result = cli("models")
    assert result.exit_code == 0
    assert "llama" in result.stdout and "mixtral" in result.stdout and "\x1b" not in result.stdout
    result = cli("info", tiny_checkpoint)
    assert result.exit_code == 0
    facts = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert facts["architecture"].startswith("llama")
    assert facts["context length"] == "512 tokens" and facts["chat template"] == "yes"
    assert facts["dtype"] == "float32" and facts["layers"] == "2"
    assert facts["parameters"].endswith(f"({_parameter_count(tiny_checkpoint):,})")


def _parameter_count(checkpoint) -> int:
    from safetensors import safe_open

    with safe_open(checkpoint / "model.safetensors", "np") as f:
        return sum(f.get_tensor(name).size for name in f.keys())  # noqa: SIM118 (safe_open is not a dict)


# ----------------------------------------------------------------------------- batch jobs


def test_a_batch_job_gives_the_rows_single_runs_give(tiny_checkpoint, tmp_path):
    rows: list[dict[str, Any]] = [
        {"id": "a", "prompt": "Hello", "seed": 1, "max_new_tokens": 12},
        {"id": "b", "prompt": "Привет, мир! Как дела?", "temperature": 0},
        {"id": "c", "prompt": "🙂", "seed": 7, "top_k": 5},
        {"id": "d", "prompt": "The quick brown fox jumps", "temperature": 0, "max_new_tokens": 5},
        {"id": "e", "prompt": "Once upon a time", "stop": ["e", "a"], "seed": 3},
        {"id": "f", "prompt": "x"},
        {"id": "g", "prompt": "Hello there, how are you", "seed": 1, "max_new_tokens": 12},
        {"id": "h", "prompt": "Москва", "temperature": 0, "max_new_tokens": 9},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + '{"broken\n'
                      + '{"id": "j", "prompt": "bad", "top_p": 5}\n')
    out = tmp_path / "out.jsonl"
    # -n is a flag, so it beats the rows' max_new_tokens; the temperature is each row's own (or the default)
    result = cli("generate", "-c", tiny_checkpoint, "--input", source, "--output", out, "-n", 16,
                 "--batch-size", 3)
    assert result.exit_code == 1 and "2 of 10 rows failed" in result.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(str(r["id"]) for r in written) == sorted([r["id"] for r in rows] + ["9", "j"])
    by_id = {r["id"]: r for r in written}
    assert "not valid JSON" in by_id[9]["error"] and '"top_p" must be in (0, 1]' in by_id["j"]["error"]

    for row in rows:
        flags: list[Any] = ["-n", 16]
        if "temperature" in row:
            flags += ["--temperature", row["temperature"]]
        if "top_k" in row:
            flags += ["--top-k", row["top_k"]]
        for stop in row.get("stop", []):
            flags += ["--stop", stop]
        job_row = by_id[row["id"]]
        if row.get("temperature") != 0:
            flags += ["--seed", job_row["seed"]]
        alone = generate_json(tiny_checkpoint, row["prompt"], *flags)
        for key in ("completion", "finish_reason", "prompt_tokens", "completion_tokens", "seed"):
            assert job_row[key] == alone[key], (row["id"], key)


def test_job_output_refuses_to_clobber(tiny_checkpoint, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("one\\ntwo\nthree\n")
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    result = cli("generate", "-c", tiny_checkpoint, "--input", source, "--output", out, "-n", 3)
    assert result.exit_code == 2 and "already exists" in result.stderr and out.read_text() == "precious\n"
    result = cli("generate", "-c", tiny_checkpoint, "--input", source, "--output", out, "-n", 3, "--overwrite")
    assert result.exit_code == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["id"], r["prompt"]) for r in written) == [(1, "one\ntwo"), (2, "three")]
    # To stdout: only JSONL on stdout.
    result = cli("generate", "-c", tiny_checkpoint, "--input", source, "-n", 3, "--greedy")
    assert result.exit_code == 0 and [json.loads(line)["id"] for line in result.stdout.splitlines()] in ([1, 2], [2, 1])


def test_a_killed_job_resumes_with_every_row_exactly_once(tiny_checkpoint, tmp_path):
    source = tmp_path / "prompts.txt"
    rows = 48
    source.write_text("".join(f"row {i}: Привет 🙂\n" for i in range(rows)))
    out, reference = tmp_path / "out.jsonl", tmp_path / "reference.jsonl"
    flags = ["-c", tiny_checkpoint, "--input", source, "-n", 12, "--seed", 0, "--ignore-eos"]

    job = subprocess.Popen([sys.executable, "-m", "lmcli", "generate", *map(str, flags), "--output", str(out),
                            "--batch-size", "1"], env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.02)
    job.send_signal(signal.SIGKILL)
    job.wait()
    done_before = out.read_bytes().count(b"\n")
    assert 3 <= done_before < rows, job.stderr.read().decode() if job.stderr else ""
    with open(out, "ab") as f:  # as if the kill had landed in the middle of a write
        f.write(b'{"id": 40, "prompt": "row 39: \xd0\x9f')

    result = cli("generate", *flags, "--output", out, "--resume")
    assert result.exit_code == 0, result.stderr
    assert f"{rows - done_before} rows written" in result.stderr and f"{done_before} already done" in result.stderr
    resumed = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in resumed) == list(range(1, rows + 1))

    result = cli("generate", *flags, "--output", reference, "--batch-size", 16)
    assert result.exit_code == 0
    fresh = {r["id"]: r for r in map(json.loads, reference.read_text().splitlines())}
    assert {r["id"]: r for r in resumed} == fresh


# ----------------------------------------------------------------------------- real pipes and terminals


def test_piped_output_is_exactly_the_completion(tiny_checkpoint):
    prompt, flags = "Привет 🙂", ["--seed", "5", "-n", "24", "--ignore-eos"]
    expected = generate_json(tiny_checkpoint, prompt, *flags)["completion"]
    result = run_lmcli("generate", "-c", str(tiny_checkpoint), *flags, "--stats", prompt)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode("utf-8") == expected + "\n"  # the completion, then one newline
    stderr = result.stderr.decode()
    assert re.fullmatch(r"24 tokens · [\d.]+ tokens/s · \d+ ms to first token · stopped: token limit · seed 5"
                        r" · max_new_tokens 24, temperature 0.8\ndecode step: eager\n"
                        r"prompt cache: not used \(only where reusing keys is exact: [^)]*\)\n", stderr)  # the settings used, the step
    assert b"\x1b" not in result.stdout + result.stderr


def test_terminal_shows_the_prompt_dimmed_then_the_stream_and_a_summary(tiny_checkpoint):
    from lmcli.console import visible_controls

    prompt, flags = "Hello", ["--seed", "2", "-n", "16", "--ignore-eos"]
    expected = generate_json(tiny_checkpoint, prompt, *flags)["completion"]
    env = subprocess_env(TERM="xterm-256color", COLUMNS="200", LINES="50")
    env.pop("NO_COLOR", None)
    primary, secondary = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "lmcli", "generate", "-c", str(tiny_checkpoint), *flags, prompt],
                               stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, env=env)
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the terminal's other side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    assert process.wait(timeout=60) == 0
    raw = b"".join(chunks).decode("utf-8", "replace")
    assert "\x1b[2mHello\x1b[0m" in raw  # the prompt, dimmed
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw).replace("\r", "")
    squeeze = lambda s: re.sub(r"\s", "", s)  # noqa: E731  (rich may expand tabs)
    assert squeeze("Hello" + visible_controls(expected)) in squeeze(plain)
    assert re.search(r"16 tokens · [\d.]+ tokens/s · .* stopped: token limit · seed 2", plain)


def test_bench_hands_its_options_to_lmcli_bench(monkeypatch):
    import types

    import lmcli.bench

    calls = []
    fake = types.ModuleType("lmcli.bench.main")
    fake.main = lambda **options: calls.append(options)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lmcli.bench.main", fake)
    monkeypatch.setattr(lmcli.bench, "main", fake, raising=False)  # `from lmcli.bench import main`
    result = cli("bench", "-n", 16, "--batch-size", 4, "--prompt-tokens", 64, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert calls == [dict(device="cpu", dtype="auto", max_new_tokens=16, batch_size=4, prompt_tokens=64)]
