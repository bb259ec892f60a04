"""Tensor- and data-parallel generation with real `torchrun` processes (gloo on CPU).

Each torchrun launch costs seconds (every rank imports torch), so the architectures share one launch
of tests/distributed_worker.py. The single-process side of each comparison is the ordinary code path,
which tests/test_models_parity.py checks against transformers.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_fixtures import run_lmcli, subprocess_env, tiny_checkpoint  # noqa: F401
from real_models import smollm2_gguf  # noqa: F401
from tiny import CASES, prompts, save_reference
from typer.testing import CliRunner

import lmcli
from lmcli.cli import app
from lmcli.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(ranks: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node RANKS ARGS` on this machine, one thread per rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert result.returncode == 0 or not check, f"torchrun failed:\n{result.stderr[-4000:]}"
    return result


def memory_checkpoint(directory: Path) -> Path:
    """A llama of 250 MB of float32 weights, so per-process memory is dominated by the weights."""
    from safetensors.torch import save_file

    hidden, inner, vocab, layers, heads, kv_heads = 768, 2048, 24000, 4, 12, 4
    head_dim = hidden // heads
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.05

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden), "lm_head.weight": weight(vocab, hidden),
               "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}"
        tensors.update({
            f"{prefix}.self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            f"{prefix}.mlp.gate_proj.weight": weight(inner, hidden),
            f"{prefix}.mlp.up_proj.weight": weight(inner, hidden),
            f"{prefix}.mlp.down_proj.weight": weight(hidden, inner),
            f"{prefix}.input_layernorm.weight": torch.ones(hidden),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden),
        })
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inner,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=256, tie_word_embeddings=False)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tensor_parallel_runs(tmp_path_factory):
    """The worker's results alone and under torchrun with 2 ranks, for the memory model and every
    tiny architecture: greedy past the context with EOS, and sampling with per-row seeds, on a
    left-padded batch."""
    root = tmp_path_factory.mktemp("tp")
    runs = [{"checkpoint": str(memory_checkpoint(root / "memory")), "max_new_tokens": 4, "sampled_tokens": 2}]
    for case in sorted(CASES):
        save_reference(case, root / case)
        # 9 + 58 tokens run past max_position_embeddings (64) of the tiny models.
        runs.append({"checkpoint": str(root / case), "max_new_tokens": 58, "sampled_tokens": 6})
    spec = root / "spec.json"
    spec.write_text(json.dumps({"runs": runs, "prompts": [p.tolist() for p in prompts([5, 9, 3])], "eos_token_id": 2}))
    alone = subprocess.run([sys.executable, str(WORKER), str(spec), str(root / "alone.json")],
                           capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert alone.returncode == 0, alone.stderr[-4000:]
    torchrun(2, str(WORKER), str(spec), str(root / "tp2.json"))
    return json.loads((root / "alone.json").read_text()), json.loads((root / "tp2.json").read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_tokens_equal_single_process(tensor_parallel_runs, case):
    alone, parallel = tensor_parallel_runs
    assert (alone["world_size"], parallel["world_size"]) == (1, 2)
    index = 1 + sorted(CASES).index(case)
    assert Path(parallel["runs"][index]["checkpoint"]).name == case
    assert parallel["runs"][index]["tokens"] == alone["runs"][index]["tokens"]
    assert parallel["runs"][index]["sampled"] == alone["runs"][index]["sampled"]


def test_tensor_parallel_rank_memory_is_about_half(tensor_parallel_runs):
    """Against the checkpoint's own size: a rank holds about half the weights. (One process maps the
    file and pages in only the embedding rows it looks up, so its figure is smaller than the file;
    each rank reads its shard, embedding half included, into memory of its own.)"""
    alone, parallel = tensor_parallel_runs
    [single] = alone["runs"][0]["peak_mib"]
    per_rank = parallel["runs"][0]["peak_mib"]
    weights = Path(alone["runs"][0]["checkpoint"], "model.safetensors").stat().st_size / 2**20
    print(f"\npeak memory rise loading + generating the {weights:.0f} MiB model: one process {single:.0f} MiB, "
          f"--tp 2 ranks {', '.join(f'{m:.0f}' for m in per_rank)} MiB")
    assert len(per_rank) == 2
    assert single > 0.6 * weights  # every layer is there at least once (the embedding is 30% of the file)
    assert all(m < 0.6 * weights and m < single for m in per_rank)


def test_split_is_checked_before_any_weight_is_read(tmp_path):
    save_reference("llama", tmp_path)  # 4 query heads, 2 key/value heads
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match=r"--tp 3: the model's 4 query heads and 2 key/value heads do not divide"):
        lmcli.load(tmp_path, tp=3)


def test_tp_needs_torchrun_and_safetensors(tmp_path, tiny_checkpoint):
    result = CliRunner().invoke(app, ["generate", "-c", str(tiny_checkpoint), "--tp", "2", "--greedy", "hi"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: --tp 2 needs 2 processes started by torchrun (torchrun --nproc-per-node 2 -m lmcli generate --tp 2 ...)"
    ]
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(UsageError, match=r"--tp 2: .*model\.gguf is a GGUF file; tensor parallel reads float "
                                         r"safetensors \(convert it first: lmcli convert"):
        lmcli.load(gguf, tp=2)


@pytest.mark.full  # minutes: make test-full
def test_smollm2_tp3_equals_single_process(tmp_path, smollm2_gguf):
    """SmolLM2-135M (9 query, 3 key/value heads) dequantised to a float HF directory, --tp 3."""
    converted = run_lmcli("convert", str(smollm2_gguf), str(tmp_path / "smollm2"), timeout=600)
    assert converted.returncode == 0, converted.stderr
    args = ["generate", "-c", str(tmp_path / "smollm2"), "--greedy", "-n", "32", "The capital of France is"]
    single = run_lmcli(*args, timeout=600)
    assert single.returncode == 0, single.stderr
    parallel = torchrun(3, "-m", "lmcli", *args, "--tp", "3")
    print(f"\n--tp 3 output: {parallel.stdout!r}")
    assert len(single.stdout.decode()) > 20 and parallel.stdout == single.stdout.decode()



def test_lazy_tensor_reads_the_part_of_a_renamed_view(tmp_path):
    """GPT-2's fused, transposed c_attn, viewed as q/k/v and sliced, reads what slicing the whole does."""
    from safetensors.torch import save_file

    from lmcli.distributed import lazy_safetensors

    whole = torch.arange(8 * 24, dtype=torch.float32).reshape(8, 24)  # Conv1D [in, 3 * out]
    save_file({"c_attn.weight": whole, "bias": whole[0].clone()}, str(tmp_path / "w.safetensors"))
    lazy, _ = lazy_safetensors([tmp_path / "w.safetensors"])
    _, k, v = lazy["c_attn.weight"].t().chunk(3)
    assert k.shape == (8, 8)
    assert torch.equal(k.read(rows=slice(4, 8)), whole.t().chunk(3)[1][4:8])
    assert torch.equal(v.read(columns=slice(2, 6)), whole.t().chunk(3)[2][:, 2:6])
    assert torch.equal(lazy["bias"].chunk(3)[2].read(rows=slice(1, 5)), whole[0].chunk(3)[2][1:5])


