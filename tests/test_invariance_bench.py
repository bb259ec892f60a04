"""`lmcli bench --sections invariance` on a tiny model quantized at load: the invariant default and
--fast-kernels each measured in its own process, and each compared with the float32 dequantised model
(a smoke test of the section: no timing assertions)."""

import sys

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from rich.console import Console

from lmcli.bench import main as bench
from lmcli.bench.invariance import report


@pytest.mark.full  # four worker processes: about a minute on two busy cores
def test_invariance_section_measures_both_paths_and_their_quality(tiny_checkpoint, capsys):
    results = bench.run(bench.settings_from_options(
        str(tiny_checkpoint), sections="invariance", max_new_tokens=4, prompt_tokens=8, prefill_tokens=8,
        batch_size=2, repeats=1, threads=1, quality_prompts=2, quality_tokens=4, kl_tokens=16))
    modes = results["sections"]["invariance"]["modes"]
    assert set(modes) == {"invariant", "fast-kernels", "fast, fixed kernels"}
    for figures in modes.values():
        assert figures["prefill_tokens_per_s"] > 0 and figures["decode_b2_tokens_per_s"] > 0
        assert figures["greedy_vs_float32"]["prompts"] == 2, figures and figures["mean_kl_vs_float32"] >= 0
    # each worker ran the path it names: the fixed choice, or the measured plan
    assert all("batch-invariant" in why for why in modes["invariant"]["kernels"]["why"].values())
    assert not any("batch-invariant" in why for why in modes["fast-kernels"]["kernels"]["why"].values())
    assert all("forced by LMCLI_KERNEL" in why for why in modes["fast, fixed kernels"]["kernels"]["why"].values())
    report(results["sections"]["invariance"], Console(file=sys.stdout, width=300))
    output = capsys.readouterr().out
    assert "decode, batch 2, tok/s" in output and "invariant / fastest" in output and "mean KL" in output
