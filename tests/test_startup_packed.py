"""The packed cache (lmcli/io/packed_cache.py): a GGUF model loaded once is mapped back at later starts.

Each check compares a load through the cache with a load that reads the GGUF (LMCLI_PACKED_CACHE=0,
the path test_gguf and test_real_models check against transformers): the same logits bit for bit and
the same tokens. The cache's faults: an entry made under another key, damaged bytes, a cut-short file,
a writer killed midway, two writers at once, a read-only cache; and the memory bound on a start that
maps an entry.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from real_models import SMOLLM2_PROMPT, smollm2_gguf  # noqa: F401
from tiny import BASE, random_reference

gguf = pytest.importorskip("gguf")
from test_gguf import write_gguf_like_llama_cpp  # noqa: E402

import lmcli  # noqa: E402
from lmcli.io import packed_cache  # noqa: E402
from lmcli.kernels.linear import QuantEmbedding, QuantLinear  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[1, 5, 9, 14, 3, 77, 42, 8, 60]])
FIELDS = dict(BASE, vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              tie_word_embeddings=True, attention_bias=True)


@pytest.fixture(scope="module")
def kernel_probes(tmp_path_factory) -> Path:
    """Where the kernel probes' results (kernels.json) are kept between this module's fresh caches, so
    each cache (and each child process) does not probe again in child processes of its own."""
    return tmp_path_factory.mktemp("probes") / "kernels.json"


@pytest.fixture
def cache(tmp_path, monkeypatch, kernel_probes):
    """A fresh lmcli cache with the packed cache on (the suite runs with it off: conftest.py)."""
    directory = tmp_path / "cache"
    if kernel_probes.is_file():
        directory.mkdir()
        shutil.copy(kernel_probes, directory / "kernels.json")
    monkeypatch.setenv("LMCLI_CACHE_DIR", str(directory))
    monkeypatch.setenv(packed_cache.ENV, "1")
    yield directory
    if (directory / "kernels.json").is_file() and directory.is_dir():
        shutil.copy(directory / "kernels.json", kernel_probes)


def _with_vocabulary(monkeypatch, size: int) -> None:
    """GGUF files written in this test carry a byte-level vocabulary of `size` tokens."""
    tokens = [chr(0x21 + i) for i in range(94)] + ["$%"]  # "$%": what the one merge makes
    tokens += [f"<t{i}>" for i in range(len(tokens), size)]

    class WithVocabulary(gguf.GGUFWriter):  # type: ignore[name-defined]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_tokenizer_model("gpt2")
            self.add_token_list(tokens)
            self.add_token_types([1] * size)
            self.add_token_merges(["$ %"])

    monkeypatch.setattr(gguf, "GGUFWriter", WithVocabulary)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch) -> Path:
    """A tiny llama: its layers Q4_0 (int4pack), its tied embedding Q8_0 (int4pair), biases in F32."""
    model = random_reference("llama", FIELDS)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    hf = model.config.to_dict()
    _with_vocabulary(monkeypatch, FIELDS["vocab_size"])
    kinds = {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0}
    return write_gguf_like_llama_cpp(tmp_path / "tiny.gguf", hf, state, "llama",
                                     qtype=lambda name, w: kinds.get(name, gguf.GGMLQuantizationType.Q4_0))


def _logits(path: Path, packed: bool = True) -> tuple[torch.Tensor, list[int]]:
    previous = os.environ.get(packed_cache.ENV)
    os.environ[packed_cache.ENV] = "1" if packed else "0"
    try:
        model, tokenizer = lmcli.load(path)
    finally:
        os.environ[packed_cache.ENV] = previous if previous is not None else "1"
    ids = PROMPT if model.config.vocab_size < 1000 else torch.tensor([SMOLLM2_PROMPT])
    with torch.inference_mode():
        logits = model.forward(ids)
    return logits, tokenizer.encode("#$%&'()*+") if tokenizer is not None else []


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "packed").glob("*.lmpk"))


def test_a_second_load_maps_the_first_ones_result_and_computes_the_same(tiny_gguf, cache, capfd):
    want, want_ids = _logits(tiny_gguf, packed=False)
    assert not _entries(cache)
    first, _ = _logits(tiny_gguf)
    (entry,) = _entries(cache)
    second, ids = _logits(tiny_gguf)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert ids == want_ids
    assert "packed weights not used" not in capfd.readouterr().err
    model, _ = lmcli.load(tiny_gguf)  # served from the entry: its kernels' buffers are the file's pages
    quantized = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    buffers = [b for m in quantized for b in m.kernel.buffers()]
    assert buffers and all(_in_mapping_of(entry, b) for b in buffers)
    # int8 weights: torch's int4pair, or lmcli's native kernel where it builds (kernel_plan.NATIVE_DEFAULT)
    assert {m.kernel.name for m in quantized} == {"int4pack", model.kernel_choices["int8"].kernel}
    assert model.kernel_choices["int8"].kernel in ("int4pair", "native")
    assert model.kernel_choices and model.batch_invariant
    from lmcli.console import describe_cache

    assert "its loaded weights, packed, " in describe_cache(tiny_gguf) and entry.name in describe_cache(tiny_gguf)


def _in_mapping_of(path: Path, tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory lies in this process's mapping of `path` (/proc/self/maps)."""
    start = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            if low <= start < high:
                return True
    return False


