"""Chat templates: Jinja in a sandbox, with the helpers templates are written against.

Templates come with checkpoints, so they run in jinja2's ImmutableSandboxedEnvironment: no attribute
access to Python internals, no mutation of the values passed in.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    environment = _chat_environment()
    return environment.from_string(source)


@lru_cache(maxsize=1)
def _chat_environment() -> Any:
    """The sandbox and helpers that chat templates are written against (the reference's set)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment
