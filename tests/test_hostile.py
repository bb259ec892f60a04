"""Hostile or broken input: each gives one line naming the file/field/flag, never an internal error."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_fixtures import subprocess_env, tiny_checkpoint  # noqa: F401 (fixture)
from test_memory import _PEAK  # the peak-RSS helper the memory bounds are measured with
from tiny import save_reference
from typer.testing import CliRunner

import lmcli
import lmcli.io.gguf as lmgguf
from lmcli.cli import app
from lmcli.errors import CheckpointError, ConfigError, TokenizerError


@pytest.fixture(scope="module")
def llama_template(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_reference("llama", directory)
    return directory


@pytest.fixture
def llama_dir(llama_template, tmp_path):
    return copy_files(llama_template, tmp_path)


def copy_files(source: Path, target: Path) -> Path:
    """`target` with a copy of each file of the checkpoint directory `source`, for a test to damage."""
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def edit_json(path: Path, change) -> Path:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return path


def edit_config(directory, change):
    return edit_json(directory / "config.json", change)


# --- config.json -------------------------------------------------------------------------------


def test_config_that_is_a_list_is_named(llama_dir):
    path = edit_config(llama_dir, lambda c: [c])
    with pytest.raises(ConfigError) as error:
        lmcli.load(llama_dir)
    assert str(error.value) == f"{path}: expected a JSON object, got a list"


@pytest.mark.parametrize(
    "value, why",
    [
        ("abc", "must be an integer"),
        (-576, "must be between 1 and"),
        (576.5, "must be an integer"),
        (True, "must be an integer"),
        (None, None),  # null: the field counts as missing
    ],
)
def test_hidden_size_of_the_wrong_type_or_range(llama_dir, value, why):
    path = edit_config(llama_dir, lambda c: {**c, "hidden_size": value})
    with pytest.raises(ConfigError) as error:
        lmcli.load(llama_dir)
    message = str(error.value)
    if why is None:
        assert message == f"{path}: missing field 'hidden_size'"
    else:
        assert message.startswith(f"{path}: field 'hidden_size' {why}") and json.dumps(value) in message


@pytest.mark.parametrize(
    "field, value",
    [
        ("rms_norm_eps", float("nan")),  # json.dumps writes NaN, which Python's json reads back
        ("rms_norm_eps", 0),
        ("num_key_value_heads", 0),
        ("tie_word_embeddings", "yes"),
        ("eos_token_id", [2, "x"]),
        ("layer_types", ["full_attention", "local"]),
        ("rope_scaling", {"rope_type": "linear", "factor": "2"}),
        ("rope_scaling", [1]),
        ("model_type", 7),
    ],
)
def test_other_fields_are_checked_by_type_and_range(llama_dir, field, value):
    path = edit_config(llama_dir, lambda c: {**c, field: value})
    with pytest.raises(ConfigError, match=rf"^{path}: field '{field}(\.\w+)?' (must|should)"):
        lmcli.load(llama_dir)


def test_heads_larger_than_hidden_size_is_a_config_error(llama_dir):
    edit_config(llama_dir, lambda c: {**c, "head_dim": None, "num_attention_heads": 64, "num_key_value_heads": 64})
    with pytest.raises(ConfigError, match=r"config\.json: head_dim is 0"):
        lmcli.load(llama_dir)


def test_valid_configs_still_load(llama_dir):
    edit_config(llama_dir, lambda c: {**c, "head_dim": None, "sliding_window": None, "unknown_field": [1, {}]})
    model, _ = lmcli.load(llama_dir)
    assert model.config.head_dim == 8


# --- safetensors index files --------------------------------------------------------------------


def make_sharded(directory, weight_map):
    (directory / "model.safetensors").rename(directory / "shard-1.safetensors")
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("shard", ["../../../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_cannot_name_files_outside_the_checkpoint(llama_dir, shard):
    index = make_sharded(llama_dir, {"model.norm.weight": shard})
    with pytest.raises(CheckpointError) as error:
        lmcli.load(llama_dir)
    assert str(error.value) == (
        f'{index}: shard "{shard}" of tensor "model.norm.weight" is outside the checkpoint directory'
    )


def test_index_cannot_follow_a_symlink_out_of_the_checkpoint(llama_dir, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside") / "secret.safetensors"
    (llama_dir / "model.safetensors").rename(outside)
    (llama_dir / "shard-1.safetensors").symlink_to(outside)
    index = llama_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "shard-1.safetensors"}}))
    with pytest.raises(CheckpointError, match="is outside the checkpoint directory"):
        lmcli.load(llama_dir)


@pytest.mark.parametrize("weight_map", [[], "shard-1.safetensors", None, {"model.norm.weight": 3}])
def test_index_weight_map_must_be_an_object_of_strings(llama_dir, weight_map):
    index = make_sharded(llama_dir, weight_map)
    with pytest.raises(CheckpointError, match=rf"^{index}: .*(weight_map).* must be"):
        lmcli.load(llama_dir)


def test_a_valid_index_loads(llama_dir):
    from safetensors.torch import load_file

    names = load_file(llama_dir / "model.safetensors")
    make_sharded(llama_dir, dict.fromkeys(names, "shard-1.safetensors"))
    model, _ = lmcli.load(llama_dir)
    assert model.num_parameters() > 0


# --- lmcli convert: all or nothing --------------------------------------------------------------

# A subprocess converts a stand-in GGUF checkpoint (the reader is replaced: what is tested is how the
# output directory is written) and, when told to, parks after writing model.safetensors so it can be killed.
CONVERT_SCRIPT = r"""
import sys, time
from pathlib import Path
import torch
import safetensors.torch
import lmcli.io.gguf as lmgguf
import lmcli.io.tokenizer as lmtokenizer

