"""Errors raised to users. Each carries a one-line message the CLI prints as is."""


class LmcliError(Exception):
    """Base class: a problem the user can act on. The CLI prints it and exits 1."""

    exit_code = 1


class UsageError(LmcliError):
    """A bad flag or argument combination (exit code 2)."""

    exit_code = 2


class CheckpointError(LmcliError):
    """A checkpoint that cannot be resolved or read: missing, corrupt, mismatched."""


class ConfigError(LmcliError):
    """An unknown architecture or an inconsistent config."""


class GGUFError(CheckpointError):
    """A GGUF file that is truncated, malformed or unsupported."""


class TokenizerError(LmcliError):
    """No tokenizer, or a tokenizer that cannot be built."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a one-line
    error quotes of a library's exception."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
