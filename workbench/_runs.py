"""The run directory: run.json metadata plus append-only metrics.jsonl; write, read, list.

One format, one file: it is the run directory's format (writing, reading and checking,
finding, the writer's process), imported as ``runs`` by the server extension, the jobs,
the Trainer and the widgets alike, standard library only; its parts share the file names,
limits and error types.

A run directory holds ``run.json`` (replaced atomically) and ``metrics.jsonl`` (one JSON
object per line, appended and flushed on every record). Lines with an ``"event"`` key
(``compile``, ``resume``, ...) are not steps. After a resume, re-logged steps that were
already seen are dropped by readers, so a resumed run reads as one continuous curve.

This module is read by the Jupyter server extension: it imports only the standard
library (never jax or numpy).

Example::

    from workbench import runs

    with runs.RunWriter("runs/demo", config={"model": "tiny"}) as w:
        w.event("compile", seconds=1.3)
        w.log({"step": 1, "loss": 4.2, "mfu": 0.31})
    runs.read_metrics("runs/demo")            # [{"step": 1, "loss": 4.2, ...}]
"""
from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import platform
import re
import socket
import stat
import tempfile
import threading
import time
import unicodedata
import urllib.parse
import uuid
from collections.abc import Iterable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Self

from workbench._run_file import FileRefused, file_kind, open_file
from workbench._tail import METRICS, MetricsTail, _depth_ok, path_arg, read_attempts

__all__ = ["HISTORY_EVENTS", "METRICS", "RUN_JSON", "STATUSES", "MetricsTail", "RunFileError",
           "RunWriter", "check_run", "clean_prediction", "columns", "config_hash",
           "effective_status", "find_run_dirs", "is_hidden", "json_safe",
           "list_runs", "pid_alive", "pid_start_time", "read_attempts", "read_events",
           "read_metrics", "read_run", "resolve_run", "run_id"]