class StandInTokenizer:
    def save_pretrained(self, out_dir):
        (Path(out_dir) / "tokenizer.json").write_text("{}")

def read_stand_in(path, dtype=torch.float32):
    return lmgguf.GGUFCheckpoint(path=Path(path), metadata={}, hf_config={"model_type": "llama"},
                                 tensors={"w": torch.arange(4096, dtype=torch.float32)})

lmgguf.read_gguf = read_stand_in
lmtokenizer.tokenizer_from_gguf = lambda metadata: StandInTokenizer()
real_save = safetensors.torch.save_file
def save_then_park(tensors, filename, metadata=None):
    real_save(tensors, filename, metadata=metadata)
    if len(sys.argv) > 3:
        Path(sys.argv[3]).write_text("written")
        time.sleep(600)
safetensors.torch.save_file = save_then_park
lmgguf.convert_gguf(sys.argv[1], sys.argv[2])
"""


def run_convert(tmp_path, out, park: Path | None = None):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"stand-in")
    args = [sys.executable, "-c", CONVERT_SCRIPT, str(source), str(out)] + ([str(park)] if park else [])
    return subprocess.Popen(args, env=subprocess_env(), stderr=subprocess.PIPE)


def test_convert_killed_midway_leaves_no_output_and_a_rerun_works(tmp_path):
    out = tmp_path / "converted"
    park = tmp_path / "parked"
    process = run_convert(tmp_path, out, park)
    deadline = time.monotonic() + 120
    while not park.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert park.exists(), process.stderr.read().decode() if process.poll() is not None else "never parked"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not out.exists()
    [partial] = [p for p in tmp_path.iterdir() if p.name.startswith(".converted.partial-")]
    assert (partial / "model.safetensors").is_file()  # killed after the big write, before the rename

    rerun = run_convert(tmp_path, out)
    assert rerun.wait(timeout=120) == 0, rerun.stderr.read().decode()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]  # the killed run's leftovers are gone
    # The same permissions a plain mkdir / open would give under this umask.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "f").write_text("")
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    assert stat.S_IMODE((out / "config.json").stat().st_mode) == stat.S_IMODE((plain / "f").stat().st_mode)


def test_convert_that_fails_cleans_up(tmp_path, monkeypatch):
    checkpoint = lmgguf.GGUFCheckpoint(path=tmp_path / "x.gguf", metadata={}, hf_config={"model_type": "llama"},
                                       tensors={"w": torch.zeros(3)})
    monkeypatch.setattr(lmgguf, "read_gguf", lambda path, dtype=None: checkpoint)
    monkeypatch.setattr("lmcli.io.tokenizer.tokenizer_from_gguf", lambda metadata: _failing_save())
    out = tmp_path / "out"
    with pytest.raises(TokenizerError):
        lmgguf.convert_gguf(tmp_path / "x.gguf", out)
    assert list(tmp_path.iterdir()) == []


def _failing_save():
    class Tokenizer:
        def save_pretrained(self, out_dir):
            raise TokenizerError("cannot save the tokenizer")

    return Tokenizer()


# --- the command line: input bytes and output streams -------------------------------------------


def cli_generate(checkpoint, *args, input=None):
    return CliRunner().invoke(app, ["generate", "-c", str(checkpoint), "--format", "jsonl", "--greedy", "-n", "3",
                                    *map(str, args)], input=input)


@pytest.mark.parametrize("where", ["stdin", "argv"])
def test_invalid_utf8_prompt_is_replaced_with_a_warning(tiny_checkpoint, where):
    raw = "Привет".encode() + b"\xff\xfe x"
    if where == "stdin":
        result = cli_generate(tiny_checkpoint, "-", input=raw)
    else:
        result = cli_generate(tiny_checkpoint, os.fsdecode(raw))  # how Python hands undecodable argv bytes over
    assert result.exit_code == 0, result.stderr
    what = "the prompt on stdin" if where == "stdin" else "the PROMPT argument"
    assert result.stderr.splitlines()[0] == (
        f"warning: {what} is not valid UTF-8 (first bad byte at offset 12); invalid bytes were replaced with U+FFFD"
    )
    assert json.loads(result.stdout)["prompt"] == "Привет\ufffd\ufffd x"


def run_piped(checkpoint, *args, stdout):
    return subprocess.run([sys.executable, "-m", "lmcli", "generate", "-c", str(checkpoint), *map(str, args)],
                          stdout=stdout, stderr=subprocess.PIPE, timeout=300, env=subprocess_env())


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_stdout_that_cannot_be_written_is_one_line_and_exit_1(tiny_checkpoint):
    with open("/dev/full", "w") as full:
        result = run_piped(tiny_checkpoint, "--greedy", "-n", 3, "hello", stdout=full)
    assert result.returncode == 1
    assert result.stderr.decode() == "error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("batch", [False, True])
def test_a_closed_pipe_ends_quietly_with_exit_0(tiny_checkpoint, tmp_path, batch):
    """`lmcli generate ... | head -c 1`: the documented behaviour is exit 0 and nothing on stderr."""
    args = ["--greedy", "--ignore-eos", "-n", 64]
    if batch:
        source = tmp_path / "in.txt"
        source.write_text("one\ntwo\nthree\nfour\n")
        args += ["--input", source, "--batch-size", 1]
    else:
        args += ["hello"]
    job = subprocess.Popen([sys.executable, "-m", "lmcli", "generate", "-c", str(tiny_checkpoint), *map(str, args)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())
    assert job.stdout is not None and job.stderr is not None
    assert job.stdout.read(1)  # the first output arrived; now the reader goes away
    job.stdout.close()
    stderr = job.stderr.read().decode()
    assert job.wait(timeout=300) == 0 and stderr == ""


# --- chat templates: code from a stranger, bounded ----------------------------------------------

HOSTILE_TEMPLATES = {
    "{{ 'a' * 10000000000 }}": "a repeated string or list would hold 10,000,000,000 items",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}":
        "a joined string would hold 1,048,576 items",
    "{{ 'a'|center(10000000000) }}": "center's result would hold 10,000,000,000 items",
    "{{ '{:>10000000000}'.format(1) }}": "a format width or precision over 1,000,000",
    "{{ '%10000000000s' % 'a' }}": "a format width or precision over 1,000,000",
    "{{ 7 ** 100000000 }}": "a power over 4096 bits",
    "{% for i in range(100000) %}{{ 'x' * 999999 }}{% endfor %}":
        "the rendered prompt is longer than 1,000,000 characters",
}


@pytest.fixture
def template_dir(tiny_checkpoint, tmp_path):
    return copy_files(tiny_checkpoint, tmp_path)


def with_template(directory, template):
    edit_json(directory / "tokenizer_config.json", lambda config: {**config, "chat_template": template})


def failed_render(directory, template) -> tuple[str, int]:
    """(the one-line error, peak traced bytes) of rendering a chat with `template`, which must fail."""
    import tracemalloc

    from lmcli.io.tokenizer import load_tokenizer

    with_template(directory, template)
    tokenizer = load_tokenizer(directory)
    assert tokenizer is not None
    tracemalloc.start()
    try:
        with pytest.raises(TokenizerError) as error:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return str(error.value), peak


@pytest.mark.parametrize("template", list(HOSTILE_TEMPLATES))
def test_hostile_chat_templates_fail_in_one_line_before_using_memory(template_dir, template):
    message, peak = failed_render(template_dir, template)
    assert message == f"{template_dir}: chat template failed: {HOSTILE_TEMPLATES[template]}" + (
        " (the limit is 1,000,000)" if "would hold" in HOSTILE_TEMPLATES[template] else "")
    assert peak < 64 * 2**20  # refused before the string was built


def test_a_template_that_runs_forever_is_stopped(template_dir, monkeypatch):
    from lmcli.io.tokenizer import chat_template, load_tokenizer

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.5)
    with_template(template_dir, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    with pytest.raises(TokenizerError, match=r"chat template failed: rendering took longer than 0.5 s$"):
        tokenizer = load_tokenizer(template_dir)
        assert tokenizer is not None
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_cli_names_the_checkpoint_and_exits_1(template_dir):
    with_template(template_dir, "{{ 'a' * 10000000000 }}")
    result = cli_generate(template_dir, "--chat", "hi")
    assert result.exit_code == 1
    assert result.stderr == (f"error: {template_dir}: chat template failed: a repeated string or list would hold "
                             "10,000,000,000 items (the limit is 1,000,000)\n")


def test_ordinary_template_operations_still_work(template_dir):
    from lmcli.io.tokenizer import load_tokenizer

    with_template(template_dir, "{{ 'ab' * 3 }}|{{ [1] + [2] }}|{{ 'x' ~ 'y' }}|{{ '%s-%d' % ('a', 2) }}|"
                                "{{ '{}!'.format('hi') }}|{{ 2 ** 10 }}|{{ 'a'|center(5) }}|{{ ['p', 'q']|join(',') }}|"
                                "{{ messages[0]['content'] | replace('h', 'H') }}")
    tokenizer = load_tokenizer(template_dir)
    assert tokenizer is not None
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "ababab|[1, 2]|xy|a-2|hi!|1024|  a  |p,q|Hi"


# --- flag values: usage errors before any model loads ---------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number, got inf"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "nan"], "--top-p must be a finite number, got nan"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--repetition-penalty", "inf"], "--repetition-penalty must be a finite number, got inf"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--top-k", "0"], "--top-k must be at least 1"),
    (["-n", "0"], "--max-new-tokens must be at least 1"),
    (["--seed", "-1"], "--seed must be between 0 and 2**64-1"),
    (["--stop", ""], "--stop must not be an empty string"),
    (["--temperature", "abc"], "Invalid value for '--temperature'"),
])
def test_invalid_flag_values_are_usage_errors_before_loading(tmp_path, flags, message):
    # An empty directory: loading it would fail with exit 1, so exit 2 shows the flags were checked first.
    result = CliRunner().invoke(app, ["generate", "-c", str(tmp_path), *flags, "hi"])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"error: {message}") and result.stderr.count("\n") == 1


def test_a_job_row_with_nan_temperature_is_that_rows_error(tmp_path):
    from lmcli.jobs.runner import read_rows
    from lmcli.settings.generation_settings import GenerationSettings

    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a", "temperature": NaN}\n{"prompt": "b", "top_p": Infinity}\n')
    bad = [row.error for row in read_rows(source, GenerationSettings())]
    assert bad == ['line 1: "temperature" must be a finite number, got nan',
                   'line 2: "top_p" must be a finite number, got inf']


# --- GGUF metadata of the wrong type --------------------------------------------------------------


@pytest.mark.parametrize("key, write, expected", [
    ("llama.block_count", lambda w, k: w.add_string(k, "two"), "must be a non-negative integer (or one per layer), got str"),
    ("llama.embedding_length", lambda w, k: w.add_float32(k, 32.5), "must be a non-negative integer (or one per layer), got float"),
    ("llama.attention.layer_norm_rms_epsilon", lambda w, k: w.add_string(k, "1e-5"), "must be a number, got str"),
    ("tokenizer.ggml.bos_token_id", lambda w, k: w.add_bool(k, True), "must be a non-negative integer (or one per layer), got bool"),
    ("tokenizer.ggml.tokens", lambda w, k: w.add_array(k, [1, 2]), "must be an array of strings, got an array of 2"),
    ("general.name", lambda w, k: w.add_uint32(k, 7), "must be a string, got int"),
])
def test_gguf_metadata_of_the_wrong_type_names_the_key(tmp_path, key, write, expected):
    import gguf

    from lmcli.errors import GGUFError
    from lmcli.io.gguf_reader import read_gguf_header

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    write(writer, key)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError) as error:
        read_gguf_header(path)
    assert str(error.value) == f"{path}: metadata '{key}' {expected}"


# --- a prompt longer than the context --------------------------------------------------------------


def test_a_prompt_longer_than_the_context_is_cut_once_with_a_warning(tiny_checkpoint):
    """The tiny model's context is 512 tokens; the CLI's output equals model.generate on the prompt's last
    512 - 16 tokens (room for -n 16), computed directly."""
    import torch

    from lmcli.io.tokenizer import load_tokenizer

    prompt = "The quick brown fox jumps over the lazy dog. " * 80
    tokenizer = load_tokenizer(tiny_checkpoint)
    assert tokenizer is not None
    ids = tokenizer.encode(prompt)
    assert len(ids) > 512
    result = cli_generate(tiny_checkpoint, "--ignore-eos", "-n", 16, "--logprobs", 0, prompt)
    assert result.exit_code == 0, result.stderr
    dropped = len(ids) - (512 - 16)
    assert result.stderr == (f"warning: the prompt has {len(ids)} tokens but the context holds 512; its first "
                             f"{dropped} tokens were dropped (use --no-truncate to refuse instead)\n")
    row = json.loads(result.stdout)
    assert row["prompt_tokens"] == 512 - 16
    model, _ = lmcli.load(tiny_checkpoint)
    kept = torch.tensor([ids[dropped:]])
    expected = model.generate(kept, 16, do_sample=False)[0, kept.shape[1]:].tolist()
    assert [step["id"] for step in row["logprobs"]] == expected


def test_no_truncate_refuses_a_prompt_longer_than_the_context(tiny_checkpoint, tmp_path):
    prompt = "The quick brown fox jumps over the lazy dog. " * 80
    result = cli_generate(tiny_checkpoint, "--no-truncate", prompt)
    assert result.exit_code == 2
    assert re.fullmatch(r"error: the prompt has \d+ tokens but the model's context holds 512 \(drop --no-truncate "
                        r"to keep its end\)\n", result.stderr)
    source = tmp_path / "in.txt"
    source.write_text(f"short\n{prompt}\n")
    result = CliRunner().invoke(app, ["generate", "-c", str(tiny_checkpoint), "--input", str(source), "--greedy",
                                      "-n", "2", "--no-truncate"])
    assert result.exit_code == 1  # the job goes on; the long row is that row's error
    rows = {row["id"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert "error" not in rows[1] and "the model's context holds 512" in rows[2]["error"]


# --- round two: files and transcripts that used to reach an internal error ---------------------------


def one_error_line(result, code: int) -> str:
    """The single stderr line of a failed command, checked: its exit code, no traceback, no internal error."""
    stderr = result.stderr if isinstance(result.stderr, str) else result.stderr.decode()
    assert (result.exit_code if hasattr(result, "exit_code") else result.returncode) == code, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: "), stderr
    assert "internal error" not in stderr and "Traceback" not in stderr
    return stderr.removeprefix("error: ").rstrip("\n")


def write_gguf(path: Path, fill) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_merges_that_are_not_token_pairs_are_named(tmp_path):
    import numpy as np

    def fill(writer):
        for key, value in (("context_length", 64), ("embedding_length", 32), ("feed_forward_length", 48),
                           ("block_count", 1), ("attention.head_count", 4), ("attention.head_count_kv", 2)):
            writer.add_uint32(f"llama.{key}", value)
        writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        writer.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float32))
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b", "ab"])
        writer.add_token_merges(["a b", "ab"])

    path = write_gguf(tmp_path / "merges.gguf", fill)
    result = CliRunner().invoke(app, ["convert", str(path), str(tmp_path / "out")])
    assert one_error_line(result, 1) == (f"{path}: metadata 'tokenizer.ggml.merges' item 1 must be two tokens "
                                         "separated by one space, got 'ab'")


def test_gguf_merges_of_unknown_tokens_are_named():
    from lmcli.io.tokenizer import tokenizer_from_gguf

    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["x y"]}
    with pytest.raises(TokenizerError, match=r"^cannot build a tokenizer from tokenizer.ggml.tokens/merges "
                                             r"\(.*Token `x` out of vocabulary\)$"):
        tokenizer_from_gguf(metadata)


@pytest.mark.parametrize("file, content, message", [
    ("tokenizer_config.json", "[1]", "{path}: expected a JSON object, got a list"),
    ("generation_config.json", '"x"', "{path}: not a JSON object"),  # read first for the model's defaults
    ("special_tokens_map.json", "[]", "{path}: expected a JSON object, got a list"),
    ("tokenizer_config.json", '{"added_tokens_decoder": {"5": {"content": 5}}}',
     '{path}: added_tokens_decoder entry "5" must be an object with a string "content"'),
    ("tokenizer_config.json", '{"added_tokens_decoder": {"5": {"x": 1}}}',
     '{path}: added_tokens_decoder entry "5" must be an object with a string "content"'),
    ("tokenizer_config.json", '{"added_tokens_decoder": {"x": {"content": "q"}}}',
     '{path}: added_tokens_decoder entry "x": the key must be a token id'),
    ("tokenizer_config.json", '{"added_tokens_decoder": {"5": {"content": "q", "lstrip": "no"}}}',
     "{path}: added_tokens_decoder entry \"5\": 'lstrip' must be true or false"),
    ("tokenizer_config.json", '{"added_tokens_decoder": [1]}',
     "{path}: field 'added_tokens_decoder' must be an object, got a list"),
    ("tokenizer_config.json", '{"bos_token": {"content": 3}}',
     "{path}: field 'bos_token' must be a string or {{\"content\": string}}"),
    ("tokenizer_config.json", '{"chat_template": [{"name": [1], "template": "x"}]}',
     "{path}: field 'chat_template' must be a string or a list of {{\"name\": string, \"template\": string}}"),
    ("tokenizer_config.json", '{"chat_template": 7}', "{path}: field 'chat_template' must be a string, got a number"),
    ("generation_config.json", '{"eos_token_id": "x"}',
     "{path}: field 'eos_token_id' must be a token id or a list of them"),
    ("chat_template.jinja", b"{{ 1 }}\xff", "{path}: not valid UTF-8 (first bad byte at offset 7)"),
])
def test_malformed_tokenizer_files_are_named(template_dir, file, content, message):
    path = template_dir / file
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = cli_generate(template_dir, "--chat", "hi")
    assert one_error_line(result, 1) == message.format(path=path)


def test_a_tokenizer_file_over_the_bound_is_refused_before_it_is_read(template_dir):
    """A sparse 1 GiB tokenizer.json: refused by its size, in a subprocess whose peak memory shows it was
    never read (the bound is far below the file)."""
    from lmcli.io.bounded import MAX_TOKENIZER_FILE

    path = template_dir / "tokenizer.json"
    with open(path, "r+b") as file:
        file.truncate(2**30)
    assert path.stat().st_size > MAX_TOKENIZER_FILE
    script = _PEAK + f"""
