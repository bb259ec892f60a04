"""`lmcli bench --sections beams` on a tiny checkpoint: the section runs through the bench's registry,
every method makes the tokens asked for, its ratios are the figures' own, and its table shows each
method (no timed assertions)."""

from __future__ import annotations

import json
from io import StringIO

from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from rich.console import Console
from test_beams_cli import t5_dir  # noqa: F401 (fixture)

from lmcli.bench import main as bench
from lmcli.bench import sections
from lmcli.bench.beams import METHODS, report
from lmcli.generation import beams


def test_beams_section_through_lmcli_bench(tiny_checkpoint, capsys, monkeypatch):
    assert sections.SECTIONS["beams"] == "lmcli.bench.beams"
    searched = []  # the "4 beams" call is beam search itself (tested against transformers in test_beams.py)
    real = beams.generate

    def recorded(*args, **kwargs):
        searched.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(beams, "generate", recorded)
    bench.main(str(tiny_checkpoint), as_json=True, sections="beams", quick=True, max_new_tokens=5)
    section = json.loads(capsys.readouterr().out)["sections"]["beams"]
    assert searched == [4]
    assert section["num_beams"] == 4 and section["max_new_tokens"] == 5 and section["repeats"] == 1
    assert section["new_tokens"] == dict.fromkeys(METHODS, 5) and section["equal_lengths"] is True
    for name in METHODS:
        assert len(section["seconds"][name]) == 1 and section["best_s"][name] == min(section["seconds"][name]) > 0
    best = section["best_s"]

    def within_rounding(ratio: float, beams: float, greedy: float) -> bool:
        # best_s is rounded to 4 decimals (a tiny model's call is a few ms): the ratio of the unrounded
        # times lies within what those roundings allow, plus the ratio's own rounding.
        low, high = (beams - 5e-5) / (greedy + 5e-5), (beams + 5e-5) / max(greedy - 5e-5, 1e-9)
        return low - 5e-3 <= ratio <= high + 5e-3

    assert within_rounding(section["ratio_to_greedy"], best["4 beams"], best["greedy"])
    assert within_rounding(section["ratio_to_greedy_b4"], best["4 beams"], best["greedy b4"])

    out = StringIO()
    report(section, Console(file=out, width=200))
    text = out.getvalue()
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == list(METHODS)
    assert f"4 beams cost {section['ratio_to_greedy']:.2f}x greedy decoding" in text



def test_an_encoder_decoders_new_tokens_are_counted_after_its_start_token(t5_dir):
    """An encoder-decoder's output is its decoder's text (start token first), not prompt + new tokens."""
    from lmcli.bench.beams import run_methods
    from lmcli.loading import load

    model, tokenizer = load(t5_dir, device="cpu", dtype="float32")
    assert tokenizer is not None
    figures = run_methods(model, tokenizer.encode("the quick brown fox"), 5, 1)
    assert figures["new_tokens"] == dict.fromkeys(METHODS, 5) and figures["equal_lengths"] is True
