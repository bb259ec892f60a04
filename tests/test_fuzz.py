"""Property-based fuzzing of every reader of untrusted input: any mutated input gives lmcli's own error
(an LmcliError with a one-line message) or a valid result; never another exception, a hang or unbounded
memory.

Small example counts keep this in the normal suite; LMCLI_FUZZ=large runs a larger profile
(`LMCLI_FUZZ=large python -m pytest tests/test_fuzz.py`). Each example runs under a wall-clock guard
(a hang fails it; a slow machine only makes it slower, there is no deadline on speed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcli import registry
from lmcli.errors import LmcliError

LARGE = os.environ.get("LMCLI_FUZZ", "").lower() == "large"
settings.register_profile(
    "lmcli-fuzz", max_examples=2000 if LARGE else 25, deadline=None, derandomize=not LARGE, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
fuzz = settings.get_profile("lmcli-fuzz")
HANG_SECONDS = 20  # far above any real example: only a hang or a runaway reaches it


@contextlib.contextmanager
def bounded_time(seconds: int = HANG_SECONDS):
    def hang(signum, frame):
        raise AssertionError(f"an example ran for more than {seconds} s (a hang?)")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def only_lmcli_errors(call):
    """Run `call`; an LmcliError must carry a one-line message. Anything else propagates (a bug)."""
    with bounded_time():
        try:
            return call()
        except LmcliError as error:
            message = str(error)
            assert message and "\n" not in message, repr(message)
            return error


# JSON values of every kind, small.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def mutate(data: bytes, edits) -> bytes:
    """Apply (position, replacement) edits and an optional truncation to `data`."""
    raw = bytearray(data)
    for where, replacement in edits[0]:
        at = where % max(len(raw), 1)
        raw[at : at + len(replacement)] = replacement
    if edits[1] is not None:
        raw = raw[: edits[1] % (len(raw) + 1)]
    return bytes(raw)


byte_edits = st.tuples(
    st.lists(st.tuples(st.integers(0, 2**16), st.binary(min_size=1, max_size=8)), max_size=4),
    st.none() | st.integers(0, 2**16),
)


# --- safetensors files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def safetensors_bytes(tmp_path_factory) -> bytes:
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}, path)
    return path.read_bytes()


def read_safetensors_bytes(directory: Path, data: bytes):
    from lmcli.io.checkpoint import read_safetensors

    path = directory / "model.safetensors"
    path.write_bytes(data)
    return only_lmcli_errors(lambda: read_safetensors([path], torch.float32))


@fuzz
@given(edits=byte_edits)
def test_safetensors_byte_mutations(tmp_path, safetensors_bytes, edits):
    read_safetensors_bytes(tmp_path, mutate(safetensors_bytes, edits))


@fuzz
@given(header=st.dictionaries(st.text(max_size=6), json_values, max_size=4),
       size_delta=st.integers(-64, 2**40))
def test_safetensors_headers(tmp_path, safetensors_bytes, header, size_delta):
    """A JSON header of anything, with a length field that may lie (up to a terabyte too long)."""
    body = json.dumps(header).encode()
    length = max(0, len(body) + size_delta)
    read_safetensors_bytes(tmp_path, struct.pack("<Q", length) + body + safetensors_bytes[-48:])


@fuzz
@given(dtype=st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X"]),
       shape=st.lists(st.integers(-2, 2**40), max_size=4), start=st.integers(-4, 2**40), end=st.integers(-4, 2**40))
def test_safetensors_tensor_entries(tmp_path, dtype, shape, start, end):
    """Tensor entries whose shape and offsets disagree with each other and with the file."""
    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}}).encode()
    read_safetensors_bytes(tmp_path, struct.pack("<Q", len(header)) + header + bytes(64))


# --- config.json and index files -------------------------------------------------------------------------

def preset_config(name: str) -> dict[str, Any]:
    config = registry.preset_config(name)
    assert config is not None  # a listed preset has its config
    return config


PRESET_FIELDS = sorted({name for preset in registry.list_presets() for name in preset_config(preset)})


@fuzz
@given(preset=st.sampled_from(registry.list_presets()),
       changes=st.dictionaries(st.sampled_from(PRESET_FIELDS), json_values, max_size=3))
def test_config_fields_of_any_value(preset, changes):
    """A real config with some fields replaced by any JSON: a ModelConfig or a ConfigError."""
    hf = {**preset_config(preset), **changes}
    only_lmcli_errors(lambda: registry.config_from_hf(hf, source="config.json"))


@fuzz
@given(document=json_values)
def test_config_of_any_shape(document):
    only_lmcli_errors(lambda: registry.config_from_hf(document, source="config.json"))


@fuzz
@given(document=json_values | st.fixed_dictionaries({"weight_map": json_values}),
       raw=st.none() | st.binary(max_size=40))
def test_index_files(tmp_path, document, raw):
    from lmcli.io.checkpoint import safetensors_files

    directory = tmp_path / "ckpt"
    directory.mkdir(exist_ok=True)
    (directory / "shard.safetensors").write_bytes(b"")
    (directory / "model.safetensors.index.json").write_bytes(json.dumps(document).encode() if raw is None else raw)
    result = only_lmcli_errors(lambda: safetensors_files(directory))
    if isinstance(result, list):
        assert all(path.resolve().parent == directory.resolve() for path in result)


# --- JSONL job rows ------------------------------------------------------------------------------------


@fuzz
@given(lines=st.lists(
    st.binary(max_size=30)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.dictionaries(st.sampled_from(["prompt", "id", "seed", "max_new_tokens", "temperature", "top_k", "top_p",
                                        "stop", "system", "other"]), json_values, max_size=4)
    .map(lambda v: json.dumps(v).encode()),
    max_size=5))
def test_job_rows(tmp_path, lines):
    """Every line becomes a row or that row's error; a whole-file problem (duplicate ids) is a UsageError."""
    from lmcli.jobs.runner import GenerationSettings, read_rows

    path = tmp_path / "input.jsonl"
    path.write_bytes(b"\n".join(lines))
    rows = only_lmcli_errors(lambda: read_rows(path, GenerationSettings()))
    if isinstance(rows, list):
        for row in rows:
            assert (row.error is None) == (row.settings is not None and isinstance(row.prompt, str))
            assert row.error is None or "\n" not in row.error


