"""Checks of a cluster request's fields (``Slurm``, ``Hosts``, ``TPUSlice``): types, ranges,
and the text that enters a batch script or a remote shell command.

Every value that reaches a shell is either a *word* (a partition, a host, an environment
variable's name: letters, digits and a few marks, so it needs no quoting) or *one line*
of text that is quoted with ``shlex.quote`` where it is written. A newline, a carriage
return or any other control character is refused everywhere: in a batch script it ends the
``#SBATCH`` line and runs the rest as a command (and ``sbatch`` drops every ``#SBATCH``
option after the first line that is not one). ``setup`` lines are shell commands by design
(``source $HOME/venv/bin/activate``): each must be a string of one line.
"""
from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from typing import Any

from workbench._validate import check_float, check_int

__all__ = ["PLATFORMS", "env_vars", "fanout", "host", "lines", "one_line", "optional_int",
           "path_text", "platform", "positive_seconds", "shell_path", "word"]

#: The platforms a worker can be asked for (``python -m workbench train --platform``).
PLATFORMS = ("cpu", "gpu", "tpu")
#: What a *word* may hold: shlex.quote leaves these unquoted, and no shell or ``#SBATCH``
#: parser gives any of them a meaning.
_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+:@%=,/\[\]-]*")
_WORD_TEXT = ("letters, digits and _ . - + : @ % = , / [ ] (starting with a letter, a digit "
              "or _)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _control(text: str) -> str | None:
    """A description of the first control character in ``text`` (None if there is none)."""
    for i, ch in enumerate(text):
        if ord(ch) < 32 or ord(ch) == 127:
            name = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab",
                    "\0": "a NUL"}.get(ch, f"the control character {ch!r}")
            return f"{name} at index {i}"
    return None


def one_line(value: Any, field: str, where: str, *, example: str, paths: bool = False,
             fix: str = "") -> str:
    """``value`` as a string without control characters (it is quoted where it is written).

    Raises:
      TypeError: not a string (or, with ``paths``, a path).
      ValueError: empty, or holds a newline or another control character.
    """
    head = f"{where}({field}={value!r})"
    if paths and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{head}: {field} must be a string, got {type(value).__name__}; "
                        f"e.g. {field}={example}")
    if not value.strip():
        raise ValueError(f"{head}: {field} is empty; e.g. {field}={example}")
    bad = _control(value)
    if bad:
        raise ValueError(f"{head}: {field} holds {bad}, which would end the line it is "
                         "written on and run the rest as a shell command; "
                         + (fix or f"write it on one line, e.g. {field}={example}"))
    return value


def word(value: Any, field: str, where: str, *, example: str) -> str:
    """``value`` as a string of :data:`_WORD` characters only (no quoting needed anywhere).

    Raises:
      TypeError: not a string.
      ValueError: empty, or holds whitespace, quotes, ``$``, backticks, ``;``, ``&``, ``|``,
        a leading ``-`` (read as an option), or any other character outside the set.
    """
    text = one_line(value, field, where, example=example)
    if not _WORD.fullmatch(text):
        bad = next((c for c in text if not _WORD.fullmatch("a" + c)), text[0])
        raise ValueError(f"{where}({field}={value!r}): {field} may hold only {_WORD_TEXT}, "
                         f"not {bad!r} (a shell would read it); e.g. "
                         f"{field}={example}")
    return text


