"""Exercise and Result, and the parsers that read a learner's typed answer."""
from __future__ import annotations

import ast
import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

from jax.sharding import PartitionSpec

from workbench._display import Displayable

__all__ = ["AnswerError", "Exercise", "Result", "parse_axes", "parse_choice", "parse_number",
           "parse_ranges", "parse_spec", "parse_specs"]


class AnswerError(ValueError):
    """The answer could not be read; the message says how to write it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """The verdict on one answer.

    Attributes:
      correct: whether the answer is right.
      explanation: why (for a wrong answer: what the answer gives instead, and where).
      hint: a nudge towards the answer (empty when correct).
      answer: the answer as it was read.
    """

    correct: bool
    explanation: str
    hint: str = ""
    answer: str = ""

    def __bool__(self) -> bool:
        return self.correct

    def __str__(self) -> str:
        head = "correct" if self.correct else "not yet"
        text = f"{head}: {self.explanation}"
        return text + (f"\nhint: {self.hint}" if self.hint and not self.correct else "")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Exercise(Displayable):
    """One exercise: a prompt, how to read an answer, and a check against JAX.

    Attributes:
      name: registry key (``wb.exercise(name)``).
      title: one line.
      notebook: the teaching notebook it belongs to.
      prompt: the question, as text (may hold a short code block).
      placeholder: what an answer looks like.
      hint: shown after a wrong answer.
      solution: one accepted answer (for instructors and tests).
      parse: typed text or a Python value -> the value ``judge`` takes.
      judge: the parsed value -> ``Result`` (computed with JAX).
    """

    name: str
    title: str
    notebook: str
    prompt: str
    placeholder: str
    hint: str
    solution: str
    parse: Callable[[Any], Any]
    judge: Callable[[Any], Result]

    def check(self, answer: Any) -> Result:
        """Check an answer (text as typed, or a Python value such as a ``PartitionSpec``).

        Example::

            wb.exercise("spec_for_block").check("P('data', None, 'model')").correct  # True
        """
        shown = answer if isinstance(answer, str) else repr(answer)
        if isinstance(answer, str) and not answer.strip():
            return Result(correct=False, explanation="the answer is empty; write it like "
                          f"{self.placeholder}", hint=self.hint, answer="")
        try:
            value = self.parse(answer)
        except AnswerError as e:
            return Result(correct=False, explanation=str(e), hint=self.hint, answer=shown)
        result = self.judge(value)
        hint = "" if result.correct else (result.hint or self.hint)
        return dataclasses.replace(result, hint=hint, answer=shown)

    def __str__(self) -> str:
        return f"[{self.name}] {self.title}\n\n{self.prompt}\n\nanswer like: {self.placeholder}"

    def __repr__(self) -> str:
        return f"<Exercise {self.name!r}: {self.title}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


# ---------------------------------------------------------------------------
# Parsers: typed text -> Python values, with messages that say how to write it
# ---------------------------------------------------------------------------

_SPEC_NAMES = {"P", "PartitionSpec"}


def _literal(node: ast.AST, text: str) -> Any:
    """A literal made of strings, None and tuples/lists of them."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, str)):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(_literal(e, text) for e in node.elts)
    if isinstance(node, ast.Name):
        raise AnswerError(
            f"{node.id!r} in {text!r} is a bare name; mesh axis names are strings: write "
            f"'{node.id}' in quotes (and None, unquoted, for a dim that is not split)")
    raise AnswerError(f"could not read {ast.unparse(node)!r} in {text!r}: each entry is a "
                      "mesh axis name in quotes, a tuple of them, or None")


def _spec_from_node(node: ast.AST, text: str) -> PartitionSpec:
    if isinstance(node, ast.Call):
        func = node.func
        fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if fname not in _SPEC_NAMES or node.keywords:
            raise AnswerError(f"{text!r}: write a PartitionSpec as P('data', None, 'model')")
        return PartitionSpec(*(_literal(a, text) for a in node.args))
    value = _literal(node, text)
    if isinstance(value, tuple):
        return PartitionSpec(*value)
    return PartitionSpec(value)


def _parse_expr(text: str, what: str, example: str) -> ast.AST:
    try:
        return ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise AnswerError(f"could not read {text.strip()!r} as {what}; write it like {example}") \
            from None


def parse_spec(answer: Any) -> PartitionSpec:
    """``"P('data', None, 'model')"``, ``"('data', None)"``, a tuple or a PartitionSpec."""
    if isinstance(answer, PartitionSpec):
        return answer
    if isinstance(answer, (tuple, list)):
        return PartitionSpec(*answer)
    if answer is None:
        return PartitionSpec()
    node = _parse_expr(str(answer), "a PartitionSpec", "P('data', None, 'model')")
    return _spec_from_node(node, str(answer).strip())


