"""The prompt cache on disk (io/prompt_blocks.py, the prefix cache's second tier in
generation/prefix_cache.py): a run that starts from it gives, token for token, what `model.generate` gives
the same prompt with no cache at all (the reference, called directly), from a cold, a warm-memory and a
warm-disk cache; its keys keep other numerics apart; a damaged, truncated, foreign or oversized entry, a
directory in an entry's place, a read-only directory, a disk that fills midway and two processes racing
each still give the reference's tokens; and its size bound keeps the most recently used."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from cli_fixtures import REPO, subprocess_env, tiny_checkpoint  # noqa: F401 (fixture)
from real_models import gemma_gguf, smollm2_gguf  # noqa: F401 (fixture)
from test_continuous import alone, loaded, window_checkpoint  # noqa: F401 (fixtures: int4 tiny models, loaded once)
from typer.testing import CliRunner

import lmcli
from lmcli.cli import app
from lmcli.generation.continuous import ContinuousRun
from lmcli.generation.prefix_cache import PrefixCache, disk_store_for, numerics_key, prefix_cache_for
from lmcli.generation.rows import prepare_row
from lmcli.io import prompt_blocks
from lmcli.io.prompt_blocks import BlockStore
from lmcli.settings.generation_settings import GenerationSettings

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


def rows_for(tokenizer, prompts: list[str], new: int = 6):
    """Greedy and seeded-sampling rows, alternately."""
    return [prepare_row(tokenizer, i, prompt, GenerationSettings().for_row(
        {"temperature": [0, 0.9][i % 2], "seed": 7 + i, "max_new_tokens": new})) for i, prompt in enumerate(prompts)]


def run(model, tokenizer, rows, prefix: PrefixCache | None):
    got: dict = {}
    job = ContinuousRun(model, tokenizer, 2, on_done=lambda r: got.setdefault(r.row.id, r.tokens),
                        alone=lambda row: pytest.fail(f"row {row.id} ran alone"), prefix_cache=prefix)
    job.run(rows, lambda stranded: pytest.fail(f"rows {[r.id for r in stranded]} failed"))
    return got, job.stats


def disk_cache(model, directory: Path, **store) -> PrefixCache:
    key = numerics_key(model)
    assert key is not None
    disk = BlockStore(directory, "k" + str(abs(hash(str(sorted(key.items()))))), **store)
    return PrefixCache(block=BLOCK, disk=disk, vocab=model.config.vocab_size)


LONG = "the long shared opening of every prompt here, written out so that it spans several blocks of tokens, "
PROMPTS = [LONG + "then one", LONG + "then one more", LONG[:57], LONG + "and a last different ending here"]


@pytest.mark.parametrize("case", ["llama", "window"])
def test_cold_warm_memory_and_warm_disk_equal_generate(case, loaded, tmp_path):
    """Each row's tokens from a cold cache, then the same cache warm (memory), then a fresh cache over the
    same directory (disk), equal model.generate's on the row alone; the sliding-window model's prompts run
    past its window of 8. PROMPTS covers a prefix ending mid-block, a stored prompt longer than the new one
    (LONG[:57] after the longer ones) and the first token after a cached block."""
    model, tokenizer = loaded(case)
    rows = rows_for(tokenizer, PROMPTS)
    reference = {row.id: alone(model, tokenizer, row) for row in rows}
    assert any(len(row.prompt_ids) % BLOCK for row in rows)
    assert all(len(row.prompt_ids) > 8 for row in rows)  # past the window
    cold = disk_cache(model, tmp_path)
    got, stats = run(model, tokenizer, rows, cold)
    assert got == reference
    assert cold.disk is not None and cold.disk.written > 0 and cold.stats.from_disk == 0
    got, stats = run(model, tokenizer, rows, cold)  # warm: every prompt seen, in memory
    assert got == reference and stats.prefill_computed == 0 and cold.stats.from_disk == 0
    warm = disk_cache(model, tmp_path)
    got, stats = run(model, tokenizer, rows, warm)  # a new process's cache: all from disk
    assert got == reference
    assert stats.prefill_computed == 0  # shared blocks read once, then held in memory:
    assert warm.stats.from_disk + warm.stats.from_memory == stats.prefill_requested
    assert warm.stats.from_disk >= len(rows[0].prompt_ids)
    assert warm.disk is not None and warm.disk.skipped == 0
    # A new prompt sharing blocks with the stored ones: those from disk, the rest computed.
    fresh = disk_cache(model, tmp_path)
    [row] = rows_for(tokenizer, [LONG + "a new question"])
    got, stats = run(model, tokenizer, [row], fresh)
    assert got == {row.id: alone(model, tokenizer, row)}
    assert 0 < stats.prefill_computed < stats.prefill_requested // 3 and fresh.stats.from_disk > 0


def test_the_key_covers_the_code_that_computes_keys_and_values(loaded, monkeypatch):
    """The code digest reads every model, kernel and step source, the C++ kernels' sources included: a
    block written by an lmcli whose arithmetic differs is another key's."""
    from pathlib import Path

    import lmcli
    from lmcli.io import fingerprint

    asked: list[str] = []
    real = fingerprint.source_digest

    def spy(patterns):
        asked.extend(patterns)
        return real(patterns)

    monkeypatch.setattr(fingerprint, "source_digest", spy)
    model, _ = loaded("llama")
    assert numerics_key(model) is not None
    package = Path(lmcli.__file__).parent
    covered = {path for pattern in asked for path in package.glob(pattern)}
    sources = [*package.glob("models/*.py"), *package.glob("kernels/*.py"), *(package / "native").rglob("*.[ch]*"),
               package / "generation" / "step.py"]
    assert [p for p in sources if p.suffix in (".py", ".cpp", ".h") and p not in covered] == []


