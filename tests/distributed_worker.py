"""Run by tests/test_distributed.py, alone or under torchrun: greedy generation for each checkpoint
of a spec, through `lmcli.load(..., tp=world size)` when started by torchrun.

    python tests/distributed_worker.py SPEC.json RESULT.json
    python -m torch.distributed.run --nproc-per-node 2 tests/distributed_worker.py SPEC.json RESULT.json

SPEC: {"runs": [{"checkpoint": path, "max_new_tokens": n, "sampled_tokens": m}, ...], "prompts": [[ids], ...],
"eos_token_id": id}. Rank 0 writes RESULT: {"world_size": N, "runs": [{"checkpoint", "tokens": greedy
[[ids]...], "sampled": with per-row seeds [[ids]...], "peak_mib": [per rank]}]}, where
peak_mib is the rise of the process's peak resident memory while loading and running that checkpoint
(the first checkpoint's figure is the meaningful one: a peak only ever rises).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import lmcli
from lmcli import distributed


def peak_mib() -> float:
    """This process's peak resident memory (VmHWM). Not ru_maxrss: that one also counts the memory of
    the parent the process was forked from, which for a pytest parent is larger than ours."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    raise RuntimeError("no VmHWM in /proc/self/status")


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    tp = None
    if distributed.launched_by_torchrun():
        distributed.start("cpu")
        tp = distributed.world_size()
    runs = []
    for run in spec["runs"]:
        checkpoint = run["checkpoint"]
        before = peak_mib()
        model, _ = lmcli.load(checkpoint, device="cpu", dtype="float32", tp=tp)
        ids, mask = left_pad(spec["prompts"], pad=0)
        greedy = model.generate(ids, run["max_new_tokens"], do_sample=False, attention_mask=mask,
                                eos_token_id=spec.get("eos_token_id"), pad_token_id=0)
        sampled = model.generate(ids, run["sampled_tokens"], do_sample=True, temperature=1.0, top_k=20,
                                 attention_mask=mask, seed=list(range(7, 7 + len(ids))), pad_token_id=0)
        rise = peak_mib() - before
        del model
        peaks = [rise]
        if tp is not None:
            gathered: list = [None] * distributed.world_size()
            dist.all_gather_object(gathered, rise)
            peaks = gathered
        runs.append({"checkpoint": checkpoint, "tokens": greedy[:, ids.shape[1]:].tolist(),
                     "sampled": sampled[:, ids.shape[1]:].tolist(), "peak_mib": peaks})
    if distributed.is_output_rank():
        with open(result_path, "w") as handle:
            json.dump({"world_size": distributed.world_size(), "runs": runs}, handle)
    distributed.finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