def parse_specs(names: tuple[str, ...]) -> Callable[[Any], dict[str, PartitionSpec]]:
    """A parser for several named specs: ``"up=P(None, 'model'), down=P('model', None)"``,
    or the specs in order, or a dict."""
    example = ", ".join(f"{n}=P(...)" for n in names)

    def parse(answer: Any) -> dict[str, PartitionSpec]:
        if isinstance(answer, dict):
            if set(answer) != set(names):
                raise AnswerError(f"give exactly the specs {', '.join(names)}: {example}")
            return {n: parse_spec(answer[n]) for n in names}
        if isinstance(answer, (tuple, list)) and len(answer) == len(names):
            return {n: parse_spec(a) for n, a in zip(names, answer)}
        text = str(answer).strip()
        node = _parse_expr(f"_({text})", f"{len(names)} PartitionSpecs", example)
        assert isinstance(node, ast.Call)
        if node.keywords and not node.args:
            got = {k.arg: _spec_from_node(k.value, text) for k in node.keywords}
            unknown = set(got) - set(names)
            if unknown or len(got) != len(names):
                raise AnswerError(f"name the specs {', '.join(names)} exactly once each: "
                                  f"{example}")
            return got
        if len(node.args) == len(names) and not node.keywords:
            return {n: _spec_from_node(a, text) for n, a in zip(names, node.args)}
        raise AnswerError(f"give {len(names)} specs, one for each of {', '.join(names)}: "
                          f"{example}")

    return parse


def parse_axes(answer: Any) -> dict[str, int]:
    """Mesh axis sizes: ``"data=4, model=2"``, ``"{'data': 4, 'model': 2}"`` or a dict."""
    if isinstance(answer, dict):
        items = dict(answer)
    else:
        text = str(answer).strip()
        example = "data=4, model=2"
        if text.startswith("{"):
            try:
                items = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise AnswerError(f"could not read {text!r}; write it like {example}") from None
        else:
            node = _parse_expr(f"_({text})", "mesh axis sizes", example)
            assert isinstance(node, ast.Call)
            if node.args or not node.keywords:
                raise AnswerError(f"name every axis with its size, like {example}")
            try:
                items = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except ValueError:
                raise AnswerError(f"axis sizes are integers, like {example}") from None
    for name, size in items.items():
        if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool):
            raise AnswerError(f"axis {name!r}={size!r}: write axis names and integer sizes, "
                              "like data=4, model=2")
    return items


_UNITS = {"b": 1, "bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_number(unit: str | None = None) -> Callable[[Any], float]:
    """A parser for a number, optionally with a unit converted to ``unit`` (``"576 MiB"``)."""

    def parse(answer: Any) -> float:
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            return float(answer)
        text = str(answer).strip().replace(",", "").replace("_", "")
        m = re.fullmatch(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*([a-zA-Z]*)", text)
        if not m:
            raise AnswerError(f"could not read {text!r} as a number"
                              + (f" of {unit}, like 123 {unit}" if unit else ""))
        value, given = float(m.group(1)), m.group(2).lower()
        if not given or unit is None:
            if given and unit is None:
                raise AnswerError(f"{text!r}: give a plain number, without a unit")
            return value
        if given not in _UNITS or unit.lower() not in _UNITS:
            raise AnswerError(f"unknown unit {m.group(2)!r}; use {unit}")
        return value * _UNITS[given] / _UNITS[unit.lower()]

    return parse


def parse_choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    """A parser for one word out of ``options`` (case, '_' and spaces forgiven)."""

    def norm(s: str) -> str:
        return re.sub(r"[\s_]+", "-", s.strip().lower())

    def parse(answer: Any) -> str:
        got = norm(str(answer))
        for opt in options:
            if got in (norm(opt), norm(opt).replace("-", "")):
                return opt
        raise AnswerError(f"{str(answer).strip()!r} is not one of: {', '.join(options)}")

    return parse


def parse_ranges(answer: Any) -> tuple[tuple[int, int], ...]:
    """Index ranges ``"x[8:12, 4:8]"`` / ``"[8:12, 4:8]"`` -> ``((8, 12), (4, 8))``."""
    if isinstance(answer, (tuple, list)):
        try:
            return tuple((int(a), int(b)) for a, b in answer)
        except (TypeError, ValueError):
            raise AnswerError("give one (start, stop) pair per dim") from None
    text = str(answer).strip()
    inner = re.fullmatch(r"(?:\w+)?\s*\[(.*)\]", text)
    body = inner.group(1) if inner else text
    parts = [p.strip() for p in body.split(",")]
    out = []
    for p in parts:
        m = re.fullmatch(r"(\d+)\s*:\s*(\d+)", p)
        if not m:
            raise AnswerError(f"could not read {p!r} in {text!r}; write one start:stop per "
                              "dim, like x[8:12, 4:8]")
        out.append((int(m.group(1)), int(m.group(2))))
    return tuple(out)


def fmt_spec(spec: PartitionSpec) -> str:
    """``P('data', None)`` as the learner would type it."""
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def close(a: float, b: float, rel: float = 5e-3) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)