def test_keys_never_mix(loaded, tmp_path, monkeypatch):
    """Another model, another dtype or kernel plan, another thread count where rows are not batch-invariant:
    another key, so blocks written under one are never read under another (the file names differ and a
    file's header names its key)."""
    llama, _ = loaded("llama")
    window, _ = loaded("window")
    key = numerics_key(llama)
    assert key is not None and numerics_key(window) is not None
    assert key["fingerprint"] != numerics_key(window)["fingerprint"]  # type: ignore[index]
    monkeypatch.setattr(llama, "numerics", dataclasses.replace(llama.numerics, activation_dtype=torch.float16))
    assert numerics_key(llama)["activation_dtype"] != key["activation_dtype"]  # type: ignore[index]
    monkeypatch.undo()
    monkeypatch.setattr(llama, "numerics", dataclasses.replace(llama.numerics, kernel_choices={}))
    assert numerics_key(llama)["kernels"] != key["kernels"]  # type: ignore[index]
    monkeypatch.setattr(llama, "numerics", dataclasses.replace(llama.numerics, batch_invariant=False))
    before = numerics_key(llama)["threads"]  # type: ignore[index]
    torch.set_num_threads(2)
    try:
        assert numerics_key(llama)["threads"] != before  # type: ignore[index]
    finally:
        torch.set_num_threads(1)
    assert key["threads"] == "any"  # batch-invariant: the same numbers at any thread count
    # Written under one key, the entry is refused under another, and the text is still the reference's.
    monkeypatch.undo()
    model, tokenizer = loaded("llama")
    rows = rows_for(tokenizer, PROMPTS[:2])
    reference = {row.id: alone(model, tokenizer, row) for row in rows}
    first = PrefixCache(block=BLOCK, disk=BlockStore(tmp_path, "key-a"), vocab=model.config.vocab_size)
    run(model, tokenizer, rows, first)
    names = {p.name for p in tmp_path.rglob("*.lmpb")}
    second = PrefixCache(block=BLOCK, disk=BlockStore(tmp_path, "key-b"), vocab=model.config.vocab_size)
    got, _ = run(model, tokenizer, rows, second)
    assert got == reference and second.stats.from_disk == 0
    assert len({p.name for p in tmp_path.rglob("*.lmpb")}) == 2 * len(names)  # the chain starts from the key
    # A file of key-a's put where key-b looks (the same name) is refused by its header.
    ids = rows[0].prompt_ids[:BLOCK]
    shapes = [prompt_blocks.Shape(t.dtype, tuple(t.shape)) for t in _block_tensors(model)]
    tensors = [torch.randn(s.shape).to(s.dtype) for s in shapes]
    a, b = BlockStore(tmp_path / "x", "key-a"), BlockStore(tmp_path / "x", "key-b")
    assert a.save(b"link", ids, 0, tensors) and a.load(b"link", ids, 0, shapes) is not None
    assert b.load(b"link", ids, 0, shapes) is None and b.skipped == 1