def lines(value: Any, field: str, where: str, *, example: str,
          each: str = "one line") -> tuple[str, ...]:
    """A list of one-line strings as a tuple (a bare string is refused: it is no list)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}({field}={value!r}): {field} takes a list of strings "
                        f"({each} each), e.g. {field}={example}")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise TypeError(f"{where}({field}={value!r}): {field}[{i}]={item!r} is not a "
                            f"string ({type(item).__name__}); {field} takes strings, e.g. "
                            f"{field}={example}")
        out.append(one_line(item, f"{field}[{i}]", where, example=example,
                            fix=f"give each line as its own entry, e.g. {field}={example}"))
    return tuple(out)


def env_vars(value: Any, where: str) -> dict[str, str]:
    """Environment variables as ``{NAME: value}`` strings (ints and floats are written out).

    Names must be shell identifiers; values are quoted where written, and must be one line.
    """
    example = "{'OMP_NUM_THREADS': '4'}"
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}(env={value!r}): env takes a dict of variable names to "
                        f"values, e.g. env={example}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not _ENV_NAME.fullmatch(k):
            raise ValueError(f"{where}(env={{{k!r}: ...}}): {k!r} is not an environment "
                             "variable name (letters, digits and _, not starting with a "
                             f"digit); e.g. env={example}")
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise TypeError(f"{where}(env={{{k!r}: {v!r}}}): the value of {k} must be a "
                            f"string (or a number), got {type(v).__name__}; e.g. env={example}")
        out[k] = one_line(str(v), f"env[{k!r}]", where, example="'4'") if str(v) else ""
    return out


def platform(value: Any, where: str) -> str | None:
    """None, or one of :data:`PLATFORMS`."""
    if value is None:
        return None
    if value not in PLATFORMS:
        raise ValueError(f"{where}(platform={value!r}): platform must be one of "
                         f"{', '.join(map(repr, PLATFORMS))}, or None for JAX's default on the "
                         "node")
    return str(value)


def optional_int(value: Any, field: str, where: str, *, minimum: int = 1,
                 maximum: int | None = None, fix: str = "") -> int | None:
    """None, or an int in range (a bool, a float or a string is refused, naming the field)."""
    if value is None:
        return None
    return check_int(value, field, minimum=minimum, maximum=maximum, where=f"{where}: ",
                     fix=fix)


def positive_seconds(value: Any, field: str, where: str) -> float:
    """A finite number of seconds > 0."""
    return check_float(value, field, positive=True, where=f"{where}: ", example="30")


def shell_path(text: str) -> str:
    """``text`` shell-quoted, except a leading ``~/``, which stays the home directory of
    whoever runs the line (``'~/venv/bin/python'`` quoted whole would name a folder ``~``)."""
    if text.startswith("~/"):
        return '"$HOME"/' + shlex.quote(text[2:])
    return shlex.quote(text)


def path_text(path: Any, what: str, fix: str) -> str:
    """``path`` as text, refused when it holds a control character (it enters a script)."""
    text = os.fspath(path)
    bad = _control(text)
    if bad:
        raise ValueError(f"{what} {text!r} holds {bad}: it would end a line of the job's "
                         f"script and run the rest as a shell command; {fix}")
    return text


def host(value: Any, i: int) -> str:
    """An ssh destination (``node1``, ``user@10.0.0.2``): one word, not read as an option."""
    text = one_line(value, f"hosts[{i}]", "wb.Hosts", example="'node1'")
    bad = next((c for c in text if not (c.isascii() and (c.isalnum() or c in "_.:@%[]/-"))),
               None)
    if bad is not None or text.startswith("-"):
        raise ValueError(f"wb.Hosts(hosts[{i}]={text!r}): a host is an ssh destination such "
                         "as 'node1' or 'user@10.0.0.2': letters, digits and _ . : @ % [ ] / -, "
                         + (f"not {bad!r}" if bad is not None else
                            "not starting with - (ssh would read it as an option)"))
    return text


def fanout(cluster: Any, where: str) -> None:
    """Checks the fields ``Hosts`` and ``TPUSlice`` share (normalized in place)."""
    set_ = object.__setattr__
    optional_int(cluster.devices_per_task, "devices_per_task", where,
                 fix="pass a positive int, or None for every device")
    platform(cluster.platform, where)
    for name, example in (("python", "'/opt/venv/bin/python'"), ("workdir", "'/shared/lab'")):
        if getattr(cluster, name) is not None:
            set_(cluster, name, one_line(getattr(cluster, name), name, where,
                                         example=example, paths=True))
    set_(cluster, "env", env_vars(cluster.env, where))
    set_(cluster, "setup", lines(cluster.setup, "setup", where,
                                 example="['source ~/venv/bin/activate']"))
    check_int(cluster.connect_timeout, "connect_timeout", where=f"{where}: ",
              fix="give the seconds ssh may take to connect, e.g. 20")
    positive_seconds(cluster.start_timeout, "start_timeout", where)
