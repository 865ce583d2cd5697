"""The Jinja environment a chat template runs in: the bounded sandbox (``_chat_bounds``)
with the names ``transformers`` gives templates (the ``generation`` tag, ``tojson``,
``raise_exception``, ``strftime_now``, ``dict``) and a ``namespace`` that refuses
underscore names. Imports jinja2: ``_chat`` loads it only when a template is compiled."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext

from workbench.data._chat_bounds import BoundedSandbox, bound_loops, check_size


class Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training
    masks in transformers; rendered here as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                      ).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore names (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:   # Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, check_size(value))

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore names on a namespace ({name!r})")


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_template(template: str) -> Any:
    """``template`` compiled in the environment (its loops bounded: ``bound_loops``)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = Namespace
    env.bound_filters()
    return env.from_string(bound_loops(env.parse(template)))