def _hostile(directory: Path, how: str) -> None:
    """Damage every entry under `directory` one way."""
    entries = sorted(directory.rglob("*.lmpb"))
    assert entries
    for entry in entries:
        data = bytearray(entry.read_bytes())
        if how == "bit flip":
            data[-3] ^= 0x10
            entry.write_bytes(bytes(data))
        elif how == "truncated":
            entry.write_bytes(bytes(data[:len(data) // 2]))
        elif how == "huge header":
            entry.write_bytes(data[:8] + (10**12).to_bytes(8, "little") + data[16:])
        elif how == "huge tensor":  # a header that claims 10^12 bytes of data: refused before any allocation
            text = bytes(data)
            start = 16
            length = int.from_bytes(text[8:16], "little")
            header = text[start:start + length].replace(b'"data_bytes": ', b'"data_bytes": 1000000000000')
            entry.write_bytes(text[:8] + len(header).to_bytes(8, "little") + header + text[start + length:])
        elif how == "directory":
            entry.unlink()
            entry.mkdir()
            (entry / "x").write_text("not a block")
        elif how == "ids":  # another prompt's entry under this name (a hash collision, or a copy): well formed
            length = int.from_bytes(data[8:16], "little")
            header = json.loads(bytes(data[16:16 + length]))
            payload = bytearray(data[16 + length:])
            payload[0] ^= 1  # the first token id, with the checksum made right
            header.pop("crc32")
            crc = zlib.crc32(bytes(payload), zlib.crc32(prompt_blocks._encode(header, None)))
            entry.write_bytes(prompt_blocks._encode(header, crc) + bytes(payload))


@pytest.mark.parametrize("how", ["bit flip", "truncated", "huge header", "huge tensor", "directory", "ids"])
def test_hostile_entries_give_the_reference_text(how, loaded, tmp_path, capsys):
    model, tokenizer = loaded("llama")
    rows = rows_for(tokenizer, PROMPTS[:2])
    reference = {row.id: alone(model, tokenizer, row) for row in rows}
    run(model, tokenizer, rows, disk_cache(model, tmp_path))
    _hostile(tmp_path, how)
    again = disk_cache(model, tmp_path, verbose=True)
    got, _ = run(model, tokenizer, rows, again)
    assert got == reference
    assert again.disk is not None and again.disk.skipped > 0 and again.stats.from_disk == 0
    assert "prompt cache:" in capsys.readouterr().err  # noted under --verbose
    # Skipped entries were deleted and written again: a third run reads them all.
    third = disk_cache(model, tmp_path)
    got, stats = run(model, tokenizer, rows, third)
    assert got == reference and stats.prefill_computed == 0 and third.disk.skipped == 0  # type: ignore[union-attr]


def test_read_only_directory_and_full_disk(loaded, tmp_path, monkeypatch):
    """Nothing can be written (a read-only directory; a disk that fills midway through a write): the text
    is the reference's, no partial file is left, and the run stops trying to write."""
    model, tokenizer = loaded("llama")
    rows = rows_for(tokenizer, PROMPTS[:2])
    reference = {row.id: alone(model, tokenizer, row) for row in rows}
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        cache = disk_cache(model, locked)
        got, _ = run(model, tokenizer, rows, cache)
        if os.geteuid() != 0:  # root writes anyway
            assert cache.disk is not None and not cache.disk.writable and cache.disk.written == 0
    finally:
        locked.chmod(0o700)
    assert got == reference
    calls = {"n": 0}
    real = prompt_blocks._write

    def filling(file, data):
        calls["n"] += 1
        if calls["n"] == 3:
            real(file, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        real(file, data)

    monkeypatch.setattr(prompt_blocks, "_write", filling)
    full = tmp_path / "full"
    cache = disk_cache(model, full)
    got, _ = run(model, tokenizer, rows, cache)
    assert got == reference and cache.disk is not None and not cache.disk.writable
    assert [p.name for p in full.rglob("*") if p.is_file() and not p.name.endswith(".lmpb")] == []  # no partials
    monkeypatch.undo()
    after = disk_cache(model, full)
    got, _ = run(model, tokenizer, rows, after)
    assert got == reference and after.disk is not None and after.disk.skipped == 0  # complete entries only


def test_size_bound_keeps_the_most_recent(loaded, tmp_path):
    """Many distinct prompts through a small bound: the directory stays within it, and the entries kept
    are the last ones written (a prompt run last is read back whole)."""
    model, tokenizer = loaded("llama")
    one_block = sum(t.nbytes for t in _block_tensors(model))
    bound = 40 * one_block
    prompts = [f"prompt number {i} with its own words, distinct from every other one" for i in range(12)]
    rows = rows_for(tokenizer, prompts, new=2)
    cache = PrefixCache(block=BLOCK, disk=BlockStore(tmp_path, "k", max_bytes=bound), vocab=model.config.vocab_size)
    run(model, tokenizer, rows, cache)
    sizes = [p.stat().st_size for p in tmp_path.rglob("*.lmpb")]
    assert cache.disk is not None and cache.disk.evicted > 0 and sum(sizes) <= bound
    fresh = PrefixCache(block=BLOCK, disk=BlockStore(tmp_path, "k", max_bytes=bound), vocab=model.config.vocab_size)
    got, stats = run(model, tokenizer, rows[-1:], fresh)
    assert got == {rows[-1].id: alone(model, tokenizer, rows[-1])}
    assert stats.prefill_computed == 0  # the most recent prompt survived
    got, stats = run(model, tokenizer, rows[:1], fresh)
    assert got == {rows[0].id: alone(model, tokenizer, rows[0])} and stats.prefill_computed > 0  # the oldest did not


def test_a_new_process_trims_the_least_recently_used_first(loaded, tmp_path):
    """Entries another process wrote (none used by this one): a trim deletes the oldest by last use (the
    file's time) first, and keeps the newest."""
    model, _ = loaded("llama")
    shapes = [prompt_blocks.Shape(t.dtype, tuple(t.shape)) for t in _block_tensors(model)]
    writer = BlockStore(tmp_path, "k")
    for i in range(6):
        assert writer.save(bytes([i]) * 8, list(range(i, i + BLOCK)), 0, [torch.zeros(s.shape, dtype=s.dtype) for s in shapes])
    paths = [writer.path(bytes([i]) * 8) for i in range(6)]
    for i, path in enumerate(paths):  # last used in the order 3, 5, 0, 1, 4, 2
        os.utime(path, (1_000_000 + [2, 3, 5, 0, 4, 1][i], 1_000_000 + [2, 3, 5, 0, 4, 1][i]))
    size = paths[0].stat().st_size
    BlockStore(tmp_path, "k").trim(3 * size)
    assert [path.exists() for path in paths] == [False, True, True, False, True, False]


def test_a_prefix_longer_than_the_memory_bound_reads_what_fits(loaded, tmp_path):
    """Blocks read from disk are held in memory too: a prefix whose blocks exceed the memory bound takes
    what fits (never evicting a block it is about to use) and computes the rest, with the reference's tokens."""
    model, tokenizer = loaded("llama")
    [row] = rows_for(tokenizer, [LONG * 2])
    reference = {row.id: alone(model, tokenizer, row)}
    run(model, tokenizer, [row], disk_cache(model, tmp_path))
    one_block = sum(t.nbytes for t in _block_tensors(model))
    small = PrefixCache(max_bytes=6 * one_block, block=BLOCK, disk=BlockStore(tmp_path, _key_of(model)),
                        vocab=model.config.vocab_size)
    got, stats = run(model, tokenizer, [row], small)
    assert got == reference and 0 < small.stats.from_disk <= 6 * BLOCK and stats.prefill_computed > 0


def _key_of(model) -> str:
    return disk_cache(model, Path("unused")).disk.key_digest  # type: ignore[union-attr]


def _block_tensors(model):
    config = model.config
    return [torch.empty(config.num_key_value_heads, BLOCK, config.head_dim, dtype=model.dtype)
            for _ in range(2 * config.num_hidden_layers)]


RACER = textwrap.dedent("""
    import sys
    import torch
    import lmcli
    from lmcli.generation.continuous import ContinuousRun
    from lmcli.generation.prefix_cache import prefix_cache_for
    from lmcli.generation.rows import prepare_row
    from lmcli.settings.generation_settings import GenerationSettings
    torch.set_num_threads(1)
    model, tokenizer = lmcli.load(sys.argv[1], quantize="int4")
    row = prepare_row(tokenizer, 0, sys.argv[2], GenerationSettings().for_row({"temperature": 0, "max_new_tokens": 6}))
    got = []
    run = ContinuousRun(model, tokenizer, 1, on_done=lambda r: got.append(r.tokens), alone=None,
                        prefix_cache=prefix_cache_for(model))
    run.run([row], None)
    print(got[0])
""")


@pytest.mark.full  # three processes loading the model: about 12 s
def test_two_processes_racing_on_one_prefix(loaded, tiny_checkpoint, tmp_path):
    """Two processes write the same prefix's blocks into one directory at once: each gets the reference's
    tokens, and a third reads every block back whole."""
    model, tokenizer = loaded("llama")
    [row] = rows_for(tokenizer, [LONG * 2], new=6)
    row = dataclasses.replace(row, settings=GenerationSettings().for_row({"temperature": 0, "max_new_tokens": 6}))
    reference = alone(model, tokenizer, row)
    env = subprocess_env(LMCLI_PROMPT_CACHE=str(tmp_path))
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tiny_checkpoint), LONG * 2], env=env, cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for racer in racers:
        out, err = racer.communicate(timeout=240)
        assert racer.returncode == 0, err
        assert out.strip() == str(reference)
    third = subprocess.run([sys.executable, "-c", RACER, str(tiny_checkpoint), LONG * 2], env=dict(
        env, LMCLI_VERBOSE="1"), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert third.returncode == 0 and third.stdout.strip() == str(reference)
    assert "not used" not in third.stderr
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]  # no temporaries left


def test_prefix_cache_for_has_the_disk_tier_by_default(loaded, tmp_path, monkeypatch):
    model, _ = loaded("llama")
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(prompt_blocks.DIR_ENV, raising=False)
    prefix = prefix_cache_for(model)
    assert prefix is not None and prefix.disk is not None and prefix.disk.directory == tmp_path / "prompts"
    assert prefix.disk.max_bytes == 2 << 30
    monkeypatch.setenv(prompt_blocks.DIR_ENV, "off")
    assert disk_store_for(model) is None
    monkeypatch.setenv(prompt_blocks.DIR_ENV, str(tmp_path / "elsewhere"))
    monkeypatch.setenv(prompt_blocks.SIZE_ENV, "3M")
    store = disk_store_for(model)
    assert store is not None and store.directory == tmp_path / "elsewhere" and store.max_bytes == 3 << 20


# --- the commands -------------------------------------------------------------------------------------------

SYSTEM = "You are the help desk of a small library; answer in one short sentence. " * 3


def _job(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"q{i}", "system": SYSTEM, "prompt": q, "max_new_tokens": 5,
                                        "temperature": [0, 0.8][i % 2], "seed": i}) + "\n"
                            for i, q in enumerate(questions)), encoding="utf-8")
    return path