import lmcli
from lmcli.errors import TokenizerError
try:
    lmcli.load({str(template_dir)!r})
except TokenizerError as e:
    print(e)
print(peak_rss_bytes())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                            timeout=300)
    message, peak = result.stdout.splitlines()[-2:]
    assert message == f"{path}: the file is 1,024 MiB, more than the {MAX_TOKENIZER_FILE // 2**20} MiB lmcli reads"
    assert int(peak) < 2**30 / 2  # the 1 GiB file was never read into memory




def test_a_transcript_whose_model_is_not_an_object_is_named(tiny_checkpoint, tmp_path):
    transcript = tmp_path / "t.json"
    transcript.write_text(json.dumps({"format": "lmcli-chat/1", "messages": [], "model": "smollm2"}))
    result = CliRunner().invoke(app, ["chat", "-c", str(tiny_checkpoint), "--resume", str(transcript)], input="hi\n")
    assert one_error_line(result, 1) == f'{transcript}: "model" must be an object'


@pytest.mark.parametrize("temperature", ["1e-45", "1e-30"])
def test_the_smallest_temperatures_sample_as_greedy_decoding_does(tiny_checkpoint, temperature):
    """1e-45 used to overflow logits / temperature and draw an index past the vocabulary."""
    args = ["generate", "-c", str(tiny_checkpoint), "--format", "jsonl", "-n", "8", "--ignore-eos", "hi"]
    sampled = CliRunner().invoke(app, [*args, "--temperature", temperature, "--seed", "3"])
    greedy = CliRunner().invoke(app, [*args, "--greedy"])
    assert sampled.exit_code == 0 and greedy.exit_code == 0, sampled.stderr + greedy.stderr
    assert json.loads(sampled.stdout)["completion"] == json.loads(greedy.stdout)["completion"]


