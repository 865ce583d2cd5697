"""The bounds on rendering a chat template (untrusted code): a deadline and a size cap.

:class:`BoundedSandbox` is Jinja's ``ImmutableSandboxedEnvironment`` that, while a
:func:`budget` is open, checks the deadline at every call, attribute or item lookup,
intercepted operator (``+ * ** %``), filter and ``for`` item (a loop that outputs nothing
is stopped too), and refuses any value larger than the size cap before it is built where
it can tell (``"x" * n``, ``a + b``, big powers, width arguments, ``lipsum``) and after it
where it cannot (a filter's or a call's result). The caller streams the output
(``Template.generate``) and counts it against the same cap.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import generate_lorem_ipsum

__all__ = ["BoundExceeded", "BoundedSandbox", "budget", "check_size", "tick"]

#: The most words ``lipsum`` makes (``n * max``; Jinja's default is 500).
MAX_LIPSUM_WORDS = 10_000
#: The most bits of an integer a template computes (``10**10**9`` would take minutes).
MAX_INT_BITS = 1 << 16
#: Filters whose integer arguments are widths or lengths of the text they make.
_WIDTH_FILTERS = ("center", "indent", "wordwrap", "truncate")
_DIGITS = re.compile(r"\d+")
_NESTED = re.compile(r"\{[^{}]*\{")   # a str.format field whose spec holds a field


class BoundExceeded(Exception):
    """Raised through Jinja when a render passes a bound (``bound``: its name, "MAX_SECONDS",
    "MAX_CHARS" or one of this module's); the caller turns it into its own error naming
    the template."""

    def __init__(self, bound: str, detail: str) -> None:
        super().__init__(detail)
        self.bound, self.detail = bound, detail


@dataclasses.dataclass(frozen=True)
class _Budget:
    deadline: float
    seconds: float
    max_chars: int


class _Open(threading.local):
    """The budget of the render running in this thread (a render is synchronous: one thread,
    start to end), or None."""

    budget: _Budget | None = None


_OPEN = _Open()


@contextlib.contextmanager
def budget(seconds: float, max_chars: int) -> Iterator[None]:
    """Renders inside this block stop after ``seconds`` and at values above ``max_chars``."""
    outer = _OPEN.budget
    _OPEN.budget = _Budget(time.monotonic() + seconds, seconds, max_chars)
    try:
        yield
    finally:
        _OPEN.budget = outer


def tick() -> None:
    """Raises :class:`BoundExceeded` past the open budget's deadline."""
    b = _OPEN.budget
    if b is not None and time.monotonic() > b.deadline:
        raise BoundExceeded("MAX_SECONDS", f"it ran past {b.seconds:g} s")


def check_size(value: Any) -> Any:
    """``value``, unless it is text or a container longer than the cap (or a huge int)."""
    b = _OPEN.budget
    if b is None:
        return value
    if isinstance(value, (str, list, tuple, dict)) and len(value) > b.max_chars:
        raise BoundExceeded("MAX_CHARS", f"it built a {type(value).__name__} of {len(value):,} "
                                    f"items (the cap is {b.max_chars:,})")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise BoundExceeded("MAX_INT_BITS", f"it computed an integer of "
                            f"{value.bit_length():,} bits (the cap is {MAX_INT_BITS:,})")
    return value


def _cap(n: float, what: str) -> None:
    b = _OPEN.budget
    if b is not None and n > b.max_chars:
        raise BoundExceeded("MAX_CHARS", f"{what} would hold {n:,.0f} items (the cap is "
                                    f"{b.max_chars:,})")


def _check_binop(op: str, left: Any, right: Any) -> None:
    """Refuses, before it is computed, a result above the caps."""
    sized = (str, list, tuple)
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(n, int):
                _cap(len(seq) * max(n, 0), f"{type(seq).__name__} * {n}")
        if isinstance(left, int) and isinstance(right, int) and \
                left.bit_length() + right.bit_length() > MAX_INT_BITS:
            bits = left.bit_length() + right.bit_length()
            raise BoundExceeded("MAX_INT_BITS", f"a product of {bits:,} bits (the cap is "
                                                f"{MAX_INT_BITS:,})")
    elif op == "+" and isinstance(left, sized) and isinstance(right, sized):
        _cap(len(left) + len(right), f"{type(left).__name__} + {type(right).__name__}")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
            and right > 0 and right * math.log2(abs(left)) > MAX_INT_BITS:
        raise BoundExceeded("MAX_INT_BITS",
                            f"{left} ** {right} has more than {MAX_INT_BITS:,} bits")
    elif op == "%" and isinstance(left, str):
        _check_format(left, right if isinstance(right, tuple) else (right,), {})


def _check_format(fmt: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """Widths in a format string above the size cap are refused, and so are integer
    arguments where the string takes its widths from them (``%*d``, ``{:{}}``)."""
    if not isinstance(fmt, str):
        return
    for digits in _DIGITS.findall(fmt):
        _cap(int(digits) if len(digits) < 20 else math.inf, f"a width of {digits[:20]}")
    if "*" in fmt or _NESTED.search(fmt):
        _check_widths(args, kwargs)


def _check_widths(args: Any, kwargs: dict[str, Any]) -> None:
    """Integer arguments (widths, lengths) above the size cap are refused."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool):
            _cap(abs(v), f"an argument of {v}")


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """Jinja's ``lipsum``, at most :data:`MAX_LIPSUM_WORDS` words."""
    tick()
    if not all(isinstance(v, int) for v in (n, min, max)) or n * max > MAX_LIPSUM_WORDS:
        raise BoundExceeded("MAX_LIPSUM_WORDS", f"lipsum(n={n!r}, max={max!r}) asks for more than "
                                    f"{MAX_LIPSUM_WORDS:,} words")
    return generate_lorem_ipsum(n, html, min, max)


def bounded_range(*args: int) -> range:
    """Jinja's sandboxed ``range`` (at most 100,000 items), checking the deadline."""
    tick()
    return safe_range(*args)


class _Ticking:
    """An iterable that checks the deadline at each item (its length is the wrapped one's,
    so that ``loop.length`` works as before)."""

    def __init__(self, iterable: Any) -> None:
        self._iterable = iterable

    def __len__(self) -> int:
        return len(self._iterable)

    def __iter__(self) -> Iterator[Any]:
        for item in self._iterable:
            tick()
            yield item


class Loops(Extension):
    """Makes every ``{% for %}`` iterate through :class:`_Ticking`: with no call in its
    body a loop would otherwise run unchecked."""

    def _ticking(self, iterable: Any) -> _Ticking:
        return _Ticking(iterable)


def bound_loops(tree: nodes.Template) -> nodes.Template:
    """``tree`` with each for loop's iterable wrapped (by the extension's own attribute,
    which no template variable can shadow)."""
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(nodes.ExtensionAttribute(Loops.identifier, "_ticking"),
                               [loop.iter], [], None, None, lineno=loop.lineno)
    return tree


def _bounded_filter(name: str, f: Any) -> Any:
    def bounded(*args: Any, **kwargs: Any) -> Any:
        tick()
        if name == "format":
            _check_format(args[0] if args else None, args[1:], kwargs)
        elif name in _WIDTH_FILTERS:
            _check_widths(args[1:], kwargs)
        return check_size(f(*args, **kwargs))

    bounded.__dict__.update(getattr(f, "__dict__", {}))   # pass_context / ... marks
    bounded.__name__ = getattr(f, "__name__", name)
    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the open :func:`budget`'s deadline and size cap."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["extensions"] = [*kwargs.get("extensions", ()), Loops]
        super().__init__(*args, **kwargs)
        self.globals["range"] = bounded_range
        self.globals["lipsum"] = lipsum

    def bound_filters(self) -> None:
        """Wraps every filter (call after the last one is added)."""
        self.filters = {k: _bounded_filter(k, f) for k, f in self.filters.items()}

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        tick()
        for v in (*args, *kwargs.values()):
            check_size(v)
        name = getattr(__obj, "__name__", None)
        if name in ("format", "format_map"):   # the sandbox's wrapper of str.format
            _check_format(getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None),
                          args, kwargs)
        elif name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
            _check_widths(args, kwargs)
        return check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        tick()
        _check_binop(operator, left, right)
        return check_size(super().call_binop(context, operator, left, right))