def test_tensor_parallel_refuses_non_float_tensors(tmp_path):
    from safetensors.torch import save_file

    from lmcli.config import ModelConfig
    from lmcli.distributed import TensorParallel, lazy_safetensors

    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 2, dtype=torch.int8)}, str(tmp_path / "q.safetensors"))
    lazy, _ = lazy_safetensors([tmp_path / "q.safetensors"])
    config = ModelConfig(model_type="llama", architecture="llama", vocab_size=8, hidden_size=2, intermediate_size=4,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=1,
                         max_position_embeddings=8)
    with pytest.raises(UsageError, match=r"--tp 2: .*q\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' "
                                         r"is torch\.int8; tensor parallel shards float weights only"):
        TensorParallel(config, size=2, rank=0).take_shards(lazy, torch.float32)


def job_input(path: Path) -> list:
    """Rows that are greedy or carry their seed (so no result depends on who runs them), one bad row."""
    rows: list[dict] = []
    for i in range(9):
        row: dict = {"prompt": "Hello there, number " + "x" * (i % 4) + str(i)}
        row.update({"temperature": 0} if i % 3 == 0 else {"seed": 100 + i})
        rows.append(row)
    rows[4]["id"] = "four"
    rows.append({"prompt": "bad", "top_p": 2})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [row.get("id", n) for n, row in enumerate(rows, start=1)]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process_job(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("job")
    ids = job_input(root / "in.jsonl")
    result = CliRunner().invoke(app, ["generate", "-c", str(tiny_checkpoint), "--input", str(root / "in.jsonl"),
                                      "--output", str(root / "one.jsonl"), "-n", "10", "--batch-size", "3"])
    assert result.exit_code == 1, result.stderr  # the bad row
    rows = {str(row["id"]): row for row in read_rows(root / "one.jsonl")}
    assert len(rows) == len(ids) and sum("error" in row for row in rows.values()) == 1
    return root, ids, rows


def test_data_parallel_job_gives_the_rows_of_one_process(one_process_job, tiny_checkpoint):
    root, ids, rows = one_process_job
    output = root / "two.jsonl"
    result = torchrun(2, "-m", "lmcli", "generate", "-c", str(tiny_checkpoint), "--input", str(root / "in.jsonl"),
                      "--output", str(output), "-n", "10", "--batch-size", "3", check=False)
    assert result.returncode != 0  # the bad row, as with one process
    assert result.stderr.count("error: 1 of 10 rows failed") == 1  # said once, by rank 0
    merged = read_rows(output)
    assert [row["id"] for row in merged] == ids  # merged in input order
    assert {str(row["id"]): row for row in merged} == rows
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("two")) == ["two.jsonl"]


