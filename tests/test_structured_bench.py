"""`lmcli bench --sections structured` on a tiny checkpoint: the section runs through the bench's
registry, its runs decode the steps it asks for, and its table shows each batch size (no timed assertions)."""

from __future__ import annotations

import json

from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)

from lmcli.bench import main as bench


def test_structured_section_through_lmcli_bench(tiny_checkpoint, capsys):
    bench.main(str(tiny_checkpoint), as_json=True, sections="structured", quick=True, batch_size=2,
               structured_tokens=6)
    section = json.loads(capsys.readouterr().out)["sections"]["structured"]
    assert set(section["batches"]) == {"1", "2"}
    for figures in section["batches"].values():
        assert figures["decode_steps"] == 5  # 6 tokens, 5 steps timed between them: the schema's object is longer
        for mode in ("after", "overlap"):
            assert figures[f"tok_s_{mode}"] > 0 and figures[f"mask_ms_p99_{mode}"] >= figures[f"mask_ms_p50_{mode}"]

    from io import StringIO

    from rich.console import Console

    from lmcli.bench.structured import report

    out = StringIO()
    report(section, Console(file=out, width=200))
    rows = [line for line in out.getvalue().splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["1", "2"]
