"""Start-up paths the earlier tests did not exercise (found by the planted-bug audit, docs/testing.md):
a packed entry asked for under other load settings (--dtype, --fast-kernels, --quantize), damage in a
tensor's last page, and a durable atomic write's order of fsync and rename.

Each load through the packed cache is compared with a load that reads the GGUF (LMCLI_PACKED_CACHE=0,
the path test_gguf checks against transformers) under the same settings, and with the values the test
asked for (the activation dtype, the kernel); the writes with an `os.fsync` spy and the bytes the test wrote.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_startup_packed import FIELDS, PROMPT, _entries, _with_vocabulary, cache, kernel_probes, tiny_gguf  # noqa: F401
from tiny import random_reference

gguf = pytest.importorskip("gguf")
from test_gguf import write_gguf_like_llama_cpp  # noqa: E402

import lmcli  # noqa: E402
from lmcli.io import atomic, packed_cache  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _load(path, packed: bool, **options):
    """(model, logits of PROMPT) from lmcli.load(path, **options), through the packed cache or not."""
    previous = os.environ.get(packed_cache.ENV)
    os.environ[packed_cache.ENV] = "1" if packed else "0"
    try:
        model, _ = lmcli.load(path, **options)
    finally:
        os.environ[packed_cache.ENV] = previous if previous is not None else "1"
    with torch.inference_mode():
        return model, model.forward(PROMPT)


def test_dtype_float32_after_a_start_without_it_runs_in_float32(tiny_gguf, cache, capfd, monkeypatch):
    """The entry of a default (bfloat16-activation) start is not what `--dtype float32` loads. (Kernels
    forced, here and below, so that no kernel is probed in a child process: seconds on a busy machine.)"""
    monkeypatch.setenv("LMCLI_KERNEL", "dequantise")
    _load(tiny_gguf, packed=True)  # the default start's entry
    assert len(_entries(cache)) == 1
    model, got = _load(tiny_gguf, packed=True, dtype="float32")
    assert model.activation_dtype in (None, torch.float32)  # what the test asked for (None: the residual's, float32)
    _, want = _load(tiny_gguf, packed=False, dtype="float32")
    assert torch.equal(got, want)
    _, again = _load(tiny_gguf, packed=True, dtype="float32")  # now from its own entry
    assert torch.equal(again, want)
    assert "packed weights not used" not in capfd.readouterr().err


def test_quantize_int8_on_a_gguf_is_not_served_the_files_own_quantization(tiny_gguf, cache, monkeypatch):
    monkeypatch.setenv("LMCLI_KERNEL", "int4pack")  # int4pack for int4 weights, int4pair for int8
    _load(tiny_gguf, packed=True)  # the GGUF's own Q4_0 layers, packed
    model, got = _load(tiny_gguf, packed=True, quantize="int8")
    _, want = _load(tiny_gguf, packed=False, quantize="int8")
    assert torch.equal(got, want)
    assert {m.kernel.name for m in model.modules() if hasattr(m, "kernel")} == {"int4pair"}  # int8 only


def test_fast_kernels_after_a_start_without_them_is_not_batch_invariant(tiny_gguf, cache, monkeypatch, capfd):
    """--fast-kernels (LMCLI_FAST_KERNELS=1) is the measured plan, not the batch-invariant one
    (kernels/plan.py): an entry made without it must not make the model batch-invariant. The
    kernels are forced (LMCLI_KERNEL, the same at both starts), so the plans agree and nothing is measured."""
    monkeypatch.setenv("LMCLI_KERNEL", "int4pack")
    _load(tiny_gguf, packed=True)
    monkeypatch.setenv("LMCLI_FAST_KERNELS", "1")
    from_gguf, _ = _load(tiny_gguf, packed=False)
    capfd.readouterr()
    model, _ = _load(tiny_gguf, packed=True)
    assert not from_gguf.batch_invariant and not model.batch_invariant
    assert model.kernel_choices == from_gguf.kernel_choices
    assert "packed weights not used" not in capfd.readouterr().err  # a fresh entry of its own, not a refused one


@pytest.fixture
def wide_gguf(tmp_path, monkeypatch):
    """A llama whose packed entry (about 3 MB) is larger than the checksum's 32 spread pieces cover, so
    that a tensor's last page is checked only as that page."""
    fields = dict(FIELDS, vocab_size=4096, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                  num_key_value_heads=2, attention_bias=False)
    model = random_reference("llama", fields)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    _with_vocabulary(monkeypatch, fields["vocab_size"])
    return write_gguf_like_llama_cpp(tmp_path / "wide.gguf", model.config.to_dict(), state, "llama",
                                     qtype=lambda name, w: gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight"
                                     else gguf.GGMLQuantizationType.Q4_0)


def test_damage_in_any_tensors_last_page_is_refused(wide_gguf, cache, monkeypatch):
    """Each tensor's last byte flipped in turn: the entry is refused every time (io/packed_cache.py
    checksums every byte; an older one sampled each tensor's first and last page)."""
    import json

    monkeypatch.setenv("LMCLI_KERNEL", "int4pack")
    _load(wide_gguf, packed=True)
    (entry,) = _entries(cache)
    original = entry.read_bytes()
    length = int.from_bytes(original[8:16], "little")
    header = json.loads(original[16:16 + length])
    start = -(-(16 + length) // packed_cache.ALIGN) * packed_cache.ALIGN
    assert header["data_bytes"] > 32 * (1 << 16)  # room between the 32 pieces an older checksum sampled
    key = header["key"]
    for tensor in header["tensors"]:
        damaged = bytearray(original)
        damaged[start + tensor["offset"] + tensor["nbytes"] - 1] ^= 0x01
        entry.write_bytes(bytes(damaged))
        assert packed_cache.open_entry(entry, key) is None, tensor
        assert not entry.exists()  # deleted, to be written again
    entry.write_bytes(original)
    assert packed_cache.open_entry(entry, key) is not None  # the undamaged entry passes


def test_a_durable_write_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """An os.fsync spy: the temporary's bytes are synced before os.replace puts it at the target."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(source, target):
        events.append(("replace", os.path.basename(source)))
        real_replace(source, target)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    target = tmp_path / "out.jsonl"
    atomic.write_atomically(target, b'{"id": 1}\n', durable=True)
    assert target.read_bytes() == b'{"id": 1}\n'
    assert [kind for kind, _ in events] == ["fsync", "replace"], events
    assert events[0][1] == events[1][1] and events[0][1].startswith(".out.jsonl.partial-")
