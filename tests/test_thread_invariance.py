"""A row's numbers do not depend on how many threads compute them: lmcli moves its thread count with
the machine's load (lmcli/threads.py), so a job row, or a `generate --seed S` run meant to reproduce it,
must give the same text on a quiet machine (2 threads here) as on a busy one (1 thread).

The reference is the same model on one thread. The case is one that parted before attention's calls
ran on one thread: the target job's row 12 (a 121-token chat prompt, sampled at temperature 0.9 and
top-p 0.95, seed 1011), whose 34th step's logits differed by 0.125 between 1 and 2 threads (torch's
CPU attention kernel rounds a call of 3 kv heads differently on 2 threads than on 1, 3 or 4)."""

from __future__ import annotations

import torch
from real_models import smollm2_gguf  # noqa: F401  (fixture)

import lmcli
from lmcli.bench.job import target_job_rows


def test_a_sampled_row_gives_the_same_logits_on_one_thread_and_two(smollm2_gguf):
    model, tokenizer = lmcli.load(smollm2_gguf)
    row = target_job_rows()[11]
    assert row["id"] == 12 and row["temperature"] == 0.9
    ids = torch.tensor([list(tokenizer.encode_chat([{"role": "system", "content": row["system"]},
                                                    {"role": "user", "content": row["prompt"]}],
                                                   add_generation_prompt=True))])
    threads = torch.get_num_threads()
    runs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            logits: list[torch.Tensor] = []
            out = model.generate(ids, max_new_tokens=40, do_sample=True, temperature=row["temperature"],
                                 top_p=row["top_p"], seed=row["seed"], on_token=lambda e, into=logits: into.append(e.logits.clone()))
            runs.append((out, logits))
    finally:
        torch.set_num_threads(threads)
    (one, one_logits), (two, two_logits) = runs
    for step, (a, b) in enumerate(zip(one_logits, two_logits)):
        assert torch.equal(a, b), f"step {step}: {(a - b).abs().max().item()}"
    assert torch.equal(one, two)
