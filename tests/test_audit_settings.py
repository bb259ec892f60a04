"""Settings the earlier tests compared only with lmcli's own constants, or did not combine (found by the
planted-bug audit, docs/testing.md): the documented defaults written out as the README states them,
a generation_config.json without `do_sample`, a sampling --temperature beside a row's top-k, a
--logit-bias token that is itself "=", and whole numbers a generation_config.json writes as floats.
"""

from __future__ import annotations

import json

import pytest

from lmcli.errors import UsageError
from lmcli.settings.generation_settings import GenerationSettings, ModelDefaults, parse_logit_bias, read_model_defaults


def test_the_documented_defaults():
    """README: sampling at temperature 0.8, 128 new tokens, unless the model ships its own defaults."""
    plain = GenerationSettings.from_flags().with_model_defaults(ModelDefaults())
    assert (plain.temperature, plain.max_new_tokens, plain.top_k, plain.top_p) == (0.8, 128, None, None)


def test_a_generation_config_without_do_sample_keeps_its_temperature(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    settings = GenerationSettings.from_flags().with_model_defaults(read_model_defaults(tmp_path))
    assert (settings.temperature, settings.top_p) == (0.6, 0.9) and not settings.greedy


def test_a_sampling_temperature_flag_keeps_a_rows_truncation():
    """Only a greedy flag drops the rows' sampling-only settings; --temperature 0.7 is just the temperature."""
    row = GenerationSettings.from_flags(temperature=0.7).for_row({"top_k": 5, "min_p": 0.1})
    assert (row.temperature, row.top_k, row.min_p) == (0.7, 5, 0.1)
    assert row.source("top_k") == "row" and row.source("temperature") == "flag"
    greedy = GenerationSettings.from_flags(temperature=0).for_row({"top_k": 5})
    assert greedy.greedy and greedy.top_k is None


@pytest.mark.parametrize(("spec", "pair"), [("==5", ("=", 5.0)), ("a=b=-2", ("a=b", -2.0)), ("13=-100", ("13", -100.0))])
def test_logit_bias_splits_at_the_last_equals_sign(spec, pair):
    assert parse_logit_bias([spec]) == (pair,)


def test_logit_bias_without_a_bias_is_refused():
    with pytest.raises(UsageError, match="TOKEN=BIAS"):
        parse_logit_bias(["hello"])


def test_a_generation_config_writing_whole_numbers_as_floats(tmp_path):
    """A config kept in floats and dumped writes "top_k": 40.0: the whole number it is (the literal values here)."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 40.0, "max_new_tokens": 64.0}))
    defaults = read_model_defaults(tmp_path)
    assert defaults.values == {"temperature": 0.7, "top_k": 40, "max_new_tokens": 64}
    assert type(defaults.values["top_k"]) is int and type(defaults.values["max_new_tokens"]) is int
    settings = GenerationSettings.from_flags().with_model_defaults(defaults)
    assert (settings.temperature, settings.top_k, settings.max_new_tokens) == (0.7, 40, 64)
