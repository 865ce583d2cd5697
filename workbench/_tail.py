"""Incremental, de-duplicating reader of an append-only ``metrics.jsonl`` (see ``runs``).

Standard library only: the Jupyter server extension uses it. Every line is judged on its
own: a malformed one (not JSON, not an object, nested too deeply, a step that is no
integer, longer than ``MAX_LINE``) is skipped and counted, never fatal to its neighbours.

One mechanism, one file: the tail's state (offset, marks, attempts) and the bounded line
reader and parser it calls move together (tests patch the chunk size and reader here).
"""
from __future__ import annotations

import bisect
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from workbench._run_file import FileRefused, file_kind, open_file

METRICS = "metrics.jsonl"
MAX_DEPTH = 32  # deepest nesting of a metrics line that readers accept
MAX_LINE = 32 << 20  # bytes; a longer line is skipped unread
STEP_LIMIT = 2**53  # |step| below this (the integers a JavaScript number holds exactly)


def path_arg(value: Any, name: str, *, where: str = "", empty: bool = False) -> Path:
    """``value`` as a ``Path``, or an error naming the argument: a ``str`` or
    ``os.PathLike`` (not bytes), non-empty unless ``empty``, that the OS can take (no NUL,
    no lone surrogate). ``workbench._validate.check_path`` without NumPy, for the modules
    the Jupyter server imports; a name ``os.fsencode`` takes (``surrogateescape``, as
    ``os.listdir`` returns undecodable names) is kept.

    Raises:
      TypeError: ``value`` is not a path.
      ValueError: it is empty, or holds a character no file name can.
    """
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{where}{name}={value!r} is a {type(value).__name__}; {name} must be a "
                        "path (a str or os.PathLike)")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"{where}{name}={value!r} is a bytes path; give {name} as a str")
    if not text and not empty:
        raise ValueError(f"{where}{name}='' is empty; give {name} as a path ('.' for the "
                         "current folder)")
    if "\x00" in text:
        raise ValueError(f"{where}{name}={text!r} holds a NUL character, which no path can")
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        raise ValueError(f"{where}{name}={text!r} holds a lone surrogate, which no path can "
                         "hold; give the name as the text it was meant to be") from None
    return Path(text)


