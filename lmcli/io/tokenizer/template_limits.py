"""How big a chat template's strings and lists may grow, checked before Python builds them.

A template is code from a stranger: `'%s%s' % (s, s)` in a loop, the text of a list holding a
million copies of a long string, or a block that collects a million pieces would each take
gigabytes within the time limit. Every way of making text (operators, `.format`, methods,
filters, `{{ ... }}` output and the buffers of blocks and macros) is measured first with
`text_size`, which counts what `str()` would produce without producing it.
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping
from typing import Any

MAX_ITEMS = 1_000_000  # characters of one string / items of one list a template may build
MAX_POWER_BITS = 4096  # `**` and `*` results: integers of at most this many bits
_FORMATTER = string.Formatter()


class TemplateLimitError(Exception):
    """A chat template went over one of the bounds above."""


def check_size(size: float, what: str) -> None:
    if size > MAX_ITEMS:
        raise TemplateLimitError(f"{what} would hold {size:,.0f} items (the limit is {MAX_ITEMS:,})")


def text_size(value: Any, budget: int = MAX_ITEMS) -> int:
    """At least as many characters as `str(value)` holds, counted without building it; the count
    stops soon after it passes `budget` (the caller only needs to know that it did)."""
    if isinstance(value, str):
        return len(value)
    return _repr_size(value, budget) if isinstance(value, (list, tuple, set, frozenset, Mapping)) else _small_size(value)


def _repr_size(value: Any, budget: int) -> int:
    """Characters of the repr of a value inside a container (strings get quotes and escapes)."""
    if isinstance(value, str):
        plain = value.isprintable() and "\\" not in value and not ("'" in value and '"' in value)
        return len(value) + 2 if plain else 10 * len(value) + 2  # an escape is at most 10 characters
    if isinstance(value, Mapping):
        total = 2
        for key, item in value.items():
            total += 4 + _repr_size(key, budget - total)
            total += _repr_size(item, budget - total)
            if total > budget:
                break
        return total
    if isinstance(value, (list, tuple, set, frozenset)):
        total = 2
        for item in value:
            total += 2 + _repr_size(item, budget - total)
            if total > budget:
                break
        return total
    return _small_size(value)


def _small_size(value: Any) -> int:
    if isinstance(value, (bytes, bytearray)):
        return 4 * len(value) + 3
    if isinstance(value, int):
        return value.bit_length() // 3 + 2  # decimal digits are fewer than a third of the bits, plus sign
    namespace_attributes = getattr(value, "_Namespace__attrs", None)  # jinja2's namespace() shows its values
    if isinstance(namespace_attributes, dict):
        return 14 + _repr_size(namespace_attributes, MAX_ITEMS)
    return 64  # numbers, None, undefined values, loop objects and macros show as a short text


def check_text(value: Any, what: str) -> Any:
    """`value`, when its text is within the limit."""
    check_size(text_size(value, MAX_ITEMS), what)
    return value


def _format_widths(text: str) -> int:
    """The sum of the numbers in a format string: every width or precision it may pad to."""
    total = 0
    number = 0
    for character in text:
        if character.isdigit():
            number = number * 10 + int(character)
            if number > MAX_ITEMS:
                return number
        else:
            total, number = total + number, 0
    return total + number


def _checked_widths(text: str) -> int:
    widths = _format_widths(text)
    if widths > MAX_ITEMS:
        raise TemplateLimitError(f"a format width or precision over {MAX_ITEMS:,}")
    return widths


def check_percent_format(text: Any, arguments: Any) -> None:
    """`text % arguments`: the format string, each width in it and each argument it may take."""
    if not isinstance(text, str):
        return
    size = len(text) + _checked_widths(text)
    if isinstance(arguments, tuple):  # each field takes the next argument; `*` takes a width from them
        size += sum(text_size(item) for item in arguments)
        if "*" in text:
            size += sum(item for item in arguments if isinstance(item, int) and not isinstance(item, bool))
    elif isinstance(arguments, Mapping):  # %(name)s may name one value many times
        size += text.count("%") * max((text_size(item) for item in arguments.values()), default=0)
    else:
        size += text.count("%") * text_size(arguments)
    _check_format(size)


def check_str_format(text: str, args: tuple, kwargs: Mapping) -> None:
    """`text.format(*args, **kwargs)`: automatic fields take one argument each; numbered or named
    ones may repeat one, so each counts as the largest."""
    size = len(text) + _checked_widths(text)
    try:
        fields = [(name, spec) for _, name, spec, _ in _FORMATTER.parse(text) if name is not None]
    except ValueError:
        return  # a malformed format string: str.format itself refuses it
    values = [*args, *kwargs.values()]
    if all(name == "" for name, _ in fields):
        size += sum(text_size(value) for value in values)
    else:
        size += len(fields) * max((text_size(value) for value in values), default=0)
    if any(spec and "{" in spec for _, spec in fields):  # nested widths, '{:{}}', come from the arguments
        size += sum(value for value in values if isinstance(value, int) and not isinstance(value, bool))
    _check_format(size)


def _check_format(size: int) -> None:
    if size > MAX_ITEMS:
        raise TemplateLimitError(f"a formatted string would hold over {MAX_ITEMS:,} characters")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be too large, before Python builds it."""
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if _sized(sequence) and isinstance(count, int):
                check_size(len(sequence) * max(count, 0), "a repeated string or list")
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_POWER_BITS:
            raise TemplateLimitError(f"a product over {MAX_POWER_BITS} bits")
    elif operator == "+" and _sized(left) and _sized(right):
        check_size(len(left) + len(right), "a joined string or list")
    elif operator == "%":
        check_percent_format(left, right)
    elif (operator == "**" and _is_int(left) and _is_int(right) and abs(left) > 1
          and right * math.log2(abs(left)) > MAX_POWER_BITS):
        raise TemplateLimitError(f"a power over {MAX_POWER_BITS} bits")


def _sized(value: Any) -> bool:
    return isinstance(value, (str, bytes, bytearray, list, tuple))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def joined_size(items: list, separator: Any) -> int:
    size = len(str(separator)) * len(items)
    for item in items:
        size += text_size(item)
        if size > MAX_ITEMS:
            break
    return size


# String methods that take a size, and how big each result can be.
def check_method_call(owner: Any, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a str/bytes method call whose result would be too large; returns the arguments to call
    with (a generator given to join is read into a list first, so that it can be measured)."""
    if not isinstance(owner, (str, bytes, bytearray)):
        return args
    if name in ("center", "ljust", "rjust", "zfill"):
        for value in (*args[:1], *kwargs.values()):
            if _is_int(value):
                check_size(value, f"str.{name}'s result")
    elif name == "expandtabs":
        width = args[0] if args else kwargs.get("tabsize", 8)
        if _is_int(width):
            tabs = owner.count("\t") if isinstance(owner, str) else owner.count(b"\t")
            check_size(len(owner) + tabs * width, "str.expandtabs's result")
    elif name == "replace" and len(args) >= 2 and isinstance(owner, str):
        old, new = str(args[0]), str(args[1])
        count = owner.count(old) if old else len(owner) + 1
        check_size(len(owner) + count * max(len(new) - len(old), 0), "str.replace's result")
    elif name == "join" and args and isinstance(owner, str):
        items = list(args[0])
        check_size(joined_size(items, owner), "str.join's result")
        return (items, *args[1:])
    return args