def test_resume_takes_up_what_ranks_left(one_process_job, tiny_checkpoint):
    """An interrupted 3-rank job (torn lines, a failed row) resumed by 2 ranks, then one leftover part
    adopted by a one-process --resume: the same rows as one process, each once."""
    root, ids, rows = one_process_job
    lines = [json.dumps(rows[str(i)]) for i in ids]
    output = root / "resumed.jsonl"
    output.write_text(lines[0] + "\n" + lines[5] + "\n" + lines[1][:20])  # a torn last line
    Path(f"{output}.part0").write_text(lines[2] + "\n" + lines[7][:9])
    Path(f"{output}.part1").write_text(json.dumps({"id": ids[3], "error": "killed", "input_hash": "x"}) + "\n")
    Path(f"{output}.part2").write_text("")
    args = ["-m", "lmcli", "generate", "-c", str(tiny_checkpoint), "--input", str(root / "in.jsonl"),
            "--output", str(output), "-n", "10", "--batch-size", "3", "--resume"]
    result = torchrun(2, *args, check=False)
    assert "3 already done" in result.stderr
    merged = read_rows(output)
    assert len(merged) == len(ids) and {str(row["id"]): row for row in merged} == rows
    assert not list(root.glob("resumed.jsonl.part*"))

    output.write_text(lines[0] + "\n")
    Path(f"{output}.part1").write_text("\n".join(lines[1:4]) + "\n")
    invoked = CliRunner().invoke(app, args[2:])
    assert "4 already done" in invoked.stderr
    merged = read_rows(output)
    assert len(merged) == len(ids) and {str(row["id"]): row for row in merged} == rows
    assert not list(root.glob("resumed.jsonl.part*"))


def test_tensor_parallel_job_writes_the_rows_of_one_process(one_process_job, tiny_checkpoint):
    """`--tp 2 --input`: both ranks run every row in step; rank 0 alone writes them, once each."""
    root, ids, rows = one_process_job
    output = root / "tp.jsonl"
    result = torchrun(2, "-m", "lmcli", "generate", "-c", str(tiny_checkpoint), "--tp", "2", "--input",
                      str(root / "in.jsonl"), "--output", str(output), "-n", "10", "--batch-size", "3", check=False)
    assert result.stderr.count("error: 1 of 10 rows failed") == 1, result.stderr[-3000:]
    merged = read_rows(output)
    assert len(merged) == len(ids) and {str(row["id"]): row for row in merged} == rows
