"""`python -m lmcli` and the `lmcli` console script: `generate --server` without building the Typer app
(lmcli.serve.fast), everything else through lmcli.cli."""

import sys


def main() -> None:
    from lmcli.serve.fast import run

    code = run(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from lmcli.cli import main as full

    full()


if __name__ == "__main__":
    main()