# Two damages in `make test` (a data byte: the checksum; a header's length: the bound before any read);
# the other six refusals run in `make test-full` (each is a subprocess-sized load of its own).
@pytest.mark.parametrize("damage", ["flip a data byte", "huge header length", *(
    pytest.param(damage, marks=pytest.mark.full) for damage in ["cut short", "garbage header", "foreign key",
                                                                "a setting over a method", "a module over a method",
                                                                "empty"])])
def test_a_damaged_or_foreign_entry_is_refused_and_rebuilt(damage, tiny_gguf, cache, capfd):
    want, _ = _logits(tiny_gguf, packed=False)
    _logits(tiny_gguf)
    (entry,) = _entries(cache)
    original = entry.read_bytes()
    data = bytearray(original)
    length = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + length])
    start = -(-(16 + length) // packed_cache.ALIGN) * packed_cache.ALIGN
    if damage == "flip a data byte":  # the first byte of a tensor: in a checksummed piece
        data[start + header["tensors"][3]["offset"]] ^= 0x10
    elif damage == "cut short":
        del data[-100:]
    elif damage == "garbage header":
        data[20:40] = b"\xff" * 20
    elif damage == "huge header length":
        data[8:16] = (1 << 62).to_bytes(8, "little")
    elif damage in ("foreign key", "a setting over a method", "a module over a method"):
        if damage == "foreign key":  # a well-formed entry made for another torch, at this key's name
            header["key"]["torch"] = "0.0"
        elif damage == "a setting over a method":
            header["kernels"][0]["settings"]["matmul"] = 1
        else:
            header["modules"][0]["path"] = "model.forward"
        body = json.dumps(header, sort_keys=True).encode()
        head = packed_cache.MAGIC + len(body).to_bytes(8, "little") + body
        padded = head + bytes(-len(head) % packed_cache.ALIGN)
        data = bytearray(padded + data[start:])  # the same data (and checksum) after the new header
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    capfd.readouterr()
    got, _ = _logits(tiny_gguf)
    assert torch.equal(got, want)
    note = capfd.readouterr().err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith(f"note: {entry.name}: packed weights not used"), note
    (rebuilt,) = _entries(cache)  # written again, whole
    assert rebuilt.read_bytes() == original
    again, _ = _logits(tiny_gguf)
    assert torch.equal(again, want)
    assert "not used" not in capfd.readouterr().err


def test_a_changed_file_gets_a_new_entry_and_the_old_one_goes(tiny_gguf, cache, monkeypatch):
    _logits(tiny_gguf)
    (old,) = _entries(cache)
    model = random_reference("llama", FIELDS, seed=5)  # another model at the same path
    _with_vocabulary(monkeypatch, FIELDS["vocab_size"])
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    write_gguf_like_llama_cpp(tiny_gguf, model.config.to_dict(), state, "llama",
                              qtype=lambda name, w: gguf.GGMLQuantizationType.Q4_0)
    want, _ = _logits(tiny_gguf, packed=False)
    got, _ = _logits(tiny_gguf)
    (new,) = _entries(cache)
    assert new != old and torch.equal(got, want)


_KILLED_WRITER = """
import os, signal, sys
import lmcli
from lmcli.io import packed_cache
real_fsync = os.fsync
def killed(fd):  # the entry's bytes are written, its header not yet renamed into place
    os.kill(os.getpid(), signal.SIGKILL)
os.fsync = killed
lmcli.load(sys.argv[1])
"""

_LOADER = """
import sys, torch, lmcli
model, _ = lmcli.load(sys.argv[1])
with torch.inference_mode():
    torch.save(model.forward(torch.tensor([[1, 5, 9, 14, 3, 77, 42, 8, 60]])), sys.argv[2])
"""


def _child(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_writer_killed_midway_leaves_nothing_that_looks_complete(tiny_gguf, cache):
    child = _child(_KILLED_WRITER, str(tiny_gguf))
    child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL
    assert not _entries(cache)
    assert [p.name for p in (cache / "packed").iterdir() if ".partial-" in p.name]  # the temporary only
    want, _ = _logits(tiny_gguf, packed=False)
    got, _ = _logits(tiny_gguf)  # loads from the GGUF, writes the entry, removes the dead writer's temporary
    assert torch.equal(got, want)
    assert [p.name for p in (cache / "packed").iterdir()] == [_entries(cache)[0].name]


@pytest.mark.full  # two child processes loading at once: half a minute on two busy cores
def test_two_processes_writing_at_once_leave_one_good_entry(tiny_gguf, cache, tmp_path):
    children = [_child(_LOADER, str(tiny_gguf), str(tmp_path / f"{i}.pt")) for i in range(2)]
    for child in children:
        _, err = child.communicate(timeout=300)
        assert child.returncode == 0, err.decode()[-1000:]
    want, _ = _logits(tiny_gguf, packed=False)
    assert all(torch.equal(torch.load(tmp_path / f"{i}.pt"), want) for i in range(2))
    assert len(_entries(cache)) == 1
    got, _ = _logits(tiny_gguf)  # the one left is whole and used
    assert torch.equal(got, want)


def test_a_cache_that_cannot_be_written_loads_from_the_gguf_with_one_warning(tiny_gguf, cache, capfd):
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "packed").write_text("a file where the entries' directory should be\n")  # as a read-only one: OSError
    capfd.readouterr()
    got, _ = _logits(tiny_gguf)
    warning = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(warning) == 1 and warning[0].startswith(f"warning: cannot keep the packed weights in {cache / 'packed'}"), warning
    assert torch.equal(got, _logits(tiny_gguf, packed=False)[0])


@pytest.mark.full  # (make test keeps test_a_cache_that_cannot_be_written_loads_from_the_gguf_with_one_warning)
def test_a_write_that_fails_loads_from_the_gguf_with_one_warning(tiny_gguf, cache, capfd, monkeypatch):
    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packed_cache.os, "fsync", full_disk)
    capfd.readouterr()
    got, _ = _logits(tiny_gguf)
    warning = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert warning == [f"warning: cannot keep the packed weights in {cache / 'packed'} ([Errno 28] No space left "
                       "on device); the next start loads from the GGUF again"]
    assert not _entries(cache)
    assert torch.equal(got, _logits(tiny_gguf, packed=False)[0])


