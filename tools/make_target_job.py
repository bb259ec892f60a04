"""Write the continuous-batching target job (issue 20) as JSONL: chat rows sharing a ~100-token system
message, greedy and sampled at different temperatures and top-p, max_new_tokens 128 (the rows are
lmcli.bench.job.target_job_rows, which `lmcli bench --sections job` runs).

    python tools/make_target_job.py job.jsonl [--rows 48]
    lmcli generate --chat --input job.jsonl --output out.jsonl --stats
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lmcli.bench.job import target_job_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--rows", type=int, default=48)
    args = parser.parse_args()
    rows = target_job_rows(args.rows)
    args.output.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