RUN_JSON = "run.json"
#: Events that change what a run is (a changed config or data, a fork): besides their line in
#: ``metrics.jsonl`` they are kept in ``run.json``'s ``history`` list, across resumes.
HISTORY_EVENTS = ("config_changed", "data_changed", "fork", "restart")
STATUSES = ("running", "finished", "interrupted", "failed")
_VERSIONED = ("workbench", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain")
_SKIP_DIRS = frozenset({"node_modules", "__pycache__", "site-packages", "checkpoints", ".git",
                        ".ipynb_checkpoints"})
_ROOT_PREFIX = re.compile(r"^(\d+):(.*)$")
# Unicode categories a run id percent-encodes: controls, format (bidi), surrogates (bytes
# that are not UTF-8), private and unassigned, line and paragraph separators
_ID_ESCAPED = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# A run.json ``prediction`` (the plan's, recorded by Trainer.from_plan): the fields readers use.
_PREDICTION_NUMBERS = ("step_seconds", "mfu", "mfu_fp8", "tokens_per_s", "compiler_seconds")
_PREDICTION_TEXT = ("bound", "source", "source_reason", "hardware", "plan_name")
_PREDICTION_TERMS = ("compute", "memory", "communication", "communication_total",
                     "host_transfers", "host_link", "no_overlap_step")
_TEXT_MAX = 2000


# ----------------------------------------------------------------------------- writing
def _clean(value: Any) -> Any:
    """JSON-safe copy: numpy/jax scalars -> Python, NaN/inf -> None, tuples -> lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:  # numpy / jax scalar
        return _clean(value.item())
    if hasattr(value, "tolist"):
        return _clean(value.tolist())
    return str(value)


def json_safe(value: Any) -> Any:
    """A strict-JSON copy of ``value`` (NaN/inf -> None, numpy scalars -> Python, tuples ->
    lists, other objects -> their text): what ``json.dumps(..., allow_nan=False)`` takes."""
    return _clean(value)


def config_hash(config: dict[str, Any]) -> str:
    """Stable 12-hex-digit hash of a JSON-able config (key order does not matter)."""
    text = json.dumps(_clean(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in _VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".run.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunWriter:
    """Writes one run directory: ``run.json`` and appended ``metrics.jsonl`` lines.

    Re-opening an existing run directory (resumed training) keeps its id, creation
    time and metrics, and appends. A run started again (``meta={"attempt": 2, "step": 0}``,
    ``Trainer(..., restart="ok")``) writes ``"attempt": n`` into every line after that, so
    readers tell its steps from the earlier attempts'. Thread-safe. Use as a context manager: leaving the
    block closes the run as ``finished``, ``interrupted`` (KeyboardInterrupt) or
    ``failed`` (other exceptions, with the error text).

    Args:
      run_dir: the run directory (created if missing).
      config: the experiment's JSON-able configuration (stored in ``run.json``).
      name: display name; defaults to the directory name (or the stored name on resume).
      meta: further ``run.json`` fields (``mesh``, ``devices``, ``peak_flops``, ...).
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, config: dict[str, Any],
                 name: str | None = None, meta: dict[str, Any] | None = None) -> None:
        self.run_dir = path_arg(run_dir, "run_dir", where="RunWriter: ")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"RunWriter: name={name!r} is a {type(name).__name__}; name must "
                            "be a string (the run's display name) or None for the folder's")
        if meta is not None and not isinstance(meta, dict):
            raise TypeError(f"RunWriter: meta={_short(meta)} is a {type(meta).__name__}; meta "
                            "must be a dict of further run.json fields, or None")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._last_meta_write = 0.0
        old: dict[str, Any] = {}
        if (self.run_dir / RUN_JSON).exists():
            old = check_run(read_run(self.run_dir))[0]  # wrong-typed fields read as absent
        self.resumed = bool(old)
        now = time.time()
        self.meta: dict[str, Any] = {
            "id": old.get("id") or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
            "name": name or old.get("name") or self.run_dir.resolve().name,
            "status": "running", "created": old.get("created") or now, "updated": now,
            "config": _clean(config), "config_hash": config_hash(config),
            "mesh": {}, "devices": [], "device_kind": None, "peak_flops": None,
            "peak_source": None, "versions": _versions(), "host": socket.gethostname(),
            "pid": os.getpid(), "pid_start": pid_start_time(os.getpid()),
            "step": old.get("step") or 0, "target_steps": None,
            "error": None, "model_flops_per_step": None, "memory_per_device": None,
        }
        for key in ("target_steps", "mesh", "devices", "device_kind", "peak_flops",
                    "peak_source", "model_flops_per_step", "memory_per_device", "prediction",
                    "history", "attempt", "trackers"):
            if old.get(key) is not None:
                self.meta[key] = _clean(old[key])
        self.meta.update(_clean(meta or {}))
        path = self.run_dir / METRICS
        _refuse_special(path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if path.stat().st_size and not _ends_with_newline(path):
            self._file.write("\n")  # a line cut short by a crash stays a line of its own
        self._file.flush()
        _write_json_atomic(self.run_dir / RUN_JSON, self.meta)

    @property
    def id(self) -> str:
        """The run's unique id (stored in ``run.json``; kept across resumes)."""
        return str(self.meta["id"])

    def log(self, record: dict[str, Any]) -> None:
        """Appends one step record (must hold an int ``step``) and flushes it."""
        step = _clean(record.get("step"))
        if step is None or isinstance(step, bool):
            raise ValueError(f"metrics record needs an integer 'step', got "
                             f"step={record.get('step')!r} in {sorted(record)}; log events "
                             "with RunWriter.event(kind, ...)")
        if not isinstance(step, int):
            raise TypeError(f"metrics record needs an integer 'step', got {step!r} "
                            f"({type(step).__name__}); pass int(step)")
        if "event" in record:
            raise ValueError("a step record may not have an 'event' key; use RunWriter.event()")
        line = {"step": step, "time": time.time(), **_clean(record), **self._attempt()}
        with self._lock:
            self._write_line(line)
            self.meta["step"] = max(int(self.meta.get("step") or 0), line["step"])
            if time.monotonic() - self._last_meta_write >= 1.0:
                self._write_meta()

    def event(self, kind: str, **fields: Any) -> None:
        """Appends a non-step line ``{"event": kind, "time": ..., **fields}`` (one of
        :data:`HISTORY_EVENTS` is also appended to ``run.json``'s ``history``)."""
        line = {"event": kind, "time": time.time(), **_clean(fields), **self._attempt()}
        with self._lock:
            self._write_line(line)
            if kind in HISTORY_EVENTS:
                self.meta["history"] = [*(self.meta.get("history") or []), line]
                self._write_meta()

    def _attempt(self) -> dict[str, int]:
        """``{"attempt": n}`` for the lines of a run started again (n >= 2), else nothing
        (a run's first attempt writes its lines as before)."""
        n = self.meta.get("attempt")
        return {"attempt": n} if isinstance(n, int) and not isinstance(n, bool) and n > 1 else {}

    def flush(self) -> None:
        """Flushes metrics to the OS and rewrites ``run.json``."""
        with self._lock:
            if not self._file.closed:
                self._file.flush()
            self._write_meta()

    def update(self, **fields: Any) -> None:
        """Sets ``run.json`` fields (e.g. ``target_steps=200``) and rewrites it atomically."""
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status {fields['status']!r} is not one of {STATUSES}")
        with self._lock:
            self.meta.update(_clean(fields))
            self._write_meta()

    def close(self, status: str = "finished", error: str | None = None) -> None:
        """Flushes, closes the metrics file and records the final status."""
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        with self._lock:
            if not self._file.closed:
                self._file.close()
            self.meta.update(status=status, error=error)
            self._write_meta()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc_type is None:
            self.close("finished")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("interrupted")
        else:
            self.close("failed", error=f"{exc_type.__name__}: {exc}")

    def _write_line(self, line: dict[str, Any]) -> None:
        if self._file.closed:
            raise RuntimeError(f"run {self.run_dir} is closed; open a new RunWriter to resume")
        self._file.write(json.dumps(line, allow_nan=False, separators=(",", ":")) + "\n")
        self._file.flush()

    def _write_meta(self) -> None:
        self.meta["updated"] = time.time()
        _write_json_atomic(self.run_dir / RUN_JSON, self.meta)
        self._last_meta_write = time.monotonic()


def _refuse_special(path: Path) -> None:
    """Refuses a ``metrics.jsonl`` that is there but not a regular file: appending to a
    directory raises a raw error, and opening a named pipe waits for a reader forever."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise RunFileError(f"{path} is {file_kind(mode)}, not a file; move it aside (e.g. to "
                           f"{path.name}.bad) or delete it: the run's metrics are appended to "
                           "a new one")


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


# ----------------------------------------------------------------------------- reading
class RunNotFound(FileNotFoundError):
    """A run directory or run id that does not exist (a ``FileNotFoundError``, so code that
    catches that still does; the message names the argument)."""


class RunFileError(ValueError):
    """A ``run.json`` (or, to append to, a ``metrics.jsonl``) that exists but cannot be used
    (binary, empty, not an object, a directory, a named pipe, ...);
    the message names the file, what is wrong and what to do."""


MAX_RUN_JSON = 16 << 20  # bytes
RUN_JSON_DEPTH = 64  # deepest nesting read_run accepts


def _finite_float(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def read_run(run_dir: str | os.PathLike[str], *, contained: bool = False) -> dict[str, Any]:
    """Returns the parsed ``run.json`` of a run directory.

    ``NaN``, ``Infinity`` and numbers too large for a float read as None (JSON null).
    It is read through the one safe reader of run files (``workbench._run_file``): a
    regular file only, opened without blocking, read bounded.

    Args:
      run_dir: the run directory.
      contained: refuse a ``run.json`` that resolves outside ``run_dir`` (a symlink
        leading out of the run; what the server serves).

    Raises:
      FileNotFoundError: there is no ``run.json``.
      RunFileError: it cannot be used (a directory, a pipe or device, outside the run when
        ``contained``, unreadable, larger than 16 MiB, not UTF-8, empty, not JSON, nested
        more than 64 levels, not a JSON object).
    """
    path = path_arg(run_dir, "run_dir", where="read_run: ") / RUN_JSON
    contained = _flag_arg(contained, "contained", "read_run")
    fix = (f"move it aside (e.g. to {RUN_JSON}.bad) or delete it; a training run that "
           "resumes there writes a new one (its metrics.jsonl and checkpoints are kept)")
    raw = _run_json_bytes(path, run_dir, contained, fix)
    if len(raw) > MAX_RUN_JSON:
        raise RunFileError(f"{path} is larger than {MAX_RUN_JSON >> 20} MiB, far more than "
                           f"a run.json holds; {fix}")
    if not raw.strip():
        raise RunFileError(f"{path} is empty; {fix}")
    try:  # bytes: UTF-8, -16 or -32, as JSON allows
        data = json.loads(raw, parse_constant=lambda _: None, parse_float=_finite_float)
    except UnicodeDecodeError as e:
        raise RunFileError(f"{path} is not UTF-8 text (byte {e.start} is "
                           f"{e.object[e.start]:#04x}; binary?); {fix}") from None
    except RecursionError:
        raise RunFileError(f"{path} is nested too deeply to read; {fix}") from None
    except ValueError as e:
        raise RunFileError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise RunFileError(f"{path} holds a JSON {type(data).__name__}, expected an object; "
                           f"it was not written by RunWriter; {fix}")
    if not _depth_ok(data, RUN_JSON_DEPTH):
        raise RunFileError(f"{path} is nested more than {RUN_JSON_DEPTH} levels deep; {fix}")
    return data


def _run_json_bytes(path: Path, run_dir: Any, contained: bool, fix: str) -> bytes:
    """At most ``MAX_RUN_JSON + 1`` bytes of ``path`` through the safe reader, or the
    error saying why it cannot be read (``fix``: what to do about it)."""
    try:
        with open_file(path, inside=run_dir if contained else None) as f:
            return f.read(MAX_RUN_JSON + 1)
    except FileNotFoundError:
        raise RunNotFound(f"read_run: run_dir={str(run_dir)!r}: {path} not found, so it is "
                          "not a run directory (RunWriter creates run.json)") from None
    except IsADirectoryError:
        raise RunFileError(f"{path} is a directory, not a file; {fix}") from None
    except FileRefused as e:
        raise RunFileError(f"{e}; or {fix}") from None
    except OSError as e:
        raise RunFileError(f"{path} cannot be read ({e.strerror or e}); check its "
                           "permissions, or " + fix) from None


def clean_prediction(value: Any) -> dict[str, Any] | None:
    """A run.json ``prediction`` reduced to what readers may trust, or None.

    ``Trainer.from_plan`` records the plan's ``predicted.to_dict()`` plus ``source``,
    ``hardware`` and ``plan_name``; a hand-edited file may hold anything. Kept: the
    numbers ``step_seconds``, ``mfu``, ``tokens_per_s``, ``compiler_seconds`` when finite
    and positive (never bools or strings); the texts ``bound``, ``source``,
    ``source_reason``, ``hardware``, ``plan_name`` when strings; the breakdown's seconds
    per term (``compute``, ``memory``, ``communication``, ...) and ``sources`` (text to
    text), and the error ``band`` (``low`` and ``high``: finite factors > 0 with low <=
    high, else both None; ``basis``, ``source``, ``summary`` as text). Everything else is
    dropped. Without a usable step time or MFU: None.

    Example::

        clean_prediction({"step_seconds": 0.02, "mfu": "NaN"})   # {"step_seconds": 0.02}
    """
    if not isinstance(value, dict):
        return None
    out: dict[str, Any] = {}
    for key in _PREDICTION_NUMBERS:
        if _positive(value.get(key)):
            out[key] = float(value[key])
    if "step_seconds" not in out and "mfu" not in out:
        return None
    for key in _PREDICTION_TEXT:
        if isinstance(value.get(key), str):
            out[key] = value[key][:_TEXT_MAX]
    breakdown = value.get("breakdown")
    if isinstance(breakdown, dict):
        terms = {k: float(breakdown[k]) for k in _PREDICTION_TERMS
                 if _finite(breakdown.get(k)) and breakdown[k] >= 0}
        if terms:
            out["breakdown"] = terms
    sources = value.get("sources")
    if isinstance(sources, dict):
        texts = {str(k)[:200]: v[:_TEXT_MAX] for k, v in sources.items() if isinstance(v, str)}
        if texts:
            out["sources"] = texts
    band = _clean_band(value.get("band"))
    if band is not None:
        out["band"] = band
    return out


def _clean_band(value: Any) -> dict[str, Any] | None:
    """A prediction's error band checked (``workbench.perf._band.Band.to_dict``): its
    factors when both are finite, > 0 and in order (else None: no band), its texts."""
    if not isinstance(value, dict):
        return None
    low, high = value.get("low"), value.get("high")
    known = _positive(low) and _positive(high) and low <= high
    out: dict[str, Any] = {"low": float(low) if known else None,
                           "high": float(high) if known else None}
    for key in ("basis", "source", "summary"):
        if isinstance(value.get(key), str):
            out[key] = value[key][:_TEXT_MAX]
    return out


def _finite(v: Any) -> bool:
    return _as_float(v) is not None


def _as_float(v: Any) -> float | None:
    """``v`` as a finite float; None for bools, non-numbers, NaN, inf and ints too large."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


_RUN_TYPES: dict[str, tuple[str, Any]] = {
    "id": ("a string", str), "name": ("a string", str), "host": ("a string", str),
    "config_hash": ("a string", str), "device_kind": ("a string", str),
    "peak_source": ("a string", str), "error": ("a string", str),
    "created": ("a number", _as_float), "updated": ("a number", _as_float),
    "peak_flops": ("a number", _as_float), "model_flops_per_step": ("a number", _as_float),
    "step": ("an integer", int), "target_steps": ("an integer", int), "pid": ("an integer", int),
    "attempt": ("an integer", int),
    "config": ("an object", dict), "mesh": ("an object", dict),
    "memory_per_device": ("an object", dict), "versions": ("an object", dict),
    "trackers": ("an object", dict),
    "devices": ("a list", list), "history": ("a list", list),
}


def check_run(meta: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A parsed ``run.json`` with every known field of the wrong type set to None, and what
    was wrong (``["run.json 'step' is \"abc\", not an integer"]``).

    A ``status`` that is not one of :data:`STATUSES` becomes ``"error"``; texts are cut
    to 2000 characters; the result is strict JSON (see :func:`json_safe`).

    Raises:
      TypeError: ``meta`` is not a dict.
    """
    _dict_arg(meta, "meta", "check_run")
    out = json_safe(meta)
    problems: list[str] = []
    for key, (what, kind) in _RUN_TYPES.items():
        v = out.get(key)
        if v is None:
            continue
        if kind is _as_float:
            ok = _as_float(v) is not None
        elif kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool) and (
                key == "pid" or -2**53 < v < 2**53)  # no pid is that large: a dead writer
        else:
            ok = isinstance(v, kind)
        if not ok:
            problems.append(f"{RUN_JSON} '{key}' is {_short(v)}, not {what}")
            out[key] = None
        elif isinstance(v, str) and len(v) > _TEXT_MAX:
            out[key] = v[:_TEXT_MAX] + "..."
    status = out.get("status")
    if status is not None and status not in STATUSES:
        problems.append(f"{RUN_JSON} 'status' is {_short(status)}, not one of "
                        f"{', '.join(STATUSES)}")
        out["status"] = "error"
    return out, problems


def _short(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (str, bool, type(None))) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _positive(v: Any) -> bool:
    return _finite(v) and v > 0


def read_metrics(run_dir: str | os.PathLike[str], since: int = 0) -> list[dict[str, Any]]:
    """Step records of a run with ``step > since``, de-duplicated across resumes."""
    run_dir = path_arg(run_dir, "run_dir", where="read_metrics: ")
    if isinstance(since, bool) or not isinstance(since, (int, float)):
        raise TypeError(f"read_metrics: since={_short(since)} is a {type(since).__name__}; "
                        "since must be a step number (0 for every record)")
    if isinstance(since, float) and not math.isfinite(since):
        raise ValueError(f"read_metrics: since={since!r} is not finite; since must be a step "
                         "number (0 for every record)")
    steps, _ = MetricsTail(run_dir).poll()
    return [r for r in steps if r["step"] > since]


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The non-step lines (``{"event": ...}``) of a run, in order."""
    return MetricsTail(path_arg(run_dir, "run_dir", where="read_events: ")).poll()[1]


def columns(records: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Records -> columns: ``{"step": [...], "loss": [...], ...}`` (missing -> None)."""
    if isinstance(records, (str, bytes, dict)) or not isinstance(records, Iterable):
        raise TypeError(f"columns: records={_short(records)} is a {type(records).__name__}; "
                        "records must be a list of dicts (e.g. read_metrics(run_dir))")
    records = list(records)
    for i, rec in enumerate(records):
        _dict_arg(rec, f"records[{i}]", "columns")
    keys: dict[str, None] = {}
    for rec in records:
        keys.update(dict.fromkeys(rec))
    return {k: [rec.get(k) for rec in records] for k in keys}


def _dict_arg(value: Any, name: str, where: str) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"{where}: {name}={_short(value)} is a {type(value).__name__}; {name} "
                        f"must be a dict (a parsed {RUN_JSON} or a metrics record)")


def _int_arg(value: Any, name: str, where: str) -> int:
    """``value`` as an int >= 0 (``workbench._validate.check_int`` without NumPy)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name}={_short(value)} is a {type(value).__name__}; {name} "
                        "must be an integer >= 0")
    if value < 0:
        raise ValueError(f"{where}: {name}={value} is negative; {name} must be an integer >= 0")
    return value


def _flag_arg(value: Any, name: str, where: str) -> bool:
    """``value`` if it is a bool, else ``workbench._validate.check_bool``'s error (NumPy,
    which it imports, is loaded only then: the Jupyter server stays light)."""
    if type(value) is bool:
        return value
    from workbench._validate import check_bool

    return bool(check_bool(value, name, where=f"{where}: "))


def _roots_arg(roots: Any, where: str) -> list[Path]:
    """``roots`` as a list of paths (a str or Path alone is refused: its characters or parts
    are no roots)."""
    if isinstance(roots, (str, bytes, os.PathLike)) or not isinstance(roots, Iterable):
        raise TypeError(f"{where}: roots={_short(roots)} is a {type(roots).__name__}; roots "
                        "must be a list of run roots (e.g. roots=['runs'])")
    return [path_arg(r, f"roots[{k}]", where=f"{where}: ") for k, r in enumerate(roots)]


def _encodable(text: str) -> bool:
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return True


# ----------------------------------------------------------------------------- finding
def run_id(root: str | os.PathLike[str], run_dir: str | os.PathLike[str]) -> str:
    """The run's id under ``root``: its relative POSIX path (``"runs/tiny"``), with every
    byte that could not travel or would read ambiguously percent-encoded (see
    :func:`encode_rel`), so any folder name gives an id that opens again.

    Raises:
      TypeError, ValueError: ``root`` or ``run_dir`` is no path, or ``run_dir`` is not
        inside ``root``.
    """
    root = path_arg(root, "root", where="run_id: ")
    run_dir = path_arg(run_dir, "run_dir", where="run_id: ")
    try:
        rel = Path(os.path.abspath(run_dir)).relative_to(os.path.abspath(root))
    except ValueError:
        raise ValueError(f"run_id: run_dir={str(run_dir)!r} is not inside root="
                         f"{str(root)!r}; give the root the run lies under") from None
    return encode_rel(rel.as_posix())


def encode_rel(rel: str) -> str:
    """A relative POSIX path as a run id: its bytes kept as text where they are printable
    UTF-8, percent-encoded (``%3A``) for ``%``, ``:``, ``\\``, control and format characters
    and bytes that are not UTF-8 (byte 0xFF reads ``%FF``). :func:`decode_rel` reverses it;
    ``:`` is encoded so that ``"k:path"`` always names root ``k``."""
    out = []
    for ch in os.fsencode(rel).decode("utf-8", "surrogateescape"):
        o = ord(ch)
        if (0x20 <= o < 0x7F and ch not in "%:\\") or (
                o >= 0x80 and unicodedata.category(ch) not in _ID_ESCAPED):
            out.append(ch)
        else:
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogateescape")))
    return "".join(out)


def decode_rel(rid: str) -> str:
    """The relative path (``os.fsdecode`` text) of a run id's path part; ``ValueError``
    unless ``rid`` is exactly what :func:`encode_rel` writes for that path."""
    try:
        rel = os.fsdecode(urllib.parse.unquote_to_bytes(rid))
        ok = encode_rel(rel) == rid
    except (UnicodeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"bad run id rid={rid!r}: it is not the id the server lists (ids "
                         "percent-encode '%', ':', '\\', control characters and bytes that "
                         "are not UTF-8, e.g. 'a%3Ab' for a folder named 'a:b')")
    return rel


def find_run_dirs(root: str | os.PathLike[str], max_depth: int = 4,
                  max_dirs: int = 20000, hidden: bool = False) -> Iterator[Path]:
    """Run directories (holding ``run.json``) under ``root``, at most ``max_depth`` deep.

    Hidden directories (unless ``hidden``), ``node_modules``, ``.git`` and symlinked
    directories are not entered; a run directory's own subdirectories (checkpoints) are
    not searched. A ``run.json`` that is a directory, a named pipe or any other non-file
    still marks a run (an unreadable one, listed as an error); a symlinked one does not.
    """
    root = path_arg(root, "root", where="find_run_dirs: ")
    max_depth = _int_arg(max_depth, "max_depth", "find_run_dirs")
    max_dirs = _int_arg(max_dirs, "max_dirs", "find_run_dirs")
    hidden = _flag_arg(hidden, "hidden", "find_run_dirs")
    return _find_run_dirs(root, max_depth, max_dirs, hidden)


def _find_run_dirs(root: Path, max_depth: int, max_dirs: int, hidden: bool) -> Iterator[Path]:
    queue: list[tuple[Path, int]] = [(root, 0)]
    visited = 0
    while queue and visited < max_dirs:
        folder, depth = queue.pop(0)
        visited += 1
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        if any(e.name == RUN_JSON and not e.is_symlink() for e in entries):
            yield Path(folder)
            continue
        if depth >= max_depth:
            continue
        for e in entries:
            if (e.is_dir(follow_symlinks=False) and (hidden or not e.name.startswith("."))
                    and e.name not in _SKIP_DIRS):
                queue.append((Path(e.path), depth + 1))


def list_runs(roots: Iterable[str | os.PathLike[str]], max_depth: int = 4,
              hidden: bool = False) -> list[dict[str, Any]]:
    """Every run under ``roots``: its checked ``run.json`` (:func:`check_run`) plus ``id``
    (URL id), ``uid`` and ``problem`` (what could not be read, or None).

    Ids under the first root are relative paths; under root ``k >= 1`` they read
    ``"k:relative/path"``. Newest-updated first. A run whose ``run.json`` cannot be read
    is listed with status ``"error"`` and the reason as ``problem``.
    """
    roots = _roots_arg(roots, "list_runs")
    max_depth = _int_arg(max_depth, "max_depth", "list_runs")
    hidden = _flag_arg(hidden, "hidden", "list_runs")
    out: list[dict[str, Any]] = []
    for k, root in enumerate(roots):
        for d in find_run_dirs(root, max_depth, hidden=hidden):
            rid = run_id(root, d)
            try:
                run, problems = check_run(read_run(d))
                status = effective_status(run)
            except (OSError, ValueError) as e:
                run, problems, status = {"name": d.name}, [str(e)], "error"
            out.append({**run, "uid": run.get("id"), "id": rid if k == 0 else f"{k}:{rid}",
                        "status": status, "problem": "; ".join(problems) or None})
    out.sort(key=lambda r: -(r.get("updated") or 0))
    return out


def is_hidden(rel: str | os.PathLike[str]) -> bool:
    """Whether a path relative to a root has a hidden part (a name starting with ``.``),
    as Jupyter's contents API judges it."""
    parts = path_arg(rel, "rel", where="is_hidden: ", empty=True).parts
    return any(p.startswith(".") and p not in (".", "..") for p in parts)


def resolve_run(roots: Sequence[str | os.PathLike[str]], rid: str,
                allow_hidden: bool = False) -> Path:
    """The directory of run id ``rid``; it must lie inside its root, symlinks resolved.

    Args:
      roots: the run roots.
      rid: the run id (see :func:`run_id`).
      allow_hidden: serve runs under hidden directories (Jupyter's
        ``ContentsManager.allow_hidden``); else the id and its resolved path must have no
        part starting with ``.``.

    Raises:
      TypeError: ``roots`` is not a list of paths, or ``rid`` not a string.
      ValueError: the id is malformed (absolute, ``..``, not as :func:`run_id` encodes
        it, NUL, unknown root).
      FileNotFoundError: no run directory with that id inside the root (or a hidden one).
    """
    roots = _roots_arg(roots, "resolve_run")
    allow_hidden = _flag_arg(allow_hidden, "allow_hidden", "resolve_run")
    if not isinstance(rid, str):
        raise TypeError(f"resolve_run: rid={_short(rid)} is a {type(rid).__name__}; rid must "
                        "be a run id string (a path relative to its root, e.g. 'runs/tiny')")
    m = _ROOT_PREFIX.match(rid)
    k, rel = (int(m.group(1)), m.group(2)) if m and len(m.group(1)) < 6 else (0, rid)
    if not roots or k >= len(roots):
        raise ValueError(f"run id rid={rid!r} names root {k}, but there are {len(roots)} run "
                         "roots")
    rel = decode_rel(rel)
    parts = rel.split("/")
    if (not rel or rel.startswith("/") or "\x00" in rel
            or any(p in ("", ".", "..") for p in parts) or not _encodable(rel)):
        raise ValueError(f"bad run id rid={rid!r}: use a relative path inside the run root "
                         "without '..', '.', empty parts, backslashes or lone surrogates")
    root = os.path.realpath(roots[k])
    target = os.path.realpath(os.path.join(root, *parts))
    meta = os.path.realpath(os.path.join(target, RUN_JSON))
    for p in (target, meta):
        if os.path.commonpath([root, p]) != root:
            raise RunNotFound(f"run id rid={rid!r} resolves outside its run root")
    if not allow_hidden and (is_hidden(rel) or is_hidden(os.path.relpath(meta, root))):
        raise RunNotFound(f"no run rid={rid!r}: runs in hidden directories are not served "
                          "(the server's ContentsManager.allow_hidden is False)")
    if not os.path.lexists(os.path.join(target, RUN_JSON)):
        raise RunNotFound(f"no run rid={rid!r}: {target} has no {RUN_JSON}")
    return Path(target)


def effective_status(run: dict[str, Any]) -> str:
    """``run["status"]``, but a ``running`` run whose writer died on this host reads
    ``interrupted`` (a killed kernel never gets to close its run)."""
    _dict_arg(run, "run", "effective_status")
    status = str(run.get("status") or "running")
    pid = run.get("pid")
    if status != "running" or run.get("host") != socket.gethostname() or not isinstance(pid, int):
        return status
    return status if pid_alive(pid, run.get("pid_start")) else "interrupted"


# ----------------------------------------------------------------------------- processes
def pid_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a live pid from a reused one), if known.

    A value that is no process id (zero, negative, not an int) has none: None, as
    :func:`pid_alive` reads it as dead.
    """
    if isinstance(pid, bool):
        return None
    try:
        pid = operator.index(pid)   # an int, or a NumPy integer
    except TypeError:
        return None
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22: starttime
    except (OSError, IndexError):
        return None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether process ``pid`` lives on this host (and is the one that started at ``start``).

    A zombie (exited, not yet reaped) is dead; so is a pid reused by another process
    (its start time differs from ``start``, as recorded by :func:`pid_start_time`). A value
    that is no process id (zero, negative, too large, not an int) is never alive: ``os.kill``
    would signal a whole process group for it.
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process: alive, unless reused or a zombie
        pass
    if start is not None and pid_start_time(pid) not in (None, start):
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