def _completions(path: Path) -> dict[str, str]:
    return {row["id"]: row["completion"] for row in map(json.loads, path.read_text().splitlines())}


def test_job_run_twice_computes_only_what_is_new(tiny_checkpoint, tmp_path):
    """A job with a shared system message, run a second time (a new process's cache: from disk), computes
    none of its prefill, and its rows equal the cache-off run's; `--stats` says where the tokens came from."""
    runner = CliRunner()
    source = _job(tmp_path / "in.jsonl", ["Hi.", "Name a colour.", "What is two and two?"])
    common = ["generate", "-c", str(tiny_checkpoint), "-q", "int4", "--chat", "--input", str(source), "--stats"]
    outs = {}
    for name, cache in (("off", "off"), ("first", str(tmp_path / "p")), ("second", str(tmp_path / "p"))):
        outs[name] = tmp_path / f"{name}.jsonl"
        result = runner.invoke(app, [*common, "--output", str(outs[name]), "--prompt-cache", cache])
        assert result.exit_code == 0, result.output
        if name == "second":
            found = re.search(r"prefill (\d+) of (\d+) tokens computed", result.stderr)
            assert found is not None, result.stderr
            computed, requested = map(int, found.groups())
            assert computed <= requested // 20 and "from disk" in result.stderr, result.stderr
            assert f"prompt cache: {tmp_path / 'p'}" in result.stderr
    assert _completions(outs["first"]) == _completions(outs["off"]) == _completions(outs["second"])


