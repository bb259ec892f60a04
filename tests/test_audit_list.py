"""tools/audit_plants.py, the planted-bug audit's list (docs/testing.md), still fits the code: each plant
has its own id, and its text stands exactly once in its file (else the runner refuses it), and the tests
it names exist."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from audit_plants import AREAS, PLANTS  # noqa: E402 (after the path it is found on)


def test_every_plant_has_its_own_id_and_fits_its_file_once():
    assert [name for name, count in Counter(p.id for p in PLANTS).items() if count > 1] == []
    misfits = [(p.id, (REPO / p.file).read_text(encoding="utf-8").count(p.old)) for p in PLANTS]
    assert [(plant, count) for plant, count in misfits if count != 1] == []
    assert all(p.old != p.new for p in PLANTS)


def test_the_tests_a_plant_runs_exist():
    files = {name.split("::")[0] for p in PLANTS for name in (p.tests or AREAS[p.area])}
    assert sorted(name for name in files if not (REPO / name).is_file()) == []