def test_the_default_model_from_its_entry_gives_the_same_logits_and_tokens(smollm2_gguf, cache):
    want, want_ids = _logits(smollm2_gguf, packed=False)
    _logits(smollm2_gguf)
    got, ids = _logits(smollm2_gguf)
    assert _entries(cache) and torch.equal(got, want) and ids == want_ids


@pytest.mark.full  # three child processes (test_memory checks the first start in `make test`)
def test_a_start_from_the_entry_stays_within_the_memory_bound(smollm2_gguf, cache, tmp_path, monkeypatch):
    from test_memory import _IMPORT_TORCH, _check_bound, _run

    torch_bytes = int(_run(_IMPORT_TORCH, cache_dir=tmp_path / "bare"))
    _logits(smollm2_gguf)  # the entry, written by this process
    assert _entries(cache)
    _check_bound(smollm2_gguf, torch_bytes, cache)  # a child starting from it


def test_an_entry_made_under_another_kernel_plan_is_stale(tiny_gguf, cache, capfd):
    from lmcli.kernels.plan import _fixed_choice as fixed_choice

    _logits(tiny_gguf)
    assert len(_entries(cache)) == 1
    original = (cache / "kernels.json").read_text()  # put back at the end: the module's probes are shared
    plans = json.loads(original)
    for machine in plans.values():  # this machine's probe now says: dequantise int4 weights
        for entry, choice in machine.items():  # the key also names the native library ("...|native=...")
            if entry.startswith("fixed|int4|bfloat16"):
                choice["kernel"] = "dequantise"
    (cache / "kernels.json").write_text(json.dumps(plans))
    fixed_choice.cache_clear()
    try:
        capfd.readouterr()
        got, _ = _logits(tiny_gguf)
        assert "the int4 kernel plan changed" in capfd.readouterr().err
        want, _ = _logits(tiny_gguf, packed=False)
        model, _ = lmcli.load(tiny_gguf)  # the entry written again, under the new plan
    finally:
        (cache / "kernels.json").write_text(original)
        fixed_choice.cache_clear()
    assert torch.equal(got, want)
    assert {m.kernel.name for m in model.modules() if isinstance(m, QuantLinear)} >= {"dequantise"}
    assert "int4pack" not in {m.kernel.name for m in model.modules() if isinstance(m, QuantLinear)}


