"""The table of decoding settings (lmcli.settings.table) and the edges it checks: settings that cannot exist
unchecked, chat transcripts refused field by field, llama.cpp's "off" values, and the table's names
against the CLI, the job rows, transformers' GenerationConfig and the gguf package's keys."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401

from lmcli.chat.repl import NOT_SETTABLE, ChatError, settable_names
from lmcli.errors import LmcliError
from lmcli.settings.generation_settings import GenerationSettings, InvalidSettings, ModelDefaults, read_model_defaults
from lmcli.settings.table import SETTINGS, SWITCH

# --- no GenerationSettings breaks a rule ------------------------------------------------------------


@pytest.mark.parametrize("changes,message", [
    (dict(top_p=2.0), "top_p must be in (0, 1], got 2"),
    (dict(temperature=0, top_k=3), "top_k only applies to sampling"),
    (dict(max_new_tokens="many"), "max_new_tokens must be an integer, got 'many'"),
    (dict(ignore_eos="no"), "ignore_eos must be true or false, got 'no'"),
    (dict(stop=(1, 2)), "stop must be a string or a list of strings"),
    (dict(logit_bias=(("13", "x"),)), "logit_bias must be a number, got 13="),
    (dict(system="hi"), "system only applies with --chat"),
    (dict(sources={"top_p": 5}), "sources must map setting names"),
])
def test_replace_cannot_make_settings_that_break_a_rule(changes, message):
    with pytest.raises(InvalidSettings) as error:
        dataclasses.replace(GenerationSettings(), **changes)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert isinstance(error.value, LmcliError)  # one line at the CLI, never an internal error
    with pytest.raises(InvalidSettings):
        GenerationSettings(**changes)


def test_settings_are_normalised_as_made():
    settings = GenerationSettings(temperature=1, stop=["a"], logit_bias=[("5", 2)])  # type: ignore[arg-type]
    assert type(settings.temperature) is float and settings.stop == ("a",) and settings.logit_bias == (("5", 2.0),)
    assert hash(settings.batch_key())  # tuples all the way down: rows group by it


# --- chat transcripts, field by field ---------------------------------------------------------------

# As /save writes a conversation's settings (the test's own copy of the format).
SAVED = {"max_new_tokens": 5, "temperature": 0.7, "top_k": None, "top_p": 0.9, "min_p": None, "typical_p": None,
         "repetition_penalty": 1.1, "presence_penalty": None, "frequency_penalty": None,
         "no_repeat_ngram_size": None, "min_new_tokens": None, "logit_bias": [["13", -100.0]], "seed": 3,
         "stop": ["\n"], "ignore_eos": True, "truncate": False, "sources": {"temperature": "flag"},
         "model_defaults": {"values": {"top_p": 0.9}, "source": "generation_config.json"}}


def resumed(saved, explicit=()):
    return GenerationSettings(chat=True).resumed(saved, settable_names(), set(explicit), "t.json", ChatError)


def test_a_saved_transcript_resumes_with_its_settings():
    settings = resumed(SAVED)
    assert (settings.max_new_tokens, settings.temperature, settings.top_p, settings.repetition_penalty) == (
        5, 0.7, 0.9, 1.1)
    assert (settings.logit_bias, settings.seed, settings.stop) == ((("13", -100.0),), 3, ("\n",))
    assert (settings.ignore_eos, settings.truncate, settings.source("temperature")) == (True, False, "flag")
    assert settings.model_defaults == ModelDefaults({"top_p": 0.9}, "generation_config.json")
    # what this session's /save writes comes back the same (the transcript's own format)
    written = {k: v for k, v in dataclasses.asdict(settings).items() if k not in NOT_SETTABLE}
    again = resumed(json.loads(json.dumps(written)))
    assert again == settings and again.sources == settings.sources and again.model_defaults == settings.model_defaults
    # a setting given on the command line this time is not taken from the file
    assert resumed({**SAVED, "max_new_tokens": "many"}, explicit={"max_new_tokens"}).max_new_tokens == 128


BAD_SETTINGS = [
    ({"max_new_tokens": "many"}, '"max_new_tokens" in {path} must be an integer, got "many"'),
    ({"ignore_eos": "no"}, '"ignore_eos" in {path} must be true or false, got "no"'),
    ({"truncate": "yes"}, '"truncate" in {path} must be true or false, got "yes"'),
    ({"temperature": [1]}, '"temperature" in {path} must be a number, got [1]'),
    ({"stop": [1, 2]}, '"stop" in {path} must be a string or a list of strings, got [1, 2]'),
    ({"logit_bias": {"13": "x"}}, '"logit_bias" in {path} must be an object of token (text or id) to bias'),
    ({"logit_bias": [[13, 5]]}, '"logit_bias" in {path} must be an object of token (text or id) to bias'),
    ({"top_p": 5}, '"top_p" in {path} must be in (0, 1], got 5'),
    ({"sources": ["flag"]}, '"sources" in {path} must be an object of setting name to where it came from'),
    ({"sources": {"top_p": 1}}, '"sources" in {path} must be an object of setting name to where it came from'),
    ({"model_defaults": "generation_config.json"}, '"model_defaults" in {path} must be an object'),
    ({"model_defaults": {"values": [0.9]}}, '"model_defaults" in {path} must be an object'),
    ({"model_defaults": {"values": {"top_p": "high"}, "source": "g"}}, 'top_p must be a number'),
    ({"model_defaults": {"values": {"stop": ["x"]}, "source": "g"}}, "stop is not a setting a model's defaults"),
    ({"colour": 1}, "{path}: unknown setting 'colour'"),
]


@pytest.mark.parametrize("bad,message", BAD_SETTINGS, ids=lambda v: json.dumps(v) if isinstance(v, dict) else "")
def test_a_transcript_with_a_bad_setting_is_refused_naming_the_field(bad, message):
    with pytest.raises(ChatError) as error:
        resumed({**SAVED, **bad})
    assert message.format(path="t.json") in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("bad,message", BAD_SETTINGS[:6] + BAD_SETTINGS[8:11], ids=lambda v: json.dumps(v)
                         if isinstance(v, dict) else "")
def test_chat_resume_refuses_a_bad_setting_in_one_line(tiny_checkpoint, tmp_path, bad, message):
    from typer.testing import CliRunner

    from lmcli.cli import app

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "lmcli-chat/1", "messages": [{"role": "user", "content": "Hi"}],
                                "settings": {**SAVED, **bad}, "model": {}}))
    result = CliRunner().invoke(app, ["chat", "-c", str(tiny_checkpoint), "--resume", str(path)], input="Hi\n")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message.format(path=path) in result.stderr and "Traceback" not in result.stderr


# --- the model's files: the table's keys and off values ---------------------------------------------


def test_llama_cpp_off_values_beyond_the_range_are_off(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    # llama.cpp reads top_k <= 0, top_p >= 1 and min_p <= 0 as off, and a repeat penalty of exactly 1.
    writer.add_int32("general.sampling.top_k", -1)
    writer.add_float32("general.sampling.top_p", 1.5)
    writer.add_float32("general.sampling.min_p", -0.25)
    writer.add_float32("general.sampling.penalty_repeat", 0.5)
    writer.add_float32("general.sampling.temp", 0.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_model_defaults(path).values == {"temperature": 0.0, "repetition_penalty": 0.5}


def test_the_tables_names_are_the_ones_each_place_uses():
    import gguf
    from transformers import GenerationConfig
    from typer.main import get_command

    from lmcli.cli import app
    from lmcli.jobs.input import ROW_FIELDS

    # every setting GenerationSettings holds has one entry, and the other way round
    fields = {f.name for f in dataclasses.fields(GenerationSettings)} - {"sources", "model_defaults"}
    assert fields == set(SETTINGS)
    generate = get_command(app).commands["generate"]  # type: ignore[attr-defined]
    flags = {name for p in generate.params for name in (*p.opts, *getattr(p, "secondary_opts", ()))}
    # a setting given by one of several flags (the structured-output constraint) names them joined by '/'
    assert {flag for s in SETTINGS.values() if s.flag for flag in s.flag.split('/')} <= flags
    from lmcli.generation.constraints import KINDS  # a row's constraint: one field per kind

    assert set(ROW_FIELDS) - {"prompt", "id", *KINDS} == {name for name, s in SETTINGS.items() if s.row}
    config = GenerationConfig()
    assert all(hasattr(config, s.hf) for s in SETTINGS.values() if s.hf)
    gguf_keys = {v for k, v in vars(gguf.Keys.General).items() if k.startswith("SAMPLING_")}
    assert {s.gguf for s in SETTINGS.values() if s.gguf} <= gguf_keys
    # a switch has no "not set"
    assert all(not s.optional for s in SETTINGS.values() if s.kind == SWITCH)


@pytest.mark.parametrize("temperature", [1e-45, 1e-300])
def test_a_temperature_so_small_it_overflows_samples_the_argmax(temperature):
    import torch

    from lmcli.generation.sampling import Temperature, row_generators, sample

    logits = torch.randn(16, 97, generator=torch.Generator().manual_seed(0)) * 5
    logits[:, 3] = -math.inf  # a token a processor banned stays banned
    scaled = Temperature(temperature)(logits[:, :0], logits)
    assert not scaled.isnan().any()
    for seed in range(3):
        assert torch.equal(sample(scaled, row_generators(seed, 16, torch.device("cpu"))), logits.argmax(-1))
