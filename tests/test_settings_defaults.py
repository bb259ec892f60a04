"""The model's own sampling defaults (generation_config.json, GGUF general.sampling.*) and their
precedence: a command-line flag > a job row > the model's defaults > lmcli's defaults."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lmcli.errors import LmcliError, UsageError
from lmcli.settings.generation_settings import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    GenerationSettings,
    ModelDefaults,
    RowError,
    read_model_defaults,
)


def hf_dir(tmp_path, **config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def gguf_file(path, **keys):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        name = f"general.sampling.{key}"
        writer.add_int32(name, value) if isinstance(value, int) else writer.add_float32(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_generation_config_values_are_read_and_off_values_dropped(tmp_path):
    directory = hf_dir(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, top_k=0, repetition_penalty=1.0,
                       min_p=0.05, max_new_tokens=64, eos_token_id=[1, 7], bos_token_id=0)
    defaults = read_model_defaults(directory)
    assert defaults.values == {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05, "max_new_tokens": 64}
    assert defaults.source.endswith("generation_config.json")
    # a single .safetensors file takes the generation_config.json beside it
    assert read_model_defaults(directory / "model.safetensors").values == defaults.values


def test_do_sample_false_means_greedy_and_drops_the_models_warpers(tmp_path):
    defaults = read_model_defaults(hf_dir(tmp_path, do_sample=False, temperature=0.6, top_k=20))
    assert defaults.values["temperature"] == 0.0
    settings = GenerationSettings.from_flags().with_model_defaults(defaults)
    assert settings.greedy and settings.top_k is None
    # ...but a flag that samples brings the model's top-k back
    sampled = GenerationSettings.from_flags(temperature=0.9).with_model_defaults(defaults)
    assert (sampled.temperature, sampled.top_k) == (0.9, 20)
    with pytest.raises(LmcliError, match=r"--top-p only applies to sampling.*asks for greedy"):
        GenerationSettings.from_flags(top_p=0.5).with_model_defaults(defaults)


def test_gguf_sampling_keys_are_read(tmp_path):
    path = gguf_file(tmp_path / "m.gguf", temp=0.7, top_k=40, top_p=1.0, min_p=0.05, penalty_repeat=1.1)
    defaults = read_model_defaults(path)
    assert defaults.values == {"temperature": 0.7, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}
    assert "general.sampling" in defaults.source


def test_no_defaults_where_the_checkpoint_has_none(tmp_path):
    assert not read_model_defaults(tmp_path)
    assert not read_model_defaults(gguf_file(tmp_path / "bare.gguf"))


def test_bad_model_values_name_the_file_and_key(tmp_path):
    with pytest.raises(LmcliError, match=r"generation_config.json: top_p must be in \(0, 1\], got 1.5"):
        read_model_defaults(hf_dir(tmp_path, top_p=1.5))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(LmcliError, match="cannot read"):
        read_model_defaults(tmp_path)


MODEL = ModelDefaults({"temperature": 0.6, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.2,
                       "max_new_tokens": 64}, "generation_config.json")


def test_precedence_flag_over_row_over_model_over_lmcli():
    plain = GenerationSettings.from_flags()
    assert (plain.temperature, plain.max_new_tokens) == (DEFAULT_TEMPERATURE, DEFAULT_MAX_NEW_TOKENS)
    assert plain.source("temperature") == "lmcli default"

    model = plain.with_model_defaults(MODEL)
    assert (model.temperature, model.top_k, model.top_p, model.repetition_penalty, model.max_new_tokens) == (
        0.6, 20, 0.9, 1.2, 64)  # the model may set top-k and top-p together, as transformers applies them
    assert model.source("top_k") == "generation_config.json" and model.source("seed") == "lmcli default"

    flagged = GenerationSettings.from_flags(temperature=1.1, max_new_tokens=5).with_model_defaults(MODEL)
    assert (flagged.temperature, flagged.max_new_tokens, flagged.top_k) == (1.1, 5, 20)
    assert flagged.source("temperature") == "flag"

    # the flags beat the row; the row beats the model's defaults
    row = flagged.for_row({"temperature": 0.3, "repetition_penalty": 1.05, "max_new_tokens": 7})
    assert (row.temperature, row.repetition_penalty, row.max_new_tokens, row.top_k) == (1.1, 1.05, 5, 20)
    assert row.source("temperature") == "flag" and row.source("max_new_tokens") == "flag"
    assert row.source("repetition_penalty") == "row" and row.source("top_k") == "generation_config.json"
    # with no flags, the row beats the model's defaults
    unflagged = plain.with_model_defaults(MODEL).for_row({"temperature": 0.3, "max_new_tokens": 7})
    assert (unflagged.temperature, unflagged.max_new_tokens, unflagged.top_k) == (0.3, 7, 20)
    assert unflagged.source("temperature") == "row"


def test_truncation_is_one_unit_per_layer():
    """A flag or row that sets top-k or top-p replaces both of the model's (they would not mix)."""
    by_flag = GenerationSettings.from_flags(top_p=0.5).with_model_defaults(MODEL)
    assert (by_flag.top_k, by_flag.top_p) == (None, 0.5)
    by_row = GenerationSettings.from_flags().with_model_defaults(MODEL).for_row({"top_k": 3})
    assert (by_row.top_k, by_row.top_p) == (3, None)
    # a flag that sets either keeps the row's pair out: the flags' truncation stands whole
    over_row = by_flag.for_row({"top_k": 3})
    assert (over_row.top_k, over_row.top_p) == (None, 0.5) and over_row.source("top_p") == "flag"
    with pytest.raises(UsageError, match="--top-k and --top-p cannot be used together"):
        GenerationSettings.from_flags(top_k=3, top_p=0.5)
    with pytest.raises(RowError, match='"top_k" and "top_p" cannot be used together'):
        GenerationSettings.from_flags().for_row({"top_k": 3, "top_p": 0.5})