@pytest.mark.full  # ten whole processes on the default model
def test_the_startup_bench_section_times_each_kind_of_start(smollm2_gguf, cache, capsys):
    from rich.console import Console

    from lmcli.bench.settings import BenchSettings
    from lmcli.bench.startup import measure, report
    from lmcli.resolve.model_ref import resolve_model

    result = measure(BenchSettings(repeats=1, prefill_tokens=16), resolve_model(smollm2_gguf), lambda line: None)
    ran = set(result["seconds"])
    assert {"import torch", "lmcli, from the GGUF", "lmcli, packed entry"} <= ran, ran  # every command succeeded
    assert result["first_start"] is not None and result["prefill"]["tokens_per_second"] > 0
    report(result, Console(file=sys.stdout, width=200))
    assert "lmcli, packed entry" in capsys.readouterr().out


def test_an_entry_written_under_another_tokenizer_keeps_the_files_own(tiny_gguf, cache, tmp_path):
    """`--tokenizer` replaces the GGUF's tokenizer for that run: its entry (keyed by that tokenizer too)
    keeps the file's own tokenizer whole, vocabulary and fields alike, and a start from the entry takes
    the run's tokenizer again."""
    from fixtures_tokenizers import build_bpe_dir

    from lmcli.loading import _packed_entry
    from lmcli.resolve.model_ref import resolve_model

    override = build_bpe_dir(tmp_path / "other") / "tokenizer.json"
    previous = os.environ[packed_cache.ENV]
    os.environ[packed_cache.ENV] = "0"
    try:
        _, own = lmcli.load(tiny_gguf)
    finally:
        os.environ[packed_cache.ENV] = previous
    text = "#$%&'()*+"
    _, replaced = lmcli.load(tiny_gguf, tokenizer_path=override)  # writes the entry
    assert replaced.encode(text) != own.encode(text)
    where = _packed_entry(resolve_model(tiny_gguf, None, override), None, None, torch.device("cpu"), None)
    assert where is not None
    entry = packed_cache.open_entry(*where)
    assert entry is not None
    kept = entry.tokenizer()
    assert kept is not None and own is not None and replaced is not None
    assert kept.encode(text) == own.encode(text)
    assert (kept.bos_token, kept.eos_token, kept.chat_template, kept.name, kept.eos_token_ids) == \
        (own.bos_token, own.eos_token, own.chat_template, own.name, own.eos_token_ids)
    _, again = lmcli.load(tiny_gguf, tokenizer_path=override)  # from the entry, with the run's tokenizer
    assert again.encode(text) == replaced.encode(text)
