"""The planted-bug audit (docs/testing.md): plant each bug of tools/audit_plants.py in turn, run the tests
relevant to its module, and record whether they caught it.

    python tools/audit_plant.py                  # every plant, existing tests and the audit's own
    python tools/audit_plant.py --mode before    # as before the audit's tests (tests/test_audit_*.py) existed
    python tools/audit_plant.py --mode both      # before, then the audit's tests alone on each survivor
    python tools/audit_plant.py --mode quick     # the audit's tests first, the earlier ones only if needed
    python tools/audit_plant.py --only C4 S8     # some plants
    python tools/audit_plant.py --survivors results.json  # only those that survived in an earlier run

Each plant replaces one exact piece of one line of a file under lmcli/ (it must occur exactly once), the
file is compiled (a plant that does not compile is a mistake in the list, not a catch), the tests run
with `-x -q` under a timeout, and the file is written back as it was, whatever happens. Results go to
a JSON file (--out) and a table on stdout. Run it in a clean checkout: it refuses a file with
uncommitted changes, so a plant can never be committed by accident.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from audit_plants import AREA_ARGS, AREAS, PLANTS, Plant  # noqa: E402 (after the path it is found on)


def _tests_for(plant: Plant, with_audit: bool) -> list[str]:
    tests = list(plant.tests or AREAS[plant.area])
    if with_audit:
        tests += sorted(str(Path(p).relative_to(ROOT)) for p in glob.glob(str(ROOT / "tests" / f"test_audit_{plant.area}*.py")))
    return tests


def _clean(path: Path) -> bool:
    status = subprocess.run(["git", "status", "--porcelain", "--", str(path)], cwd=ROOT, capture_output=True, text=True)
    return status.returncode == 0 and not status.stdout.strip()


def _audit_tests(plant: Plant) -> list[str]:
    return sorted(str(Path(p).relative_to(ROOT)) for p in glob.glob(str(ROOT / "tests" / f"test_audit_{plant.area}*.py")))


def _run_tests(plant: Plant, tests: list[str], timeout: int) -> tuple[str, str]:
    """(outcome, the first failure or the summary) of the tests, with the plant in place."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    command = ["timeout", str(timeout), sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               *(plant.pytest_args or AREA_ARGS.get(plant.area, ())), *tests]
    # A session of its own, so that a stopped audit stops its tests too (and the file goes back).
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        stdout, _ = process.communicate()
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    lines = [line for line in stdout.splitlines() if line.strip()]
    failed = next((line for line in lines if line.startswith(("FAILED", "ERROR"))), lines[-1] if lines else "")
    return {0: "survived", 124: "timeout", 5: "no tests"}.get(process.returncode, "caught"), failed[:200]


def run_plant(plant: Plant, mode: str, timeout: int) -> dict:
    """mode "before": the tests that predate the audit; "after": those and the audit's; "both": the first,
    then, if the plant survived them, the audit's own tests alone (recorded as "after")."""
    path = ROOT / plant.file
    original = path.read_text(encoding="utf-8")
    record = {"id": plant.id, "area": plant.area, "file": plant.file, "old": plant.old, "new": plant.new,
              "effect": plant.effect}
    if original.count(plant.old) != 1:
        return {**record, "outcome": "bad plant", "detail": f"found {original.count(plant.old)} times"}
    if not _clean(path):
        return {**record, "outcome": "bad plant", "detail": "the file has uncommitted changes"}
    tests = _audit_tests(plant) if mode == "audit" else _tests_for(plant, mode == "after")
    started = time.monotonic()
    try:
        path.write_text(original.replace(plant.old, plant.new), encoding="utf-8")
        try:
            compile(path.read_text(encoding="utf-8"), str(path), "exec")
        except SyntaxError as e:
            return {**record, "outcome": "bad plant", "detail": f"does not compile: {e}"}
        if mode == "quick":  # the audit's tests first (fast); the earlier tests only if they pass
            audit = _audit_tests(plant)
            after, after_detail = _run_tests(plant, audit, timeout) if audit else ("survived", "")
            before = "not run"  # when the audit's tests catch it, the earlier ones are not asked
            if after != "caught":
                after, after_detail = _run_tests(plant, _tests_for(plant, False), timeout)
                before = after
            record.update(outcome=before, detail="", after=after, after_detail=after_detail, audit_tests=audit)
            return {**record, "seconds": round(time.monotonic() - started, 1)}
        outcome, detail = _run_tests(plant, tests, timeout)
        record.update(outcome=outcome, detail=detail, tests=tests)
        if mode == "both":
            audit = _audit_tests(plant)
            after, after_detail = (outcome, detail) if outcome == "caught" or not audit else _run_tests(plant, audit, timeout)
            record.update(after=after, after_detail=after_detail, audit_tests=audit)
    finally:
        path.write_text(original, encoding="utf-8")
    return {**record, "seconds": round(time.monotonic() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="plant ids")
    parser.add_argument("--area", nargs="*", help="areas")
    parser.add_argument("--start", help="the plant id to start from (the list's order)")
    parser.add_argument("--survivors", type=Path, help="a results file: run only the plants it says survived")
    parser.add_argument("--mode", choices=("after", "before", "both", "audit", "quick"), default="after",
                        help="after: every relevant test; before: without tests/test_audit_*.py; both: before, "
                             "then the audit's tests alone on what survived; audit: the audit's tests alone; quick: the "
                             "audit's tests, then the earlier ones only if the plant survived them (no 'before')")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per plant's tests")
    parser.add_argument("--out", type=Path, default=Path("audit_results.json"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so a stopped run still puts the file back

    plants = PLANTS
    if args.only:  # in the order given
        plants = [p for wanted in args.only for p in plants if p.id == wanted]
    if args.area:
        plants = [p for wanted in args.area for p in plants if p.area == wanted]
    if args.start:
        plants = plants[[p.id for p in plants].index(args.start):]
    if args.survivors:
        survived = {r["id"] for r in json.loads(args.survivors.read_text()) if r["outcome"] != "caught"}
        plants = [p for p in plants if p.id in survived]
    results = []
    for plant in plants:
        result = run_plant(plant, args.mode, args.timeout)
        results.append(result)
        after = f"-> {result['after']:9}" if "after" in result else ""
        print(f"{plant.id:5} {result['outcome']:9} {after} {result.get('seconds', 0):6}s  {plant.effect[:60]}", flush=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    by_area: dict[str, list[int]] = {}
    for result in results:
        counts = by_area.setdefault(result["area"], [0, 0, 0])
        counts[0] += 1
        counts[1] += result["outcome"] not in ("caught", "not run")  # quick mode: "not run" = the audit's tests caught it
        counts[2] += result.get("after", result["outcome"]) != "caught"
    print("\n| area | planted | not caught | not caught with the audit's tests (mode both) |\n|---|---|---|---|")
    for area, (planted, missed, missed_after) in by_area.items():
        print(f"| {area} | {planted} | {missed} | {missed_after} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
