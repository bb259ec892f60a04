"""`python -m lmcli`: the same as the `lmcli` command."""

from lmcli.cli import main

if __name__ == "__main__":
    main()
