"""Tensor parallel's logits themselves, not only the tokens they choose (found by the planted-bug audit,
docs/testing.md): with a vocabulary that does not divide by the ranks (97 over 2) the gathered logits must
span exactly the vocabulary, padding columns cut, and equal transformers' forward of the same checkpoint.

Greedy tokens cannot see a padding column whose logit (0) is never the largest, nor a bias summed twice
if it happens not to change the argmax; the logits show both. One torchrun launch covers the cases.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_distributed import torchrun
from tiny import CASES, VOCAB, build_reference, prompts

pytestmark = pytest.mark.usefixtures("one_thread")

# A llama with biases on its row-parallel projections (o_proj, down_proj), tied; GPT-2's c_proj biases.
PARALLEL_CASES = ("gpt2", "llama-mha-tied-bias")

_WORKER = """
import json, sys
import torch
import lmcli
from lmcli import distributed

spec = json.loads(open(sys.argv[1]).read())
distributed.start("cpu")
ids = torch.tensor(spec["ids"])
logits = {}
for name, path in spec["checkpoints"].items():
    model, _ = lmcli.load(path, device="cpu", dtype="float32", tp=distributed.world_size())
    with torch.inference_mode():
        logits[name] = model.forward(ids).float()
if distributed.is_output_rank():
    torch.save(logits, sys.argv[2])
distributed.finish()
"""


def test_tensor_parallel_logits_span_the_vocabulary_and_equal_transformers(tmp_path):
    assert VOCAB % 2  # the case that needs padding
    ids = torch.stack(prompts([7, 7]))  # (2, 7)
    checkpoints, references = {}, {}
    for case in PARALLEL_CASES:
        assert case in CASES
        hf = build_reference(case, 0)
        hf.save_pretrained(tmp_path / case)
        checkpoints[case] = str(tmp_path / case)
        with torch.inference_mode():
            references[case] = hf(ids).logits.float()  # (2, 7, 97)
    spec, worker = tmp_path / "spec.json", tmp_path / "worker.py"
    spec.write_text(json.dumps({"checkpoints": checkpoints, "ids": ids.tolist()}))
    worker.write_text(_WORKER)
    torchrun(2, str(worker), str(spec), str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    for case in PARALLEL_CASES:
        assert got[case].shape == (2, 7, VOCAB), case
        torch.testing.assert_close(got[case], references[case], atol=1e-4, rtol=1e-4, msg=case)