def _with_file_size_limit(limit: int):
    import resource

    def apply():  # writes past `limit` bytes fail with EFBIG, as a full disk fails them (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_an_output_that_cannot_be_written_is_named(tiny_checkpoint, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("one\ntwo\n")
    out = tmp_path / "out.jsonl"
    result = subprocess.run([sys.executable, "-m", "lmcli", "generate", "-c", str(tiny_checkpoint), "--input",
                             str(source), "--output", str(out), "--greedy", "-n", "4"],
                            capture_output=True, env=subprocess_env(), timeout=300,
                            preexec_fn=_with_file_size_limit(64))
    assert one_error_line(result, 1) == f"cannot write {out}: File too large"


# --- round two: memory a hostile file could make us use -------------------------------------------


@pytest.fixture(scope="module")
def dev_zero():
    if not os.path.exists("/dev/zero"):
        pytest.skip("needs /dev/zero")  # not Linux
    return Path("/dev/zero")


def test_an_endless_input_line_is_refused_within_the_bound(dev_zero, tmp_path, monkeypatch):
    import tracemalloc

    from lmcli.io import bounded
    from lmcli.jobs.runner import read_rows
    from lmcli.settings.generation_settings import GenerationSettings

    monkeypatch.setattr(bounded, "MAX_INPUT_LINE", 4 * 2**20)  # the same rule, at a test's size
    tracemalloc.start()
    try:
        with pytest.raises(lmcli.errors.LmcliError) as error:
            read_rows(dev_zero, GenerationSettings())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(error.value) == "input /dev/zero, line 1: longer than 4 MiB"
    assert peak < 3 * 4 * 2**20