def test_generate_twice_and_the_flags(tiny_checkpoint, tmp_path):
    """generate with a shared system message: the second run's text equals the cache-off run's and it reads
    the shared blocks from disk; a bad --prompt-cache-size is one usage line."""
    runner = CliRunner()
    cache = str(tmp_path / "p")
    common = ["generate", "-c", str(tiny_checkpoint), "-q", "int4", "--chat", "--system", SYSTEM, "-n", "6",
              "--seed", "3", "--stats"]
    runner.invoke(app, [*common, "--prompt-cache", cache, "Hello there."])
    want = runner.invoke(app, [*common, "--prompt-cache", "off", "Name a colour."])
    got = runner.invoke(app, [*common, "--prompt-cache", cache, "--prompt-cache-size", "1G", "Name a colour."])
    assert got.exit_code == 0 and got.stdout == want.stdout and want.stdout.strip()
    assert "from disk" in got.stderr and "from disk" not in want.stderr
    bad = runner.invoke(app, [*common, "--prompt-cache-size", "lots", "x"])
    assert bad.exit_code == 2 and "--prompt-cache-size lots" in bad.stderr


def _fresh_reply(model, tokenizer, messages, new: int) -> list[int]:
    """`model.generate` over the whole rendered conversation, greedy: what a chat turn must give."""
    ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=tokenizer.eos_token_ids)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("case", ["llama", "window"])
