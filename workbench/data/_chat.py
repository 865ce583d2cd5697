"""Chat templates: a model's Jinja template rendered the way ``transformers``'
``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` renders it.

The same environment as transformers: Jinja's sandbox (templates come from the Hub and
are untrusted code), ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block (rendered as its body), ``tojson`` without HTML
escaping, and the globals ``raise_exception``, ``strftime_now``, ``dict`` and a
``namespace`` that refuses underscore names. The template sees ``messages``, ``tools``
(None), ``documents`` (None), ``add_generation_prompt`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...), as transformers passes them.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["ChatTemplateError", "check_messages", "render"]

#: The names a message's reasoning goes by; templates read the first (transformers'
#: aliasing: each message with one of them gets ``reasoning_content`` and ``thinking``).
_REASONING = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or that raised while rendering."""


def check_messages(messages: Any, where: str = "wb.generate") -> list[dict[str, Any]]:
    """``messages`` as transformers hands them to a template: a non-empty list of dicts
    with a string ``role``, keys whose value is None dropped, plain JSON values only."""
    fix = ('give a list of {"role": ..., "content": ...} dicts, e.g. '
           'messages=[{"role": "user", "content": "Hi!"}]')
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"{where}: messages={_short(messages)} is a "
                        f"{type(messages).__name__}; {fix}")
    if not messages:
        raise ValueError(f"{where}: messages=[] is empty; {fix}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"{where}: messages[{i}]={_short(m)} is a {type(m).__name__}, "
                            f"not a message; {fix}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{where}: messages[{i}] has no string 'role' (got "
                             f"{_short(m.get('role'))}); {fix}")
        m = {str(k): _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(value: Any) -> Any:
    """Plain JSON data (what transformers lets a template see): other objects become a
    placeholder naming their type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore names on a namespace ({name!r})")

    class Dict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = Dict()
    env.globals["namespace"] = Namespace
    return env.from_string(template)


def render(template: str, messages: Any, special_tokens: Mapping[str, str], *,
           add_generation_prompt: bool = True, where: str = "wb.generate",
           source: str = "the chat template", **kwargs: Any) -> str:
    """``messages`` rendered by ``template`` (a Jinja chat template).

    Args:
        template: the template text (``tokenizer_config.json``'s ``chat_template`` or
            ``chat_template.jinja``).
        messages: ``[{"role": ..., "content": ...}, ...]``.
        special_tokens: ``bos_token``, ``eos_token``, ... (the template may use them).
        add_generation_prompt: end with the header of the assistant's turn.
        where, source: named in errors.
        **kwargs: more template variables (``enable_thinking=False`` for Qwen3).

    Raises:
        ChatTemplateError: the template does not compile, or raised (its own message).
    """
    import jinja2

    msgs = check_messages(messages, where)
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: {source} is not a valid Jinja template ({e.message}"
                                f", line {e.lineno}); fix the template, or pass token ids or "
                                "a text prompt instead of messages") from None
    context = {**{k: _plain(v) for k, v in special_tokens.items()}, **_plain(kwargs)}
    try:
        return str(compiled.render(messages=msgs, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **context))
    except Exception as e:   # noqa: BLE001 - a template is code: whatever it raises
        raise ChatTemplateError(f"{where}: {source} refused these messages: {e}; change "
                                "the messages (the roles and order the template expects)"
                                ) from None
