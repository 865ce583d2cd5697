"""Argument checks shared by the config and API entry points: integers that are integers."""
from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MAX_TRAIN_STEPS", "check_float", "check_int", "check_path", "check_steps",
           "check_str", "nearest_multiples", "no_new_empty_dirs"]

#: The most updates a run may train to: the train state's step counter is int32.
MAX_TRAIN_STEPS = 2 ** 31 - 1


def check_int(value: Any, name: str, *, minimum: int | None = 1, maximum: int | None = None,
              allow: tuple[int, ...] = (), where: str = "", fix: str = "") -> int:
    """``value`` as a Python ``int``, or an error naming the value, the constraint and the fix.

    A bool is refused (``True`` is not a size), as are strings (``"64"``) and floats, even
    integral ones (``8.0``): a float batch or width reaches JAX as a float shape and fails
    far from where it was written. NumPy integers are accepted.

    Args:
      value: what was given.
      name: the argument's name as the user wrote it (``"TrainConfig.seed"``, ``"batch"``).
      minimum: the smallest allowed value (None: no lower bound).
      maximum: the largest allowed value (None: no upper bound).
      allow: further values allowed outside the range (``-1`` for an inferred mesh axis).
      where: a prefix for the message (``"wb.plan: "``).
      fix: what to do instead, appended to an out-of-range message.

    Raises:
      TypeError: ``value`` is not an integer.
      ValueError: ``value`` is out of range.
    """
    rng = _range_text(minimum, maximum, allow)
    head = f"{where}{name}={value!r}"
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{head} is a bool; {name} must be {rng} (True is not a number "
                        f"here): write {name}=<integer>")
    if isinstance(value, (int, np.integer)):
        number = int(value)
    elif isinstance(value, str):
        fix = f"write {name}={int(value.strip())}" if value.strip().lstrip("-").isdigit() \
            else f"give {name} as an integer"
        raise TypeError(f"{head} is a string; {name} must be {rng}: {fix}")
    elif isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            raise TypeError(f"{head} is not a finite number; {name} must be {rng}")
        if float(value).is_integer():
            fix = f"write {name}={int(value)}"
        else:
            lo, hi = math.floor(value), math.ceil(value)
            fix = f"pick {name}={lo} or {name}={hi}"
        raise TypeError(f"{head} is a float; {name} must be {rng}: {fix}")
    else:
        raise TypeError(f"{head} is a {type(value).__name__}; {name} must be {rng}")
    if number in allow:
        return number
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ValueError(f"{head} is out of range; {name} must be {rng}"
                         + (f": {fix}" if fix else ""))
    return number


def check_steps(steps: int, name: str, *, where: str = "") -> int:
    """``steps`` (an int already checked) unless it is past :data:`MAX_TRAIN_STEPS`, the
    int32 step counter's limit: a ValueError naming it (past it the counter wraps, and the
    run never reaches its target)."""
    if steps > MAX_TRAIN_STEPS:
        raise ValueError(f"{where}{name}={steps} is past {MAX_TRAIN_STEPS} (2**31 - 1), the "
                         "most the int32 step counter holds; give fewer steps")
    return steps


def check_float(value: Any, name: str, *, minimum: float | None = None,
                positive: bool = False, where: str = "", example: str = "") -> float:
    """``value`` as a finite Python ``float``, or an error naming the value and the fix.

    Refused: bools (``True`` is not a factor), strings (``"1.25"``), NaN and infinities,
    values below ``minimum`` (or not above 0 with ``positive``). Ints and NumPy numbers
    are accepted.

    Raises:
      TypeError: ``value`` is not a real number.
      ValueError: it is not finite, or out of range.
    """
    head = f"{where}{name}={value!r}"
    want = "a finite number" + (" > 0" if positive else "") + (
        f" >= {minimum}" if minimum is not None else "") + (f" (e.g. {example})" if example
                                                               else "")
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{head} is a bool; {name} must be {want}")
    if isinstance(value, str):
        try:
            hint = f": write {name}={float(value)!r}"
        except ValueError:
            hint = ""
        raise TypeError(f"{head} is a string; {name} must be {want}{hint}")
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{head} is a {type(value).__name__}; {name} must be {want}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{head} is not finite; {name} must be {want}")
    if (positive and not number > 0) or (minimum is not None and number < minimum):
        raise ValueError(f"{head} is out of range; {name} must be {want}")
    return number


def check_str(value: Any, name: str, *, where: str = "", example: str = "",
              empty: bool = False) -> str:
    """``value`` if it is a string (non-empty unless ``empty``), or an error naming it.

    Raises:
      TypeError: ``value`` is not a ``str``.
      ValueError: it is empty (and ``empty`` is False).
    """
    hint = f" (e.g. {example})" if example else ""
    if not isinstance(value, str):
        raise TypeError(f"{where}{name}={value!r} is a {type(value).__name__}; {name} must be "
                        f"a string{hint}")
    if not value and not empty:
        raise ValueError(f"{where}{name}='' is empty; {name} must be a non-empty string{hint}")
    return value


def check_path(value: Any, name: str, *, where: str = "") -> Path:
    """``value`` as a ``Path``, or an error naming it: a ``str`` or ``os.PathLike``, not empty,
    without a NUL character or a lone surrogate (the OS refuses both, with errors that name
    neither the argument nor the fix).

    Raises:
      TypeError: ``value`` is not a path.
      ValueError: it is empty or holds a character no file name can.
    """
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{where}{name}={value!r} is a {type(value).__name__}; {name} must be a "
                        "path (a str or os.PathLike)")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"{where}{name}={value!r} is a bytes path; give {name} as a str")
    if not text:
        raise ValueError(f"{where}{name}='' is empty; give {name} as a path ('.' for the "
                         "current folder)")
    if "\x00" in text:
        raise ValueError(f"{where}{name}={text!r} holds a NUL character, which no path can")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}{name}={text!r} holds a lone surrogate, which no path can "
                         "hold; give the name as the text it was meant to be") from None
    return Path(text)


def nearest_multiples(value: int, k: int) -> list[int]:
    """The positive multiples of ``k`` nearest to ``value`` (one below, one above)."""
    below = (value // k) * k
    out = [m for m in (below, below + k) if m > 0 and m != value]
    if not out or out[0] == value:
        out = [below + k]
    return sorted(set(out))


def _range_text(minimum: int | None, maximum: int | None, allow: tuple[int, ...]) -> str:
    if minimum == 1 and maximum is None:
        text = "a positive integer"
    elif minimum is not None and maximum is not None:
        text = f"an integer from {minimum} to {maximum}"
    elif minimum is not None:
        text = f"an integer >= {minimum}"
    elif maximum is not None:
        text = f"an integer <= {maximum}"
    else:
        text = "an integer"
    if allow:
        text += " or " + " or ".join(str(a) for a in allow)
    return text


@contextlib.contextmanager
def no_new_empty_dirs(*paths: str | os.PathLike[str]) -> Iterator[None]:
    """On an exception, removes the directories the block created under ``paths`` while
    they are empty.

    For each path, the directories of it and its parents that did not exist before the
    block, and every directory below them (all made by the block), are removed bottom-up
    when empty: a failed start leaves no empty run directory or ``checkpoints/`` behind,
    and no file is ever deleted (a directory holding one stays, with its parents).
    """
    before = {Path(p).absolute(): _missing(Path(p).absolute()) for p in paths}
    try:
        yield
    except BaseException:
        for missing in before.values():
            if missing and missing[0].is_dir():
                for root, _dirs, _files in os.walk(missing[0], topdown=False):
                    with contextlib.suppress(OSError):
                        os.rmdir(root)  # only succeeds on an empty directory
            for d in missing[1:]:
                with contextlib.suppress(OSError):
                    d.rmdir()
        raise


def _missing(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, deepest first."""
    out = []
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


# The Hub's repo names: letters, digits, "-", "_", "."; no "--" or ".." (huggingface_hub's
# validate_repo_id), as "org/name".
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[A-Za-z0-9][\w.\-]{0,95}$")


def is_hub_id(name: Any) -> bool:
    """Whether ``name`` is looked up on the Hugging Face Hub (:mod:`workbench._hub`): an
    ``org/name`` string that is not an existing local path (a local path always wins)."""
    if not isinstance(name, str) or not _HUB_ID.match(name) or "--" in name or ".." in name:
        return False
    return not os.path.exists(os.path.expanduser(name))


def check_revision(revision: Any, where: str, arg: str = "revision") -> str | None:
    """``revision`` of a Hub repo: None, or a branch, tag or commit hash (a string)."""
    if revision is None:
        return None
    if not isinstance(revision, str) or not revision.strip() or "\x00" in revision:
        raise TypeError(f"{where}: {arg}={revision!r} must be a branch, tag or commit hash "
                        "of the Hub repo (a non-empty str), or None for 'main'")
    return revision


_BOOL_WORDS = {"no": False, "false": False, "0": False, "off": False, "n": False,
               "yes": True, "true": True, "1": True, "on": True, "y": True}


def check_bool(value: Any, name: str, *, where: str = "", none: bool = False) -> bool | None:
    """``value`` as a Python ``bool``, or a ``TypeError`` naming the argument and the value.

    Only ``True`` and ``False`` are flags (NumPy's ``np.True_`` / ``np.False_`` too: a
    comparison's result); ``"no"``, ``1`` or ``None`` are not (``"no"`` is truthy, and
    ``if overwrite:`` would read it as yes). ``none``: None is allowed and returned.

    Raises:
      TypeError: ``value`` is not a bool.
    """
    kind = type(value)
    if kind is bool:
        return value
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    if value is None and none:
        return None
    fix = f"write {name}={_BOOL_WORDS[value.strip().lower()]}" if isinstance(
        value, str) and value.strip().lower() in _BOOL_WORDS else f"give {name}=True or False"
    also = " (or None)" if none else ""
    raise TypeError(f"{where}{name}={value!r:.80} must be True or False{also} (it is a "
                    f"{kind.__name__}): {fix}")