def test_the_cli_refuses_dev_zero_as_input_and_as_a_transcript(dev_zero, tiny_checkpoint):
    from lmcli.io.bounded import MAX_INPUT_LINE, MAX_TRANSCRIPT

    result = CliRunner().invoke(app, ["generate", "-c", str(tiny_checkpoint), "--input", "/dev/zero"])
    assert one_error_line(result, 1) == f"input /dev/zero, line 1: longer than {MAX_INPUT_LINE // 2**20} MiB"
    result = CliRunner().invoke(app, ["chat", "-c", str(tiny_checkpoint), "--resume", "/dev/zero"], input="hi\n")
    assert one_error_line(result, 1) == f"/dev/zero: more than the {MAX_TRANSCRIPT // 2**20} MiB lmcli reads"


def test_gguf_tensors_that_share_bytes_are_refused_and_memory_stays_bounded(tmp_path):
    """Every layer's tensors pointed at one region: the header is refused, and loading it in a fresh
    process peaks far below what the 150 layers it describes would take."""
    import numpy as np

    from lmcli.errors import GGUFError
    from lmcli.io.gguf_reader import read_gguf_header

    def fill(writer):
        for key, value in (("context_length", 64), ("embedding_length", 512), ("feed_forward_length", 512),
                           ("block_count", 150), ("attention.head_count", 8), ("attention.head_count_kv", 8)):
            writer.add_uint32(f"llama.{key}", value)
        writer.add_tensor("token_embd.weight", np.zeros((64, 512), dtype=np.float32))
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((512, 512), dtype=np.float32))

    path = write_gguf(tmp_path / "alias.gguf", fill)
    data = bytearray(path.read_bytes())
    # Rewrite the second tensor's table entry so that it starts inside the first one's data.
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8 + 4  # n_dims, two dims, type: then its offset
    data[at:at + 8] = (32).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError) as error:
        read_gguf_header(path)
    found = re.fullmatch(rf"{re.escape(str(path))}: tensor 'blk.0.attn_q.weight' data \(bytes (\d+)\.\.(\d+)\) "
                         r"overlaps tensor 'token_embd.weight' \(bytes (\d+)\.\.(\d+)\)", str(error.value))
    assert found, str(error.value)
    q_start, q_end, embed_start, embed_end = map(int, found.groups())
    assert (q_start - embed_start, q_end - q_start, embed_end - embed_start) == (32, 512 * 512 * 4, 64 * 512 * 4)
    script = _PEAK + f"""
import torch, lmcli, lmcli.loading, lmcli.io.gguf, lmcli.io.tokenizer
# what loading imports before it reads a header: code, not the file's cost
import lmcli.resolve.default_model, lmcli.io.fingerprint, lmcli.models.base, lmcli.kernels.plan, lmcli.threads
from lmcli.errors import LmcliError
print(peak_rss_bytes())
try:
    lmcli.load({str(path)!r})
except LmcliError as e:
    print(str(e).split(": ", 1)[1])
print(peak_rss_bytes())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                            timeout=300)
    imported, message, peak = result.stdout.splitlines()[-3:]
    assert message.startswith("tensor 'blk.0.attn_q.weight' data"), result.stderr[-2000:]
    # The bound of tests/test_memory.py: the imports' own footprint plus 1.5 x the file.
    assert int(peak) <= int(imported) + 1.5 * path.stat().st_size



_HUGE_LIST = "{% set l = ['x' * 999999] * 999999 %}"  # a million references to one string: 8 MB, text 10^12
_DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = EXPR %}{% endfor %}{{ ns.s }}"
_A_BLOCK = "{% for i in range(100000) %}{{ 'x' * 999999 }}{% endfor %}"
_BUILT_STRINGS = {
    _DOUBLING.replace("EXPR", "'%s%s' % (ns.s, ns.s)"): "a formatted string would hold over 1,000,000 characters",
    _DOUBLING.replace("EXPR", "'%(a)s%(a)s' % {'a': ns.s}"): "a formatted string would hold over 1,000,000 characters",
    _DOUBLING.replace("EXPR", "'{}{}'.format(ns.s, ns.s)"): "a formatted string would hold over 1,000,000 characters",
    _DOUBLING.replace("EXPR", "[ns.s, ns.s]|join"): "join's result would hold 1,048,576 items",
    _DOUBLING.replace("EXPR", "ns.s|replace('a', 'aa')"): "replace's result would hold 1,048,577 items",
    _HUGE_LIST + "{{ l }}": "a value shown as text would hold 1,000,005 items",
    _HUGE_LIST + "{{ l|string }}": "string's input would hold 1,000,005 items",
    _HUGE_LIST + "{{ l|tojson }}": "tojson's input would hold 1,000,005 items",
    _HUGE_LIST + "{{ l|pprint }}": "pprint's input would hold 1,000,005 items",
    _HUGE_LIST + "{{ '%s' % (l,) }}": "a formatted string would hold over 1,000,000 characters",
    _HUGE_LIST + "{{ '{}'.format(l) }}": "a formatted string would hold over 1,000,000 characters",
    _HUGE_LIST + "{{ ','.join(l) }}": "str.join's result would hold 1,999,998 items",
    _HUGE_LIST + "{{ l ~ '' }}": "a joined string would hold 1,000,005 items",
    _HUGE_LIST + "{{ [l, l]|sum(start=[]) }}": "sum's result would hold 1,999,998 items",
    _HUGE_LIST + "{% set x = l|batch(1000000000, 'y')|list %}": "batch's rows would hold 1,000,000,000 items",
    "{% set b %}" + _A_BLOCK + "{% endset %}": "a block's text would hold 1,999,998 items",
    "{% macro m() %}" + _A_BLOCK + "{% endmacro %}{% set r = m() %}": "a block's text would hold 1,999,998 items",
    "{% filter upper %}" + _A_BLOCK + "{% endfilter %}": "a block's text would hold 1,999,998 items",
    "{{ ('\t' * 999999).expandtabs(999999) }}": "str.expandtabs's result would hold 999,999,000,000 items",
    "{{ lipsum(n=1000000000) }}": "lipsum's result would hold 1,600,000,000,000 items",
    "{{ '%*s' % (1000000000, 'a') }}": "a formatted string would hold over 1,000,000 characters",
    "{{ ('x' * 999999).encode() * 1000000 }}": "a repeated string or list would hold 999,999,000,000 items",
    "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}":
        "a product over 4096 bits",
}


@pytest.mark.parametrize("template", list(_BUILT_STRINGS))
def test_every_way_of_building_a_string_is_bounded_before_it_is_built(template_dir, template):
    """Peak traced memory stays near the 8 MB a million-reference list costs; the text each would build
    is 10^6 to 10^12 characters."""
    message, peak = failed_render(template_dir, template)
    expected = _BUILT_STRINGS[template] + (" (the limit is 1,000,000)" if "would hold" in _BUILT_STRINGS[template]
                                           and "over" not in _BUILT_STRINGS[template] else "")
    assert message == f"{template_dir}: chat template failed: {expected}"
    assert peak < 64 * 2**20


@pytest.mark.parametrize("size, fits", [(1_000_000, True), (1_000_001, False)])
def test_the_rendered_prompt_limit_holds_exactly(template_dir, size, fits):
    from lmcli.io.tokenizer import load_tokenizer

    with_template(template_dir, "{% for i in range(4) %}{{ 'x' * N }}{% endfor %}{{ 'y' * R }}"
                  .replace("N", str(size // 4)).replace("R", str(size % 4)))
    tokenizer = load_tokenizer(template_dir)
    assert tokenizer is not None
    if fits:
        assert len(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])) == size
    else:
        with pytest.raises(TokenizerError, match=r"the rendered prompt is longer than 1,000,000 characters$"):
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_ordinary_text_building_still_works(template_dir):
    from lmcli.io.tokenizer import load_tokenizer

    with_template(template_dir, "{{ '%s=%d' % ('a', 2000000) }}|{{ '{}-{}'.format(10**7, 'b') }}|{{ [1, 'x'] }}|"
                                "{{ messages|map(attribute='content')|join('+') }}|{{ messages|tojson }}|"
                                "{% set b %}{{ 'in' }}{% endset %}{{ b|upper }}|{{ 3 * 4 }}|{{ 'a\tb'.expandtabs(2) }}|"
                                "{% macro m(x) %}<{{ x }}>{% endmacro %}{{ m('y') }}")
    tokenizer = load_tokenizer(template_dir)
    assert tokenizer is not None
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == ('a=2000000|10000000-b|[1, \'x\']|hi|[{"role": "user", "content": "hi"}]|IN|12|a b|<y>')


# --- round two: two writers on one output ----------------------------------------------------------

HOLD_LOCK = """
import sys, time
from pathlib import Path
from lmcli.io.output_lock import output_lock
with output_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_writer_is_refused_and_told_which_process_holds_the_output(tiny_checkpoint, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("one\ntwo\n")
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE,
                              env=subprocess_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        second = subprocess.run([sys.executable, "-m", "lmcli", "generate", "-c", str(tiny_checkpoint), "--input",
                                 str(source), "--output", str(out), "--greedy", "-n", "2"],
                                capture_output=True, env=subprocess_env(), timeout=300)
        assert one_error_line(second, 1) == (f"{out} is being written by another lmcli job (pid {holder.pid}); "
                                             "wait for it to finish, or stop it")
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder was killed: its lock went with it, and the next job runs.
    third = subprocess.run([sys.executable, "-m", "lmcli", "generate", "-c", str(tiny_checkpoint), "--input",
                            str(source), "--output", str(out), "--greedy", "-n", "2"],
                           capture_output=True, env=subprocess_env(), timeout=300)
    assert third.returncode == 0, third.stderr.decode()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1, 2]


@pytest.mark.full  # two model loads at once: ~25 s on the shared machine
def test_two_jobs_resuming_one_output_at_once_write_each_row_once(tiny_checkpoint, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("".join(f"prompt {i}\n" for i in range(6)))
    out = tmp_path / "out.jsonl"
    out.write_text("")
    command = [sys.executable, "-m", "lmcli", "generate", "-c", str(tiny_checkpoint), "--input", str(source),
               "--output", str(out), "--greedy", "-n", "4", "--resume"]
    jobs = [subprocess.Popen(command, stderr=subprocess.PIPE, env=subprocess_env()) for _ in range(2)]
    results = [(job.wait(timeout=300), job.stderr.read().decode()) for job in jobs if job.stderr is not None]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == [1, 2, 3, 4, 5, 6]  # each row once, whichever way the two met
    for code, stderr in results:
        # Either it ran (alone, or after the other finished) or it was refused naming the other's pid.
        assert code == 0 or re.fullmatch(rf"error: {re.escape(str(out))} is being written by another lmcli job "
                                         r"\(pid \d+\); wait for it to finish, or stop it\n", stderr), stderr