# --- GGUF files --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    """A small llama GGUF: the metadata lmcli reads, a vocabulary, and two tensors (F32 and Q8_0)."""
    import gguf
    import numpy as np

    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 64), ("embedding_length", 32), ("feed_forward_length", 48),
                       ("block_count", 1), ("attention.head_count", 4), ("attention.head_count_kv", 2)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    writer.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0])
    writer.add_token_types([2, 3, 3, 1, 1])
    writer.add_tensor("token_embd.weight", np.arange(5 * 32, dtype=np.float32).reshape(5, 32))
    writer.add_tensor("output_norm.weight", gguf.quants.quantize(np.ones((1, 32), dtype=np.float32),
                                                                 gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@fuzz
@given(edits=byte_edits)
def test_gguf_byte_mutations(tmp_path, gguf_bytes, edits):
    from lmcli.io.gguf import read_gguf
    from lmcli.io.tokenizer import tokenizer_from_gguf

    path = tmp_path / "model.gguf"
    path.write_bytes(mutate(gguf_bytes, edits))
    checkpoint = only_lmcli_errors(lambda: read_gguf(path))
    if not isinstance(checkpoint, LmcliError):
        only_lmcli_errors(lambda: tokenizer_from_gguf(checkpoint.metadata))
        only_lmcli_errors(lambda: registry.config_from_hf(checkpoint.hf_config, source=str(path)))


@fuzz
@given(count=st.integers(0, 2**64 - 1), at=st.sampled_from([8, 16]))
def test_gguf_counts_that_lie(tmp_path, gguf_bytes, count, at):
    """Tensor and metadata counts (bytes 8 and 16) of any size: refused before anything is allocated."""
    from lmcli.io.gguf_reader import read_gguf_header

    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_bytes[:at] + struct.pack("<Q", count) + gguf_bytes[at + 8:])
    only_lmcli_errors(lambda: read_gguf_header(path))


# --- chat templates ---------------------------------------------------------------------------------

TEMPLATE_PIECES = [
    "{{ messages[0]['content'] }}", "{% for m in messages %}", "{% endfor %}", "{% if add_generation_prompt %}",
    "{% endif %}", "{{ 'ab' * 400000 }}", "{{ 'x' * N }}", "{% set ns = namespace(s='ab') %}",
    "{% set ns.s = ns.s ~ ns.s %}", "{% set ns.s = ns.s + ns.s %}", "{{ ns.s }}", "{% for i in range(100000) %}",
    "{{ '%099999s' % 'a' }}", "{{ 'a'|center(N) }}", "{{ 'a'.ljust(N) }}", "{{ 'a'|indent(N) }}",
    "{{ 3 ** N }}", "{{ messages * N }}", "{{ raise_exception('no') }}", "{{ x.__class__ }}", "{{ m.content|tojson }}",
    "{{ (messages|list) + (messages|list) }}", "{{ '{:{}}'.format(1, N) }}", "text", "{{", "{%",
]


@fuzz
@given(pieces=st.lists(st.sampled_from(TEMPLATE_PIECES), max_size=8), n=st.integers(-5, 10**12))
def test_chat_templates_of_any_shape(pieces, n):
    from lmcli.io.tokenizer import chat_template
    from lmcli.io.tokenizer.facade import Tokenizer

    tokenizer = Tokenizer.__new__(Tokenizer)  # only the template half of a tokenizer is exercised
    tokenizer.name, tokenizer.chat_template = "tokenizer_config.json", "".join(pieces).replace("N", str(n))
    tokenizer.bos_token = tokenizer.eos_token = tokenizer.unk_token = tokenizer.pad_token = None
    rendered = only_lmcli_errors(lambda: tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert isinstance(rendered, LmcliError) or len(rendered) <= chat_template.MAX_OUTPUT


# --- chat transcripts -------------------------------------------------------------------------------

transcript_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "robot"]),
                           "content": st.text(max_size=8)})
    | json_values, max_size=3)


