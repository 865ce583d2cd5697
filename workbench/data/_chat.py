"""Chat templates: a model's Jinja template rendered the way ``transformers``'
``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` renders it.

The same environment as transformers: Jinja's sandbox (templates come from the Hub and
are untrusted code), ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block (rendered as its body), ``tojson`` without HTML
escaping, and the globals ``raise_exception``, ``strftime_now``, ``dict`` and a
``namespace`` that refuses underscore names. The template sees ``messages``, ``tools``
(None), ``documents`` (None), ``add_generation_prompt`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...), as transformers passes them.

A template is untrusted code, so a render is bounded (:mod:`workbench.data._chat_bounds`):
it stops after :data:`MAX_SECONDS` seconds, and at :data:`MAX_CHARS` characters of output
(or of any string or list it builds), with a :class:`ChatTemplateError` naming the
template's file. Both are read at each render; ``wb.data.chat_limits(seconds=30,
chars=...)`` changes them for the process. Messages are checked first: plain JSON data
at most :data:`MAX_DEPTH` levels deep, no container holding itself, no lone surrogate.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_CHARS", "MAX_DEPTH", "MAX_SECONDS", "ChatTemplateError", "chat_limits",
           "check_messages", "render"]

#: Seconds a render may take (chat templates render in milliseconds).
MAX_SECONDS = 10.0
#: Characters a render may output, and items of any string or list it builds (a 1M-token
#: context is about 4M characters).
MAX_CHARS = 16_000_000
#: Nesting levels of a message's data (``{"content": [{"type": "text", ...}]}`` is 3).
MAX_DEPTH = 64

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
        m = {str(k): _plain(v, f"{where}: messages[{i}][{k!r}]", 1, frozenset({id(m)}))
             for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(value: Any, path: str, depth: int = 0, seen: frozenset[int] = frozenset()) -> Any:
    """Plain JSON data (what transformers lets a template see): other objects become a
    placeholder naming their type. Raises ValueError naming ``path`` (``"wb.generate:
    messages[0]['content']"``) for data nested deeper than :data:`MAX_DEPTH`, a container
    holding itself, or text with a lone surrogate."""
    if value is None or type(value) in (int, float, bool):
        return value
    if isinstance(value, str):
        return _text(str.__str__(value), path)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if not isinstance(value, (Mapping, list, tuple)):
        return f"<{type(value).__name__}>"
    if id(value) in seen:
        raise ValueError(f"{path} contains itself (a {type(value).__name__} that holds "
                         "itself, which no template can render); give plain JSON data")
    if depth >= MAX_DEPTH:
        shown = path if len(path) <= 100 else path[:97] + "..."
        raise ValueError(f"{shown} is nested more than {MAX_DEPTH} levels deep; give flatter "
                         "data (or raise workbench.data._chat.MAX_DEPTH)")
    seen = seen | {id(value)}
    if isinstance(value, Mapping):
        return {_plain(k, f"{path} (a key)", depth + 1, seen):
                _plain(v, f"{path}[{k!r}]", depth + 1, seen) for k, v in value.items()}
    items = [_plain(v, f"{path}[{j}]", depth + 1, seen) for j, v in enumerate(value)]
    return items if isinstance(value, list) else tuple(items)


def _text(text: str, path: str) -> str:
    """``text``, unless it holds a lone surrogate (no tokenizer encodes one)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{path} holds a lone surrogate ({text[e.start]!r} at character "
                             f"{e.start}), which is not Unicode text and no tokenizer can "
                             "encode; fix the text where it came from, e.g. "
                             "text.encode('utf-8', 'replace').decode()") from None
    return text


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    from workbench.data._chat_env import compile_template  # jinja2, only when compiling

    return compile_template(template)


def render(template: str, messages: Any, special_tokens: Mapping[str, str], *,
           add_generation_prompt: bool = True, where: str = "wb.generate",
           source: str = "the chat template", **kwargs: Any) -> str:
    """``messages`` rendered by ``template`` (a Jinja chat template), within
    :data:`MAX_SECONDS` and :data:`MAX_CHARS`.

    Args:
        template: the template text (``tokenizer_config.json``'s ``chat_template`` or
            ``chat_template.jinja``).
        messages: ``[{"role": ..., "content": ...}, ...]``.
        special_tokens: ``bos_token``, ``eos_token``, ... (the template may use them).
        add_generation_prompt: end with the header of the assistant's turn.
        where, source: named in errors (``source``: the template's file).
        **kwargs: more template variables (``enable_thinking=False`` for Qwen3).

    Raises:
        ValueError: a message (or a variable) is nested too deep, holds itself, or holds
            a lone surrogate (naming it).
        ChatTemplateError: the template does not compile, raised (its own message), ran
            past :data:`MAX_SECONDS` or output more than :data:`MAX_CHARS`.
    """
    import jinja2

    from workbench.data._chat_bounds import BoundExceeded, budget, tick

    msgs = check_messages(messages, where)
    context = {**{k: _plain(v, f"{where}: special token {k!r}")
                  for k, v in special_tokens.items()},
               **{k: _plain(v, f"{where}: {k}=") for k, v in kwargs.items()}}
    seconds, max_chars = _limits()
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: {source} is not a valid Jinja template ({e.message}"
                                f", line {e.lineno}); fix the template, or pass token ids or "
                                "a text prompt instead of messages") from None
    parts, size = [], 0
    try:
        with budget(seconds, max_chars):
            for chunk in compiled.generate(messages=msgs, tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt,
                                           **context):
                size += len(chunk)
                if size > max_chars:
                    raise BoundExceeded("MAX_CHARS",
                                        f"its output passed {max_chars:,} characters")
                tick()
                parts.append(chunk)
    except BoundExceeded as e:
        raise ChatTemplateError(_bound_message(e, where, source)) from None
    except Exception as e:   # noqa: BLE001 - a template is code: whatever it raises
        raise ChatTemplateError(f"{where}: {source} refused these messages: {e}; change "
                                "the messages (the roles and order the template expects)"
                                ) from None
    text = "".join(parts)
    try:
        return _text(text, "its output")
    except ValueError as e:
        raise ChatTemplateError(f"{where}: {source} rendered text that no tokenizer can "
                                f"encode: {e}".split("; fix")[0] + "; fix the template") \
            from None


#: The least each bound may be set to (a render takes milliseconds; a prompt thousands of
#: characters): smaller values would stop every chat.
MIN_SECONDS, MIN_CHARS = 0.1, 10_000


def chat_limits(*, seconds: float | None = None, chars: int | None = None
                ) -> dict[str, float | int]:
    """The bounds of a chat template's render, changed for this process where given.

    A chat template is untrusted code from the Hub: a render stops after ``seconds`` (default
    10) and at ``chars`` characters of output, or of any string or list it builds (default
    16,000,000, about 4M tokens), with a ``ChatTemplateError`` naming the template's file.

    Example::

        wb.data.chat_limits(seconds=30)      # {"seconds": 30.0, "chars": 16000000}

    Raises:
      ValueError: a value that is not a finite number of at least 0.1 s, or an int of at
        least 10,000 characters.
    """
    global MAX_SECONDS, MAX_CHARS
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
                not (math.isfinite(seconds) and seconds >= MIN_SECONDS):
            raise ValueError(f"chat_limits: seconds={seconds!r} must be a finite number of "
                             f"seconds >= {MIN_SECONDS}, e.g. seconds=30")
        MAX_SECONDS = float(seconds)
    if chars is not None:
        if isinstance(chars, bool) or not isinstance(chars, int) or chars < MIN_CHARS:
            raise ValueError(f"chat_limits: chars={chars!r} must be an int >= {MIN_CHARS:,} "
                             "(characters), e.g. chars=64_000_000")
        MAX_CHARS = chars
    return {"seconds": MAX_SECONDS, "chars": MAX_CHARS}


def _limits() -> tuple[float, int]:
    """:data:`MAX_SECONDS` and :data:`MAX_CHARS` as set now, checked."""
    seconds, chars = MAX_SECONDS, MAX_CHARS
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"workbench.data._chat.MAX_SECONDS={seconds!r} must be a positive "
                         "number of seconds, e.g. 10.0")
    if isinstance(chars, bool) or not isinstance(chars, int) or chars <= 0:
        raise ValueError(f"workbench.data._chat.MAX_CHARS={chars!r} must be a positive int "
                         "(characters), e.g. 16_000_000")
    return float(seconds), chars


def _bound_message(e: Any, where: str, source: str) -> str:
    if e.bound in ("MAX_SECONDS", "MAX_CHARS"):
        key = "seconds" if e.bound == "MAX_SECONDS" else "chars"
        past, fix = f"its {e.bound} bound", f"wb.data.chat_limits({key}=...)"
    else:
        past = fix = f"workbench.data._chat_bounds.{e.bound}"
    return (f"{where}: {source} was stopped: {e.detail}, past {past}. A chat template is "
            f"untrusted code: check the template (use the model's own), or raise {fix} if "
            "this chat really needs more")