class _Bad:
    """A line that is no record; ``reason`` says why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


_NOT_JSON = _Bad("not JSON (a line cut short, or not written as JSON)")
_TOO_DEEP = _Bad(f"nested deeper than {MAX_DEPTH} levels")
_TOO_LONG = _Bad(f"longer than {MAX_LINE >> 20} MiB")


class MetricsTail:
    """Incremental, de-duplicating reader of one ``metrics.jsonl``.

    ``poll()`` returns the step records and events appended since the last call; a
    partly written last line waits for its newline, and is not read again until the
    file grows. Step records whose step is not above every step seen so far (re-logged
    after a resume) are dropped. A run started again (``Trainer(..., restart="ok")``)
    writes lines with a higher ``"attempt"``: the first one starts the reading over (the
    newest attempt is the run's curve; ``resets`` counts it, as for a replaced file) and
    lines of older attempts after it are dropped; :func:`read_attempts` reads every
    attempt. Malformed lines are skipped: ``bad_lines`` counts them
    and ``problem`` describes the first (``"line 7: not JSON ..."``). The reader keeps
    sparse (offset, step) marks so ``read(since)`` seeks instead of re-parsing.
    """

    MARK_EVERY = 512

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = path_arg(run_dir, "run_dir", where="MetricsTail: ")
        self.path = self.run_dir / METRICS  # read only inside run_dir, symlinks resolved
        self.resets = 0  # times the file shrank (replaced or truncated) and was re-read
        self.file_problem: str | None = None  # the file itself cannot be read
        self._earlier: dict[int, list[dict[str, Any]]] | None = None  # see read_attempts
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self.last_step: int | None = None
        self.last_record: dict[str, Any] | None = None
        self.records_seen = 0
        self.attempt = 1  # the newest attempt seen (a restarted run's lines carry "attempt")
        self.lines = 0
        self.bad_lines = 0
        self.first_bad: str | None = None
        self._scanned = 0  # [offset, _scanned) is known to hold no newline
        self._marks: list[tuple[int, int]] = []  # (last step before offset, offset)

    @property
    def problem(self) -> str | None:
        """What is wrong with the file or its lines, in words; None when all is well."""
        if self.file_problem:
            return self.file_problem
        if not self.bad_lines:
            return None
        more = f" (and {self.bad_lines - 1} more)" if self.bad_lines > 1 else ""
        return f"{METRICS}: skipped {self.first_bad}{more}"

    def poll(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Reads what was appended since the last poll: ``(step_records, events)``."""
        steps: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.file_problem = None
            return steps, events
        except OSError as e:
            self.file_problem = f"{METRICS} cannot be read: {e.strerror or e}"
            return steps, events
        if not stat.S_ISREG(st.st_mode):
            what = file_kind(st.st_mode)
            self.file_problem = f"{METRICS} is not a regular file ({what}); only regular " \
                                "files are read"
            return steps, events
        self.file_problem = None
        size = st.st_size
        if size < self.offset:  # truncated or replaced: start over
            self._reset()
            self.resets += 1
        if size <= max(self.offset, self._scanned):
            return steps, events
        try:
            f = open_file(self.path, inside=self.run_dir)  # the safe reader (see _run_file)
        except FileRefused as e:
            self.file_problem = str(e).replace(str(self.path), METRICS, 1)
            return steps, events
        except FileNotFoundError:  # deleted since the stat: the next poll sees it gone
            return steps, events
        except OSError as e:
            self.file_problem = f"{METRICS} cannot be read: {e.strerror or e}"
            return steps, events
        with f:
            size = os.fstat(f.fileno()).st_size  # the file opened: it may differ from the stat
            if size < self.offset:  # replaced between the stat and the open
                self._reset()
                self.resets += 1
            self._poll_open(f, size, steps, events)
        return steps, events

    def _poll_open(self, f: BinaryIO, size: int, steps: list[dict[str, Any]],
                   events: list[dict[str, Any]]) -> None:
        """``poll``'s reading of the open file ``f`` of ``size`` bytes."""
        if size <= max(self.offset, self._scanned):
            return
        try:
            stop = _last_newline(f, max(self.offset, self._scanned), size)
            self._scanned = size
            if stop is None:  # still one unfinished line: wait for it to grow
                return
            for start, end, rec in _records(f, self.offset, stop):
                self.offset = end
                self.lines += 1
                if rec is None:
                    continue
                step = rec.get("step") if rec.__class__ is dict else None
                if step.__class__ is int and -STEP_LIMIT < step < STEP_LIMIT and "event" not in rec:
                    kind = "step"  # the common case, without a call
                else:
                    kind = classify(rec)
                if isinstance(kind, _Bad):
                    self.bad_lines += 1
                    if self.first_bad is None:
                        self.first_bad = f"line {self.lines}: {kind.reason}"
                    continue
                if (self.attempt > 1 or "attempt" in rec) and attempt_of(rec) != self.attempt:
                    if attempt_of(rec) < self.attempt:
                        continue   # an older attempt's line after a newer one began
                    self._new_attempt(attempt_of(rec), steps)
                if kind == "event":
                    events.append(rec)
                    continue
                step = rec["step"]
                if self.last_step is not None and step <= self.last_step:
                    continue
                if self.records_seen % self.MARK_EVERY == 0:
                    self._marks.append((self.last_step if self.last_step is not None
                                        else -(2**62), start))
                self.last_step, self.last_record = step, rec
                self.records_seen += 1
                steps.append(rec)
        except OSError as e:  # unreadable mid-read: the next poll retries
            self.file_problem = f"{METRICS} cannot be read: {e.strerror or e}"

    def _new_attempt(self, attempt: int, steps: list[dict[str, Any]]) -> None:
        """The first line of a newer attempt: the step records read so far are the older
        attempt's (kept in ``_earlier`` by :func:`read_attempts`, else dropped)."""
        if self._earlier is not None:
            self._earlier[self.attempt] = list(steps)
        steps.clear()
        self.attempt = attempt
        self.last_step = self.last_record = None
        self.records_seen = 0
        self._marks = []
        self.resets += 1

    def read(self, since: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        """Step records with ``step > since`` up to what ``poll`` has seen (oldest first).

        Args:
          since: return only steps above this one.
          limit: at most this many records (the oldest ones after ``since``).
        """
        keys = [m[0] for m in self._marks]
        i = bisect.bisect_right(keys, since) - 1
        if i < 0:
            return []
        last, offset = self._marks[i]
        out: list[dict[str, Any]] = []
        try:
            with open_file(self.path, inside=self.run_dir) as f:
                for _, _, rec in _records(f, offset, self.offset):
                    if rec is None or classify(rec) != "step" or rec["step"] <= last \
                            or attempt_of(rec) != self.attempt:
                        continue
                    last = rec["step"]
                    if last > since:
                        out.append(rec)
                        if limit is not None and len(out) >= limit:
                            break
        except OSError:
            pass  # replaced, gone or refused: the next poll says why
        return out


def attempt_of(rec: dict[str, Any]) -> int:
    """The attempt a line belongs to: its ``"attempt"`` (written by ``RunWriter`` once a
    run was started again), 1 when absent or not a whole number >= 1."""
    a = rec.get("attempt", 1)
    return a if a.__class__ is int and 1 <= a < STEP_LIMIT else 1


def read_attempts(run_dir: str | os.PathLike[str]) -> dict[int, list[dict[str, Any]]]:
    """Every attempt's step records, de-duplicated as :class:`MetricsTail` does each:
    ``{1: [...], 2: [...]}`` (a run never started again has only attempt 1; an earlier
    attempt without a step record is left out, the newest is always there)."""
    tail = MetricsTail(run_dir)
    tail._earlier = {}
    steps, _ = tail.poll()
    return {**{k: v for k, v in tail._earlier.items() if v}, tail.attempt: steps}


def classify(rec: Any) -> str | _Bad:
    """``"step"``, ``"event"``, or why the parsed line is neither (a ``_Bad``)."""
    if isinstance(rec, _Bad):
        return rec
    if not isinstance(rec, dict):
        return _Bad(f"a JSON {_type_name(rec)}, not an object")
    if "event" in rec:
        if not isinstance(rec["event"], str):
            return _Bad(f"'event' is {_short(rec['event'])}, not a string")
        return "event"
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        what = "missing" if "step" not in rec else f"{_short(step)}, not an integer"
        return _Bad(f"'step' is {what}")
    if not -STEP_LIMIT < step < STEP_LIMIT:
        return _Bad(f"'step' {_short(step)} is out of range (|step| < 2**53)")
    return "step"


def _type_name(v: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (str, bool, type(None))) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


_CHUNK = 8 << 20  # bytes parsed per json.loads call
_BACK = 1 << 16  # bytes read per step of the backwards newline search


def _last_newline(f: BinaryIO, lo: int, hi: int) -> int | None:
    """The offset just past the last newline in bytes ``[lo, hi)`` of the open file
    ``f``, or None if they hold none (searched from the end, so a long unfinished line
    costs only its new bytes)."""
    end = hi
    while end > lo:
        start = max(lo, end - _BACK)
        f.seek(start)
        i = f.read(end - start).rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return None


def _next_newline(f: Any, pos: int, stop: int) -> int | None:
    """The offset just past the first newline at or after ``pos`` (before ``stop``)."""
    f.seek(pos)
    while pos < stop:
        data = f.read(min(_CHUNK, stop - pos))
        if not data:
            return None
        i = data.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(data)
    return None


def _records(f: BinaryIO, start: int,
             stop: int) -> Iterator[tuple[int, int, dict[str, Any] | _Bad | None]]:
    """Whole lines of the open file ``f`` in ``[start, stop)``: ``(line start, line end,
    parsed)``; parsed is a dict, a ``_Bad`` for a malformed line, or None for a blank one.

    Lines are read a chunk at a time; a partly written last line is left for the next
    call; a line longer than
    ``MAX_LINE`` is skipped without being read into memory.
    """
    f.seek(start)
    pos = start
    while pos < stop:
        data = f.read(min(_CHUNK, stop - pos))
        cut = data.rfind(b"\n") + 1
        if not cut:
            if pos + len(data) >= stop:
                return  # a partly written last line: wait for its newline
            end = _next_newline(f, pos + len(data), stop)  # one line longer than a chunk
            if end is None:
                return
            if end - pos > MAX_LINE:
                yield pos, end, _TOO_LONG
                pos = end
                f.seek(pos)
                continue
            f.seek(pos)
            data = f.read(end - pos)
            cut = len(data)
        f.seek(pos + cut)
        lines = data[:cut].split(b"\n")[:-1]
        for raw, rec in zip(lines, _parse_lines(lines, data[:cut])):
            yield pos, pos + len(raw) + 1, rec
            pos += len(raw) + 1


_scan_once = json.JSONDecoder().scan_once  # the C scanner: one JSON value from an index
# Where one JSON object may end and another begin. Without one inside any line, a chunk
# joined into one JSON array parses line by line (no line can borrow its neighbours' text).
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")


def _parse_lines(lines: list[bytes], data: bytes) -> list[dict[str, Any] | _Bad | None]:
    """Each line's value. Fast path: the chunk as one JSON array (one C call), taken only
    when every element is an object and no line holds an object boundary of its own, so
    element i is line i. Otherwise each line is scanned alone and must end where its
    value ends."""
    flat = data.count(b"{") == len(lines) and b"[" not in data  # no nesting anywhere
    if not _BOUNDARY.search(data):
        try:
            out = json.loads(b"[" + b",".join(lines) + b"]")
        except (ValueError, RecursionError):
            out = None
        if out is not None and len(out) == len(lines) and all(r.__class__ is dict for r in out):
            return out if flat else [_checked(r, False) for r in out]
    try:
        texts = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        return [_parse(raw) for raw in lines]
    parsed: list[dict[str, Any] | _Bad | None] = []
    for text, raw in zip(texts, lines):
        try:
            rec, end = _scan_once(text, 0)
        except (StopIteration, ValueError, RecursionError):
            parsed.append(_parse(raw))
            continue
        parsed.append(_checked(rec, flat) if end == len(text) else _parse(raw))
    return parsed


def _parse(raw: bytes) -> dict[str, Any] | _Bad | None:
    if not raw.strip():
        return None
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError):  # cut short by a crash, binary, nested too deeply
        return _TOO_DEEP if raw.lstrip()[:1] in (b"[", b"{") and _nesting(raw) else _NOT_JSON
    return _checked(rec, False)


def _nesting(raw: bytes) -> bool:
    """Whether a line that failed to parse opens more brackets than ``MAX_DEPTH``."""
    head = raw.lstrip()[:MAX_DEPTH + 1]
    return len(head) > MAX_DEPTH and all(c in b"[{" for c in head)


def _checked(rec: Any, flat: bool) -> Any:
    if flat or not isinstance(rec, dict) or _depth_ok(rec):
        return rec
    return _TOO_DEEP


def _depth_ok(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests at most ``limit`` containers deep (iterative)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return False
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return True
