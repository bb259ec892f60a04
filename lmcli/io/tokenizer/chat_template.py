"""Chat templates: Jinja in a sandbox, with the helpers templates are written against.

Templates come with checkpoints, so they run in jinja2's ImmutableSandboxedEnvironment: no attribute
access to Python internals, no mutation of the values passed in. A template is also code from a
stranger that could ask for `'a' * 10**10`, so its resources are bounded (`render_bounded`):
- every string or list it builds (`*`, `+`, `~`, `%`, `.format`, padding/replacing methods and filters)
  holds at most MAX_ITEMS characters or items, checked before it is built;
- `**` has a bounded result, and range() is bounded by jinja2's sandbox (MAX_RANGE);
- the output holds at most MAX_OUTPUT characters, and rendering stops after MAX_SECONDS.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache
from typing import Any

MAX_ITEMS = 1_000_000  # characters of one string / items of one list a template may build
MAX_OUTPUT = 1_000_000  # characters of rendered prompt (far beyond any model's context)
MAX_SECONDS = 5.0  # real templates render in milliseconds
_MAX_POWER_BITS = 4096  # `**` results: integers of at most this many bits

# Numbers in a %-format or str.format string, e.g. the width in "%10000000000s".
_FORMAT_NUMBER = re.compile(r"\d+")


class TemplateLimitError(Exception):
    """A chat template went over one of the bounds above."""


def render_bounded(template: Any, **variables: Any) -> str:
    """Render a compiled template within MAX_OUTPUT characters and MAX_SECONDS."""
    deadline = time.monotonic() + MAX_SECONDS
    pieces: list[str] = []
    size = 0
    with _time_limit(MAX_SECONDS):
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT:
                raise TemplateLimitError(f"the rendered prompt is longer than {MAX_OUTPUT:,} characters")
            if time.monotonic() > deadline:
                raise TemplateLimitError(f"rendering took longer than {MAX_SECONDS:g} s")
            pieces.append(piece)
    return "".join(pieces)


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt a template's Python-level loops after `seconds` (a SIGALRM timer; main thread only —
    elsewhere render_bounded's checks between output pieces are the limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise TemplateLimitError(f"rendering took longer than {seconds:g} s")

    previous_handler = signal.signal(signal.SIGALRM, expired)
    previous_timer = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_timer[0]:  # someone else's timer was running: give it back what remains
            signal.setitimer(signal.ITIMER_REAL, *previous_timer)


def _check_size(size: float, what: str) -> None:
    if size > MAX_ITEMS:
        raise TemplateLimitError(f"{what} would hold {size:,.0f} items (the limit is {MAX_ITEMS:,})")


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


def _check_format_string(text: Any) -> None:
    if isinstance(text, str) and any(int(n) > MAX_ITEMS for n in _FORMAT_NUMBER.findall(text)):
        raise TemplateLimitError(f"a format width or precision over {MAX_ITEMS:,}")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be too large, before Python builds it."""
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if _sized(sequence) and isinstance(count, int):
                _check_size(len(sequence) * max(count, 0), "a repeated string or list")
    elif operator == "+" and _sized(left) and _sized(right):
        _check_size(len(left) + len(right), "a joined string or list")
    elif operator == "%":
        _check_format_string(left)
    elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
          and right * math.log2(abs(left)) > _MAX_POWER_BITS):
        raise TemplateLimitError(f"a power over {_MAX_POWER_BITS} bits")


# String and list methods that take a size: their integer arguments are bounded like results.
_SIZED_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join"}


def _check_call_arguments(name: str, args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            _check_size(value, f"str.{name}'s result")


def _check_call(function: Any, args: tuple, kwargs: dict) -> None:
    owner = getattr(function, "__self__", None)
    name = getattr(function, "__name__", "")
    if not (_sized(owner) and name in _SIZED_METHODS):
        return
    _check_call_arguments(name, args, kwargs)
    if name == "replace" and len(args) >= 2 and isinstance(owner, str):
        old, new = str(args[0]), str(args[1])
        count = owner.count(old) if old else len(owner) + 1
        _check_size(len(owner) + count * max(len(new) - len(old), 0), "str.replace's result")
    elif name == "join" and isinstance(owner, str) and args and isinstance(args[0], (list, tuple)):
        _check_size(sum(len(str(x)) for x in args[0]) + len(owner) * len(args[0]), "str.join's result")


@lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    environment = _chat_environment()
    return environment.from_string(source)


@lru_cache(maxsize=1)
def _chat_environment() -> Any:
    """The sandbox and helpers that chat templates are written against (the reference's set)."""
    import jinja2
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: through the environment, to be bounded
            self.write("environment.bounded_concat((")
            for argument in node.nodes:
                self.visit(argument, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset(["*", "+", "%", "**"])

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # jinja2's signature
            _check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):  # "...".format(...): the sandbox's formatter, bounded
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            _check_format_string(value.__self__)

            def bounded_format(*args, **kwargs):
                _check_call_arguments("format", args, kwargs)  # nested widths: '{:{}}'.format(x, 10**10)
                return wrapped(*args, **kwargs)

            return bounded_format

        @staticmethod
        def bounded_concat(parts):
            texts = [str(part) for part in parts]
            _check_size(sum(map(len, texts)), "a joined string")
            return "".join(texts)

    class GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
        # only has to render its body.
        tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares `tags` as this set attribute)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    environment = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    _bound_sized_filters(environment.filters)
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment


def _bound_sized_filters(filters: dict[str, Any]) -> None:
    """Filters whose result size a template chooses: checked like the operators."""
    center, indent, wordwrap, replace, format_, join = (filters[name] for name in
                                                        ("center", "indent", "wordwrap", "replace", "format", "join"))

    def bounded_center(value, width=80):
        _check_size(width, "center's result")
        return center(value, width)

    def bounded_indent(value, width=4, *args, **kwargs):
        _check_size(len(str(value)) * (1 + (width if isinstance(width, int) else len(str(width)))), "indent's result")
        return indent(value, width, *args, **kwargs)

    def bounded_wordwrap(environment, value, width=79, *args, **kwargs):
        _check_size(len(str(value)) * 2 + (width if isinstance(width, int) else 0), "wordwrap's result")
        return wordwrap(environment, value, width, *args, **kwargs)

    def bounded_replace(eval_ctx, value, old, new, count=None):
        text, old, new = str(value), str(old), str(new)
        times = text.count(old) if old else len(text) + 1
        _check_size(len(text) + times * max(len(new) - len(old), 0), "replace's result")
        return replace(eval_ctx, value, old, new, count)

    def bounded_format(value, *args, **kwargs):
        _check_format_string(value)
        return format_(value, *args, **kwargs)

    def bounded_join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        _check_size(sum(len(str(x)) for x in items) + len(str(d)) * len(items), "join's result")
        return join(eval_ctx, items, d, attribute)

    from jinja2.utils import pass_environment, pass_eval_context

    filters.update(center=bounded_center, indent=bounded_indent, wordwrap=pass_environment(bounded_wordwrap),
                   replace=pass_eval_context(bounded_replace), format=bounded_format,
                   join=pass_eval_context(bounded_join))