def test_chat_resumed_from_a_transcript_restores_its_blocks(case, loaded, tmp_path):
    """A chat saved (/save: the transcript, and its blocks kept) and resumed in a new session with a new
    prompt cache over the same directory: its next reply is what model.generate gives the whole conversation,
    and the conversation comes from disk, all but the last few tokens (the sliding-window model runs past its
    window of 8)."""
    from lmcli.chat.session import ChatSession, load_transcript

    model, tokenizer = loaded(case)
    settings = GenerationSettings.from_flags(greedy=True, max_new_tokens=6, chat=True)
    system = "a system message long enough to fill a few blocks of tokens"
    session = ChatSession(model, tokenizer, settings, context=256, system=system,
                          prefix_cache=disk_cache(model, tmp_path))
    for text in ("hello there", "and a second question"):
        session.reply(text)
    session.save(tmp_path / "t.json", {})
    assert session.keep_blocks() > 0
    saved = load_transcript(tmp_path / "t.json")
    resumed = ChatSession(model, tokenizer, settings, context=256, messages=saved["messages"],
                          prefix_cache=disk_cache(model, tmp_path))
    turn = resumed.reply("a third one")
    assert turn.result.tokens == _fresh_reply(model, tokenizer, [*saved["messages"],
                                                                 {"role": "user", "content": "a third one"}], 6)
    assert turn.from_disk == turn.prompt_tokens - turn.prefill_tokens and turn.prefill_tokens < turn.prompt_tokens // 3
    assert resumed.prefix_cache is not None and not resumed.prefix_cache.unusable