def test_greedy_flag_or_row_drops_the_models_warpers():
    greedy = GenerationSettings.from_flags(greedy=True).with_model_defaults(MODEL)
    assert greedy.greedy and (greedy.top_k, greedy.top_p) == (None, None) and greedy.repetition_penalty == 1.2
    row = GenerationSettings.from_flags().with_model_defaults(MODEL).for_row({"temperature": 0})
    assert row.greedy and (row.top_k, row.top_p) == (None, None)
    # --greedy beats a sampling row (and its sampling-only settings): every row is greedy
    still_greedy = greedy.for_row({"temperature": 0.7, "top_p": 0.5, "min_p": 0.1})
    assert still_greedy.greedy and (still_greedy.top_k, still_greedy.top_p, still_greedy.min_p) == (None, None, None)
    # a sampling flag beats a greedy row, which keeps the model's truncation
    sampled = GenerationSettings.from_flags(temperature=0.7).with_model_defaults(MODEL).for_row({"temperature": 0})
    assert sampled.temperature == 0.7 and (sampled.top_k, sampled.top_p) == (20, 0.9)


def test_new_row_fields_are_checked_and_named():
    base = GenerationSettings.from_flags()
    row = base.for_row({"min_p": 0.1, "typical_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                        "no_repeat_ngram_size": 3, "min_new_tokens": 2, "logit_bias": {"13": -100, "x": 2}})
    assert row.used()["logit_bias"] == {"13": -100.0, "x": 2.0} and row.min_new_tokens == 2
    cases: list[tuple[dict[str, Any], str]] = [({"min_p": 2}, '"min_p" must be in [0, 1]'),
                         ({"no_repeat_ngram_size": 1.5}, '"no_repeat_ngram_size" must be an integer'),
                         ({"presence_penalty": 3}, '"presence_penalty" must be between -2 and 2'),
                         ({"logit_bias": {"5": 101}}, '"logit_bias" biases must be between -100 and 100'),
                         ({"logit_bias": [5]}, '"logit_bias" must be an object'),
                         ({"temperature": 0, "typical_p": 0.5}, '"typical_p" only applies to sampling')]
    for bad, message in cases:
        with pytest.raises(RowError) as error:
            base.for_row(bad)
        assert message in str(error.value)


@pytest.mark.parametrize("flags,message", [
    (dict(min_p=1.5), "--min-p must be in [0, 1]"),
    (dict(typical_p=0.0), "--typical-p must be in (0, 1]"),
    (dict(frequency_penalty=-2.5), "--frequency-penalty must be between -2 and 2"),
    (dict(no_repeat_ngram_size=0), "--no-repeat-ngram-size must be at least 1"),
    (dict(min_new_tokens=-1), "--min-new-tokens must be at least 0"),
    (dict(greedy=True, min_p=0.1), "--min-p only applies to sampling"),
    (dict(logit_bias=(("5", 200.0),)), "--logit-bias biases must be between -100 and 100"),
    (dict(temperature=float("nan")), "--temperature must be a finite number"),
])
def test_bad_new_flags_are_usage_errors_naming_the_flag(flags, message):
    with pytest.raises(UsageError) as error:
        GenerationSettings.from_flags(**flags)
    assert message in str(error.value) and "\n" not in str(error.value)


# Each generation_config.json / GGUF key at the value that means "off" there, written out here.
HF_OFF_VALUES = [("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("typical_p", 1.0), ("repetition_penalty", 1.0)]
GGUF_OFF_VALUES = [("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("penalty_repeat", 1.0)]


@pytest.mark.parametrize("key, off", HF_OFF_VALUES, ids=[k for k, _ in HF_OFF_VALUES])
def test_each_off_value_in_generation_config_means_no_default(tmp_path, key, off):
    defaults = read_model_defaults(hf_dir(tmp_path, do_sample=True, temperature=0.7, **{key: off}))
    assert defaults.values == {"temperature": 0.7}
    settings = GenerationSettings.from_flags().with_model_defaults(defaults)
    assert getattr(settings, key) in (None, off)  # nothing from the model: lmcli's own "none"
    assert key not in (settings.sources or {}) or settings.sources[key] != defaults.source


@pytest.mark.parametrize("key, off", GGUF_OFF_VALUES, ids=[k for k, _ in GGUF_OFF_VALUES])
def test_each_off_value_in_gguf_metadata_means_no_default(tmp_path, key, off):
    defaults = read_model_defaults(gguf_file(tmp_path / "m.gguf", temp=0.7, **{key: off}))
    assert defaults.values == {"temperature": pytest.approx(0.7)}
