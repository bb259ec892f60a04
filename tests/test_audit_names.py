"""Model names and fingerprints where the earlier tests did not look (found by the planted-bug audit,
docs/testing.md): hub caches laid out by the test (refs/main naming a snapshot that is gone, a repo
id in another case), a models directory entry ORG--NAME/, and fingerprints that must follow a file's
content (its last MiB, a --tokenizer's chat template) but not its name. A GGUF's own sampling keys
reach the model resolved by path.
"""

from __future__ import annotations

import json
import shutil

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from test_model_names import hub_repo, places  # noqa: F401 (places: a fixture)
from test_settings_defaults import gguf_file

from lmcli.resolve import model_names
from lmcli.resolve.model_ref import resolve_model


def test_refs_main_naming_a_snapshot_that_is_gone_takes_the_one_there(places, tiny_checkpoint):
    _, hub = places
    there = hub_repo(hub, "TinyOrg/tiny-llama", tiny_checkpoint, commit="1" * 40, refs=())
    (there.parents[1] / "refs" / "main").write_text("f" * 40)  # an interrupted download's ref
    assert model_names.resolve("TinyOrg/tiny-llama")[0] == there


def test_a_repo_id_finds_the_cache_in_another_case(places, tiny_checkpoint):
    _, hub = places
    snapshot = hub_repo(hub, "TinyOrg/Tiny-Llama", tiny_checkpoint)
    assert model_names.resolve("tinyorg/tiny-llama")[0] == snapshot


def test_a_models_directory_entry_org_dashes_name(places, tiny_checkpoint):
    models, _ = places
    entry = models / "TinyOrg--tiny-llama"
    shutil.copytree(tiny_checkpoint, entry)
    assert model_names.resolve("TinyOrg/tiny-llama")[0] == entry


def test_a_large_files_fingerprint_sees_its_first_and_last_mib_and_not_its_name(tmp_path):
    big = tmp_path / "big.gguf"
    big.write_bytes(bytes(40 << 20))
    before = model_names.checkpoint_fingerprint(big)
    renamed = big.rename(tmp_path / "renamed.gguf")
    assert model_names.checkpoint_fingerprint(renamed) == before  # a copy under another name is the same model
    for offset in (10, (40 << 20) - 10):
        with open(renamed, "r+b") as f:
            f.seek(offset)
            f.write(b"\x01")
        assert model_names.checkpoint_fingerprint(renamed) != before, offset
        before = model_names.checkpoint_fingerprint(renamed)


def test_a_tokenizers_chat_template_is_part_of_the_fingerprint(tmp_path, tiny_checkpoint):
    """--tokenizer FILE: the tokenizer_config.json beside it (its chat template) decides chat text."""
    one, two = tmp_path / "one", tmp_path / "two"
    for directory in (one, two):
        directory.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_checkpoint / name, directory / name)
    config = json.loads((two / "tokenizer_config.json").read_text())
    (two / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages[0]['content'] }}"}))
    by_file = [resolve_model(tiny_checkpoint, tokenizer_path=d / "tokenizer.json").fingerprint for d in (one, two)]
    by_dir = [resolve_model(tiny_checkpoint, tokenizer_path=d).fingerprint for d in (one, two)]
    assert by_file[0] != by_file[1] and by_dir[0] != by_dir[1]
    assert resolve_model(tiny_checkpoint).fingerprint not in by_file  # another tokenizer at all


def test_a_gguf_resolved_by_path_has_its_own_sampling_defaults(tmp_path):
    path = gguf_file(tmp_path / "m.gguf", temp=0.7, top_k=40)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2}))  # not the GGUF's
    assert dict(resolve_model(path).defaults.values) == {"temperature": 0.7, "top_k": 40}


@pytest.mark.parametrize("name", ["TinyOrg/tiny-llama"])
def test_models_lists_a_hub_repo_under_the_name_that_finds_it(places, tiny_checkpoint, name):
    _, hub = places
    snapshot = hub_repo(hub, name, tiny_checkpoint)
    listed = [m for m in model_names.installed_models() if m.source == "hf"]
    assert [(m.name, m.path) for m in listed] == [(name, snapshot)]
    assert model_names.resolve(listed[0].name)[0] == snapshot