def test_cache_command_shows_and_clears(tmp_path, monkeypatch):
    """`lmcli cache` lists the three caches with their sizes (counted here independently, with os.walk's
    sizes); `cache clear --prompts` empties only the prompt blocks; `cache clear` the rest."""
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LMCLI_PROMPT_CACHE", raising=False)
    for kind, names in (("packed", ["a.lmpk"]), ("compiled", ["e/program.pt2", "e/entry.json"]),
                        ("prompts", ["ab/ab12.lmpb", "cd/cd34.lmpb", "cd/cd56.lmpb"])):
        for name in names:
            (tmp_path / kind / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / kind / name).write_bytes(b"x" * 1000)
    runner = CliRunner()
    shown = runner.invoke(app, ["cache"])
    assert shown.exit_code == 0, shown.output
    assert f"prompt blocks: 3 files, 2.9 KiB ({tmp_path / 'prompts'})" in shown.stdout
    assert "packed weights: 1 file, 1000 bytes" in shown.stdout and "compiled programs: 2 files" in shown.stdout
    cleared = runner.invoke(app, ["cache", "clear", "--prompts"])
    assert cleared.exit_code == 0 and "prompt blocks: removed 3 files" in cleared.stdout
    assert not (tmp_path / "prompts").exists() and (tmp_path / "packed" / "a.lmpk").exists()
    assert runner.invoke(app, ["cache", "clear"]).exit_code == 0
    assert not (tmp_path / "packed").exists() and not (tmp_path / "compiled").exists()
    assert "prompt blocks: off" in runner.invoke(app, ["cache", "--prompt-cache", "off"]).stdout
    wrong = runner.invoke(app, ["cache", "--prompts"])
    assert wrong.exit_code == 2 and "cache clear" in wrong.stderr


# --- the real models ------------------------------------------------------------------------------------------


def _real_rows(tokenizer, opening: str, chat: bool):
    settings = GenerationSettings(chat=chat, system=opening if chat else None)
    questions = ["Hi.", "Name a colour.", "What is 2+2?"]
    return [prepare_row(tokenizer, i, question if chat else opening + question,
                        settings.for_row({"temperature": [0, 0.7][i % 2], "seed": i, "max_new_tokens": 4}))
            for i, question in enumerate(questions)]


@pytest.mark.full
@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_real_models_cold_and_warm_disk_equal_generate(name, request, tmp_path, monkeypatch):
    """The real default model (chat rows sharing a system message) and Gemma 3 (plain prompts sharing an
    opening past its sliding layers' 512-token window): rows from a cold and a warm-disk cache equal
    model.generate's on each row alone, greedy and sampled."""
    path = request.getfixturevalue(f"{name}_gguf")
    model, tokenizer = lmcli.load(path)
    assert model.batch_invariant
    monkeypatch.setenv("LMCLI_PROMPT_CACHE", str(tmp_path))
    if name == "gemma":
        rows = _real_rows(tokenizer, "A long opening about rivers, lakes and the sea. " * 52, chat=False)
        assert len(rows[0].prompt_ids) > model.config.sliding_window
    else:
        rows = _real_rows(tokenizer, "You answer briefly and precisely. " * 8, chat=True)
    reference = {row.id: alone(model, tokenizer, row) for row in rows}
    cold = prefix_cache_for(model)
    assert cold is not None and cold.disk is not None
    got, _ = run(model, tokenizer, rows, cold)
    assert got == reference
    warm = prefix_cache_for(model)
    got, stats = run(model, tokenizer, rows, warm)
    assert got == reference and stats.prefill_computed == 0 and warm.stats.from_disk > 0  # type: ignore[union-attr]


def test_thread_count_is_left_out_of_the_key_because_it_changes_no_number(loaded):
    """Where rows are batch-invariant (the only place the prompt cache is used by default) the key leaves the
    thread count out: keys, values and logits of a prefill are bit for bit the same on 1 and 2 threads."""
    model, tokenizer = loaded("llama")
    ids = tokenizer.encode(LONG)
    n = len(ids)
    x, slots = torch.tensor([ids]), torch.arange(n)
    results = []
    for count in (1, 2, 1):
        torch.set_num_threads(count)
        try:
            with torch.inference_mode():
                cache = model.init_cache(1, n, rollback=n)
                logits = model.forward_slots(x, slots[None], slots, torch.ones(1, n, dtype=torch.bool), cache,
                                             last_only=False, numerics=model.numerics)
            results.append((logits, [layer.keys.clone() for layer in cache.layers]))
        finally:
            torch.set_num_threads(1)
    for logits, keys in results[1:]:
        assert torch.equal(logits, results[0][0]) and all(torch.equal(a, b) for a, b in zip(keys, results[0][1]))
    assert numerics_key(model)["threads"] == "any"  # type: ignore[index]
