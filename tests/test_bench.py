"""`lmcli bench`: the structure of its results and tables, and the logic behind its figures, on a tiny
model (a smoke test of the measuring itself: no timing assertions)."""

import json
import math
import sys

import pytest
import torch
from rich.console import Console
from tiny import save_reference

from lmcli.bench import main as bench
from lmcli.errors import UsageError


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_reference("llama", directory)
    return bench.run(bench.settings_from_options(
        str(directory), engines="lmcli,transformers", formats="float,int4", max_new_tokens=4, prompt_tokens=8,
        prefill_tokens=8, batch_size=2, repeats=1, contexts="16", scaling_batches="1,2", threads=1))


def test_bench_compares_with_transformers(tiny_results, capsys):
    engines = tiny_results["engines"]
    assert set(engines) == {"lmcli float", "lmcli int4", "transformers"}
    for name, figures in engines.items():
        if name == "lmcli int4" and "unavailable" in figures:  # an engine it cannot run is reported, not fatal
            continue
        assert figures["prefill_tokens_per_s"] > 0 and figures["ttft_s"] > 0
        assert figures["decode_b1_tokens_per_s"] > 0 and figures["decode_b2_tokens_per_s"] > 0
        assert figures["peak_rss_bytes"] > 0  # each engine's own process
    bench.print_report(tiny_results, Console(file=sys.stdout, width=300))
    output = capsys.readouterr().out
    assert "lmcli int4" in output
    assert "decode b1 tok/s" in output and "decode b2 tok/s" in output and "peak RSS MiB" in output
    assert "greedy tokens identical (lmcli float32 vs transformers): yes" in output
    assert tiny_results["greedy_identical_lmcli_float_vs_transformers"] is True


def test_bench_ratios_and_scaling_follow_the_figures(tiny_results):
    ours, theirs = tiny_results["engines"]["lmcli float"], tiny_results["engines"]["transformers"]
    for key in ("prefill_tokens_per_s", "decode_b1_tokens_per_s", "decode_b2_tokens_per_s"):
        assert ours["vs_transformers"][key] == pytest.approx(ours[key] / theirs[key])
    assert "vs_llama.cpp" not in ours  # not a GGUF: llama.cpp was not run
    scaling = tiny_results["scaling"]
    assert scaling["engine"] == "lmcli float"
    assert set(scaling["context"]) == {"16"} and set(scaling["batch"]) == {"1", "2"}
    assert all(rate > 0 for rate in [*scaling["context"].values(), *scaling["batch"].values()])
    # The tiny checkpoint has no tokenizer, so the quality check (real prompts, fixed text) says why it is missing.
    if "unavailable" not in tiny_results["engines"]["lmcli int4"]:
        assert "no tokenizer" in tiny_results["quality"]["unavailable"]
    json.dumps(tiny_results)  # what --json prints: plain data only


def test_decode_rate_counts_tokens_after_the_first():
    # 4 tokens at t = 1.0 (after prefill), 1.5, 2.0, 2.5: 3 tokens in 1.5 s per row, 2 rows.
    assert bench.decode_rate([1.0, 1.5, 2.0, 2.5], batch=2) == pytest.approx(4.0)
    assert math.isnan(bench.decode_rate([1.0], batch=1))


def test_greedy_agreement_counts_tokens_before_the_first_divergence():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    candidate = [[1, 2, 3, 4], [5, 9, 7, 8]]  # the second diverges at token 1 (what follows is not compared)
    figures = bench.greedy_agreement(reference, candidate)
    assert figures == {"identical": 1, "prompts": 2, "tokens_before_divergence": pytest.approx((1 + 0.25) / 2)}


def test_mean_kl_divergence_matches_torch():
    generator = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(5, 11, generator=generator), -1)
    q = torch.log_softmax(torch.randn(5, 11, generator=generator), -1)
    expected = torch.nn.functional.kl_div(q, p, log_target=True, reduction="batchmean")
    assert bench.mean_kl_divergence(p, q) == pytest.approx(float(expected), rel=1e-5)
    assert bench.mean_kl_divergence(p, p) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("options, message", [
    (dict(engines="lmcli,vllm"), "--engines lmcli,vllm: choose from lmcli, transformers, llama.cpp"),
    (dict(formats="int3"), "--formats int3: choose from float, native, int4, int8"),
    (dict(contexts="128,1k"), "--contexts '128,1k': expected comma-separated whole numbers"),
    (dict(max_new_tokens=1), "--max-new-tokens must be at least 2"),
])
def test_bench_options_are_validated_with_one_line_errors(options, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bench.settings_from_options(None, **options)


def test_quick_does_less_of_everything():
    settings = bench.settings_from_options(None, quick=True)
    default = bench.BenchSettings()
    assert settings.repeats == 1 and max(settings.scaling_contexts) < max(default.scaling_contexts)
    assert max(settings.scaling_batches) < max(default.scaling_batches)
    assert settings.kl_tokens < default.kl_tokens and settings.quality_prompts < default.quality_prompts


def test_sections_flag_names_its_choices():
    from lmcli.bench.sections import SECTIONS
    from lmcli.bench.settings import settings_from_options
    from lmcli.errors import UsageError

    assert settings_from_options(None).sections == ("engines",)
    assert tuple(settings_from_options(None, sections="engines").sections) == ("engines",)
    with pytest.raises(UsageError, match="--sections nope: choose from " + ", ".join(SECTIONS)):
        settings_from_options(None, sections="nope")
