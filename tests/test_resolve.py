"""A model is resolved once: `-m NAME` and `-c PATH` for the same checkpoint behave the same everywhere.

The tiny Llama is laid out in a fake HF hub cache (as huggingface_hub writes it) with sampling
defaults this test writes into its generation_config.json; what each command reports is checked
against those values and against the snapshot directory the test made.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from test_model_names import hub_repo
from typer.testing import CliRunner

from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")

REPO_ID = "TinyOrg/tiny-with-defaults"
WRITTEN = {"do_sample": True, "temperature": 0.35, "top_p": 0.55}  # the model's own defaults, as this test sets them


def cli(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


@pytest.fixture
def snapshot(tiny_checkpoint, tmp_path, monkeypatch) -> Path:
    """The tiny checkpoint, with WRITTEN in its generation_config.json, as the hub snapshot of REPO_ID."""
    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoint, source)
    config_path = source / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config_path.write_text(json.dumps({**config, **WRITTEN}))
    models, hub = tmp_path / "lmcli-models", tmp_path / "hub"
    models.mkdir()
    hub.mkdir()
    monkeypatch.setenv("LMCLI_MODELS_DIR", str(models))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub_repo(hub, REPO_ID, source)


def generated_row(*flags) -> dict:
    result = cli("generate", *flags, "--format", "jsonl", "-n", 4, "--seed", 3, "--ignore-eos", "Once upon")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def info_facts(*flags) -> dict[str, str]:
    result = cli("info", *flags)
    assert result.exit_code == 0, result.stderr
    return dict(line.split(": ", 1) for line in result.stdout.splitlines())


def test_model_by_name_uses_its_generation_config_as_by_path(snapshot):
    by_name, by_path = generated_row("-m", REPO_ID), generated_row("-c", snapshot)
    for row in (by_name, by_path):
        assert row["settings"]["temperature"] == WRITTEN["temperature"]
        assert row["settings"]["top_p"] == WRITTEN["top_p"]
    assert by_name["completion"] == by_path["completion"]  # the same model, settings and seed

    source = snapshot / "generation_config.json"
    for facts in (info_facts("-m", REPO_ID), info_facts("-c", snapshot)):
        assert facts["default temperature"] == f"{WRITTEN['temperature']} ({source})"
        assert facts["default top_p"] == f"{WRITTEN['top_p']} ({source})"


def test_a_chat_by_name_saves_the_snapshot_it_loaded_and_the_job_fingerprint(snapshot, tmp_path):
    transcript = tmp_path / "chat.json"
    result = cli("chat", "-m", REPO_ID, "--greedy", "-n", 2, input=f"Hi\n/save {transcript}\n")
    assert result.exit_code == 0, result.stderr
    saved = json.loads(transcript.read_text())["model"]
    assert saved["checkpoint"] == str(snapshot)

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Hi", "max_new_tokens": 1}) + "\n")
    job = cli("generate", "-m", REPO_ID, "--input", rows)
    assert job.exit_code == 0, job.stderr
    assert json.loads(job.stdout)["model"] == {"name": REPO_ID, "fingerprint": saved["fingerprint"]}

    # By path, the same snapshot is the same model: the same fingerprint.
    by_path = tmp_path / "by-path.json"
    assert cli("chat", "-c", snapshot, "-n", 1, input=f"/save {by_path}\n").exit_code == 0
    assert json.loads(by_path.read_text())["model"] == saved


def test_info_takes_the_checkpoint_as_c_as_m_or_positional(snapshot):
    positional, by_flag, by_name = info_facts(snapshot), info_facts("-c", snapshot), info_facts("-m", REPO_ID)
    assert positional["checkpoint"] == by_flag["checkpoint"] == str(snapshot)
    assert by_name["checkpoint"] == f"{snapshot} (found for --model {REPO_ID})"
    assert positional == by_flag
    assert {k: v for k, v in by_name.items() if k != "checkpoint"} == {
        k: v for k, v in positional.items() if k != "checkpoint"}
    assert by_name["layers"] == "2" and by_name["architecture"].startswith("llama")

    result = cli("info", snapshot, "-c", snapshot.parent)
    assert result.exit_code == 2 and "give the checkpoint once" in result.stderr
