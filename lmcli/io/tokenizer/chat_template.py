"""Chat templates: Jinja in a sandbox, with the helpers templates are written against.

Templates come with checkpoints, so they run in jinja2's ImmutableSandboxedEnvironment: no attribute
access to Python internals, no mutation of the values passed in. A template is also code from a
stranger that could ask for `'a' * 10**10`, so its resources are bounded (`render_bounded`):
- every string or list it builds holds at most MAX_ITEMS characters or items, measured before it is
  built (template_limits.py): operators, `.format`, str methods, filters, the text `{{ ... }}` shows,
  and the buffers that blocks and macros collect;
- `*` and `**` of integers have bounded results, and range() is bounded by jinja2's sandbox (MAX_RANGE);
- the output holds at most MAX_OUTPUT characters, and rendering stops after MAX_SECONDS.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache
from typing import Any

from lmcli.io.tokenizer.template_limits import (
    TemplateLimitError,
    check_binop,
    check_method_call,
    check_percent_format,
    check_size,
    check_str_format,
    check_text,
    joined_size,
    text_size,
)

MAX_OUTPUT = 1_000_000  # characters of rendered prompt (far beyond any model's context)
MAX_SECONDS = 5.0  # real templates render in milliseconds


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

        def buffer(self, frame):  # what blocks, macros and `{% set %}...{% endset %}` collect: bounded
            frame.buffer = self.temporary_identifier()
            self.writeline(f"{frame.buffer} = environment.bounded_buffer()")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset(["*", "+", "%", "**"])
        bounded_buffer = _BoundedBuffer

        def call_binop(self, context, operator, left, right):
            check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # jinja2's signature
            owner = getattr(__obj, "__self__", None)
            if owner is not None:
                args = check_method_call(owner, getattr(__obj, "__name__", ""), args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):  # "...".format(...): the sandbox's formatter, bounded
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            text, is_map = value.__self__, value.__name__ == "format_map"

            def bounded_format(*args, **kwargs):
                mapping = args[0] if is_map and len(args) == 1 and isinstance(args[0], dict) else kwargs
                check_str_format(text, () if is_map else args, mapping)
                return wrapped(*args, **kwargs)

            return bounded_format

        @staticmethod
        def bounded_concat(parts):
            check_size(sum(text_size(part) for part in parts), "a joined string")
            return "".join(str(part) for part in parts)

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

    environment = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols],
                                 finalize=lambda value: check_text(value, "a value shown as text"))
    environment.filters["tojson"] = tojson
    _bound_sized_filters(environment.filters)
    environment.globals["lipsum"] = _bounded_lipsum(environment.globals["lipsum"])
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment


class _BoundedBuffer(list):
    """The text a block or macro collects before it is joined: at most MAX_ITEMS characters."""

    size = 0

    def append(self, piece: Any) -> None:
        self.size += text_size(piece)
        check_size(self.size, "a block's text")
        super().append(piece)

    def extend(self, pieces: Any) -> None:
        for piece in pieces:
            self.append(piece)


def _bounded_lipsum(lipsum: Any) -> Any:
    def bounded_lipsum(n=5, html=True, min=20, max=100):
        check_size(n * max * 16, "lipsum's result")  # words of at most 15 letters and a space
        return lipsum(n, html, min, max)

    return bounded_lipsum


# Filters that turn their input into text: the input's text is measured first.
_TEXT_FILTERS = ("capitalize", "e", "escape", "forceescape", "lower", "upper", "title", "trim", "striptags",
                 "truncate", "wordcount", "urlize", "urlencode", "pprint", "string", "safe", "xmlattr", "int",
                 "float", "tojson")


def _bound_sized_filters(filters: dict[str, Any]) -> None:
    """Filters whose result size a template chooses: checked like the operators."""
    center, indent, wordwrap, replace, format_, join, batch, slice_, sum_ = (
        filters[name] for name in ("center", "indent", "wordwrap", "replace", "format", "join", "batch", "slice",
                                   "sum"))

    def bounded_center(value, width=80):
        check_size(width, "center's result")
        return center(check_text(value, "center's input"), width)

    def bounded_indent(value, width=4, *args, **kwargs):
        check_size(text_size(value) * (1 + (width if isinstance(width, int) else text_size(width))), "indent's result")
        return indent(value, width, *args, **kwargs)

    def bounded_wordwrap(environment, value, width=79, *args, **kwargs):
        check_size(text_size(value) * 2 + (width if isinstance(width, int) else 0), "wordwrap's result")
        return wordwrap(environment, value, width, *args, **kwargs)

    def bounded_replace(eval_ctx, value, old, new, count=None):
        text = str(check_text(value, "replace's input"))
        old, new = str(check_text(old, "replace's input")), str(check_text(new, "replace's input"))
        times = text.count(old) if old else len(text) + 1
        check_size(len(text) + times * max(len(new) - len(old), 0), "replace's result")
        return replace(eval_ctx, value, old, new, count)

    def bounded_format(value, *args, **kwargs):
        if isinstance(value, str):
            check_percent_format(value, kwargs if kwargs else tuple(args))
        return format_(value, *args, **kwargs)

    def bounded_join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        if attribute is None:
            check_size(joined_size(items, d), "join's result")
        return join(eval_ctx, items, d, attribute)

    def bounded_batch(value, linecount, fill_with=None):
        if fill_with is not None and isinstance(linecount, int):
            check_size(linecount, "batch's rows")
        return batch(value, linecount, fill_with)

    def bounded_slice(value, slices, fill_with=None):
        if isinstance(slices, int):
            check_size(slices, "slice's result")
        return slice_(value, slices, fill_with)

    def bounded_sum(environment, iterable, attribute=None, start=0):
        items = list(iterable)
        if attribute is None and isinstance(start, (list, tuple, str)):
            check_size(len(start) + sum(len(x) for x in items if isinstance(x, (list, tuple, str))), "sum's result")
        return sum_(environment, items, attribute, start)

    from jinja2.utils import pass_environment, pass_eval_context

    for name in _TEXT_FILTERS:
        filters[name] = _measuring_input(filters[name], name)
    filters.update(center=bounded_center, indent=bounded_indent, wordwrap=pass_environment(bounded_wordwrap),
                   replace=pass_eval_context(bounded_replace), format=bounded_format,
                   join=pass_eval_context(bounded_join), batch=bounded_batch, slice=bounded_slice,
                   sum=pass_environment(bounded_sum))


def _measuring_input(function: Any, name: str) -> Any:
    """`function` (a filter), refusing an input whose text would be over the limit."""
    import functools

    @functools.wraps(function)  # keeps jinja2's pass_context/pass_environment marks
    def measured(*args, **kwargs):
        for value in args:
            if not hasattr(value, "environment") and not hasattr(value, "autoescape"):  # not jinja2's own
                check_text(value, f"{name}'s input")
        return function(*args, **kwargs)

    return measured