@fuzz
@given(document=json_values | st.fixed_dictionaries({
    "format": st.sampled_from(["lmcli-chat/1", "other"]), "messages": transcript_messages | json_values,
    "settings": st.dictionaries(st.sampled_from(["temperature", "top_k", "stop", "max_new_tokens", "seed", "x"]),
                                json_values, max_size=3) | json_values,
    "model": json_values | st.fixed_dictionaries({"fingerprint": json_values, "checkpoint": json_values}),
    "context": json_values}),
    raw=st.none() | st.binary(max_size=40))
def test_chat_transcripts(tmp_path, document, raw):
    """A transcript of any shape: loaded and its settings resumed, or a ChatError in one line."""
    from lmcli.chat.repl import load_transcript, resumed_settings
    from lmcli.settings.generation_settings import GenerationSettings

    path = tmp_path / "transcript.json"
    path.write_bytes(json.dumps(document).encode() if raw is None else raw)

    def resume():
        saved = load_transcript(path)
        return resumed_settings(saved.get("settings", {}), GenerationSettings(), set(), path)

    only_lmcli_errors(resume)


# --- tokenizer_config.json and the files beside it --------------------------------------------------

TOKENIZER_CONFIG_FIELDS = ["tokenizer_class", "bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token",
                           "add_eos_token", "add_prefix_space", "legacy", "chat_template", "added_tokens_decoder"]
added_token_entries = st.dictionaries(
    st.sampled_from(["0", "5", "400", "x", "-1"]),
    st.fixed_dictionaries({"content": st.text(max_size=6) | json_values},
                          optional={flag: json_values for flag in ("special", "lstrip", "rstrip", "normalized",
                                                                   "single_word")}) | json_values,
    max_size=3)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> bytes:
    from cli_fixtures import build_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory, vocab_size=300)
    return (directory / "tokenizer.json").read_bytes()


@fuzz
@given(config=st.dictionaries(st.sampled_from(TOKENIZER_CONFIG_FIELDS), json_values, max_size=4)
       .flatmap(lambda c: st.just(c) | st.builds(lambda d: {**c, "added_tokens_decoder": d}, added_token_entries)),
       whole=st.none() | json_values | st.binary(max_size=20),
       beside=st.sampled_from(["special_tokens_map.json", "generation_config.json", "chat_template.jinja"]),
       beside_content=st.none() | json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=20))
def test_tokenizer_config_files(tmp_path, tokenizer_json, config, whole, beside, beside_content):
    """tokenizer_config.json of any content (and one file beside it): a tokenizer or a TokenizerError."""
    from lmcli.io.tokenizer import load_tokenizer

    for stale in tmp_path.iterdir():
        stale.unlink()
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json)
    if whole is None:
        content = json.dumps(config).encode()
    else:
        content = whole if isinstance(whole, bytes) else json.dumps(whole).encode()
    (tmp_path / "tokenizer_config.json").write_bytes(content)
    if beside_content is not None:
        (tmp_path / beside).write_bytes(beside_content)
    tokenizer = only_lmcli_errors(lambda: load_tokenizer(tmp_path))
    if tokenizer is not None and not isinstance(tokenizer, LmcliError):
        only_lmcli_errors(lambda: tokenizer.decode(tokenizer.encode("héllo <s> wörld")))


# --- GGUF tokenizer metadata ------------------------------------------------------------------------

token_texts = st.lists(st.text(max_size=4), min_size=0, max_size=6)


@fuzz
@given(model=st.sampled_from(["gpt2", "llama", "bert", ""]), architecture=st.sampled_from(["llama", "gemma3", "qwen2"]),
       tokens=token_texts, merges=st.none() | st.lists(st.text(max_size=5), max_size=5),
       types=st.none() | st.lists(st.integers(0, 2**32 - 1), max_size=6),
       scores=st.none() | st.lists(st.floats(allow_nan=True), max_size=6),
       ids=st.dictionaries(st.sampled_from(["bos", "eos", "unknown", "padding", "eot"]), st.integers(0, 2**64 - 1),
                           max_size=3),
       others=st.dictionaries(st.sampled_from(["tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                                               "tokenizer.chat_template", "tokenizer.ggml.merges"]),
                              json_values, max_size=2))
def test_gguf_tokenizer_metadata(tmp_path, model, architecture, tokens, merges, types, scores, ids, others):
    """tokenizer.ggml.* of any content, checked by type as the reader checks it, then built into a tokenizer."""
    from lmcli.errors import GGUFError
    from lmcli.io.gguf_reader import check_metadata_types
    from lmcli.io.tokenizer import tokenizer_from_gguf

    metadata: dict[str, Any] = {"general.architecture": architecture, "tokenizer.ggml.model": model,
                                "tokenizer.ggml.tokens": tokens}
    for key, value in (("merges", merges), ("token_type", types), ("scores", scores)):
        if value is not None:
            metadata[f"tokenizer.ggml.{key}"] = value
    metadata.update({f"tokenizer.ggml.{name}_token_id": value for name, value in ids.items()})
    metadata.update(others)
    try:
        check_metadata_types(metadata, tmp_path / "model.gguf")
    except GGUFError as error:
        assert "\n" not in str(error)
        return
    tokenizer = only_lmcli_errors(lambda: tokenizer_from_gguf(metadata))
    if not isinstance(tokenizer, LmcliError):
        only_lmcli_errors(lambda: tokenizer.decode(tokenizer.encode("ab a")))
