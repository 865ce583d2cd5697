"""Metrics to the trackers researchers already use: TensorBoard, Weights & Biases, MLflow.

``TrainConfig(trackers=["tensorboard", "wandb", "mlflow"])``. The trackers are one sink of
the run (``workbench.train._sinks``, :class:`Trackers`) that lives for the Trainer and whose
``update`` does no I/O: one background thread starts the tracker runs once (importing the
libraries there), reads the new steps of ``metrics.jsonl`` and sends them, in one batch per
tracker, every :data:`FLUSH_SECONDS` (and after an eval or a checkpoint, and after each
``run()`` call, which does not wait for it), through each library's own client
(``workbench.train._tracker_clients``: tensorboardX's ``EventsWriter``, ``wandb.init``'s run,
``mlflow.MlflowClient.log_batch``). ``Trainer.close()``, the end of the interpreter (a
notebook kernel's shutdown) and a newer Trainer of the same run directory send the last
steps and finish the tracker runs. So nothing in the train step waits on a tracker, and a
failing one is a warning, not a failed run: every step stays in ``metrics.jsonl``. Sent:
the step's numbers (``KEYS``: loss, eval loss, MFU, tokens/s, ...) under ``tag`` names, the
config, and the plan's summary (``SUMMARY_KEYS`` of ``run.json``). A resumed run
continues the same W&B / MLflow run: its id is kept in ``run.json``'s ``trackers`` (checked
before anything is written, :func:`stored_records`), and gets the steps of ``metrics.jsonl``
it lacks (a run killed before its tracker had them: W&B and MLflow say which steps they
hold; TensorBoard, which cannot, gets new steps only, so a SIGKILL costs its curve the
steps of the last :data:`FLUSH_SECONDS`).
"""
from __future__ import annotations

import atexit
import importlib.util
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench import _runs as runs
from workbench.train._tracker_clients import SENDERS, RunInfo

#: The trackers ``TrainConfig.trackers`` names.
TRACKERS = ("tensorboard", "wandb", "mlflow")
#: tracker -> (the module its client is, how to install it)
PACKAGES = {"tensorboard": ("tensorboardX", "pip install tensorboardX"),
            "wandb": ("wandb", "pip install wandb"),
            "mlflow": ("mlflow", "pip install mlflow-skinny (or mlflow, with its local "
                                 "database store and UI)")}
#: Seconds between the trackers' sends (also after a step with an eval or a checkpoint, and
#: after a ``run()`` call): what a SIGKILL can lose of a tracker's curve.
FLUSH_SECONDS = 10.0
#: Seconds ``Trackers.close`` (and the interpreter's exit) waits for the trackers to send the
#: last steps and finish their runs.
FINISH_SECONDS = 60.0
def check_trackers(value: Any) -> tuple[str, ...]:
    """``TrainConfig.trackers`` checked: a list (or tuple) of :data:`TRACKERS`, each once."""
    where, known = "TrainConfig.trackers", ", ".join(map(repr, TRACKERS))
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}={value!r:.80} is a {type(value).__name__}; give a list of "
                        f"tracker names, e.g. trackers=['wandb'] (known: {known}), or [] "
                        "for none")
    for name in value:
        if not isinstance(name, str):
            raise TypeError(f"{where} holds {name!r:.80}, a {type(name).__name__}; tracker "
                            f"names are strings: {known}")
        if name not in TRACKERS:
            raise ValueError(f"{where}: unknown tracker {name!r:.80}; choose from {known}")
    twice = sorted({n for n in value if value.count(n) > 1})
    if twice:
        raise ValueError(f"{where}={list(value)!r} names {', '.join(map(repr, twice))} more "
                         "than once; name each tracker once")
    return tuple(value)


def require(names: Sequence[str]) -> None:
    """Refuses trackers whose library is not installed (nothing is imported here)."""
    for name in names:
        module, pip = PACKAGES[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):   # a module set to None, a broken parent package
            found = False
        if not found:
            raise ImportError(f"TrainConfig.trackers names {name!r}, which needs the "
                              f"{module} package: {pip}; or leave {name!r} out of trackers")


# ----------------------------------------------------------------------------- run.json
def _check_id(name: str, value: str) -> None:
    """The tracker library's own rule for a run id (raises its error)."""
    if name == "wandb":
        import wandb

        wandb.Settings(run_id=value)
    else:
        from mlflow.utils.validation import _validate_run_id

        _validate_run_id(value)


#: tracker -> (the field holding the run id, the other text fields of its record)
_RECORD = {"wandb": ("id", ("project", "entity")),
           "mlflow": ("run_id", ("tracking_uri", "experiment_id"))}


def stored_records(run_dir: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The tracker runs ``run_dir/run.json`` records for ``names`` (``{}`` for a new run).

    Raises:
      RunFileError: (a ValueError) the record is not what a Trainer writes (edited by
        hand): the message names the field, the value and the fix; nothing was changed.
    """
    if not names or not (run_dir / runs.RUN_JSON).exists():
        return {}
    path = run_dir / runs.RUN_JSON
    record = runs.read_run(run_dir).get("trackers")
    fix = ("nothing was changed (metrics.jsonl and the checkpoints are kept). Restore what "
           "the tracker shows for this run, or delete run.json's 'trackers' entry of that "
           "tracker to start a new tracker run")
    if record is None:
        return {}
    if not isinstance(record, dict):
        raise runs.RunFileError(f"{path}: 'trackers' is {record!r:.80}, not an object of "
                                f"tracker runs; {fix}")
    out = {}
    for name in names:
        entry = record.get(name)
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise runs.RunFileError(f"{path}: trackers.{name} is {entry!r:.80}, not an "
                                    f"object; {fix}")
        key, texts = _RECORD[name]
        for field in (key, *texts):
            value = entry.get(field)
            if not (isinstance(value, str) or (value is None and field != key)):
                raise runs.RunFileError(f"{path}: trackers.{name}.{field}={value!r:.80} must "
                                        f"be a string; {fix}")
        try:
            _check_id(name, entry[key])
        except Exception as err:  # noqa: BLE001 - the library's own error type
            raise runs.RunFileError(f"{path}: trackers.{name}.{key}={entry[key]!r:.80} is not "
                                    f"a {name} run id ({err}); {fix}") from None
        out[name] = {f: entry.get(f) for f in (key, *texts)}
    return out


# ----------------------------------------------------------------------------- the sink
#: This process's tracker sessions by run directory: a newer one (a Trainer of the same
#: directory made again, e.g. by re-running a notebook cell) takes the runs over.
_OPEN: dict[Path, Trackers] = {}
#: Every session whose thread is still sending or closing (finished at interpreter exit).
_LIVE: set[Trackers] = set()
#: Guards _OPEN, _LIVE, and each session's writer and records; re-entrant, as a collected
#: Trainer's finalizer (``Trackers.close``) may run in a thread that holds it.
_LOCK = threading.RLock()


class Trackers:
    """Every tracker of a Trainer's run as one run sink, sent to by one background thread.

    Opened at the Trainer's first ``run()`` with trackers (:func:`open_trackers`) and kept
    for the Trainer: the thread starts the tracker runs once (importing their libraries
    there) and they stay open across ``run()`` calls. ``update`` does no I/O and holds
    nothing: the thread reads the steps from ``metrics.jsonl`` itself (``runs.MetricsTail``:
    each step once, as readers of the file have it) and sends what each tracker lacks in
    one batch, every :data:`FLUSH_SECONDS`, after a step with an eval or a checkpoint, and
    after each ``run()`` call (``finish`` asks for that send and returns at once).
    :meth:`close` sends the last steps and finishes the tracker runs with the last call's
    status: ``Trainer.close()``, the end of the interpreter (a notebook kernel's shutdown
    included) and a newer session of the same run directory call it. A tracker that raises
    is warned about once and sends nothing more; one still busy :data:`FINISH_SECONDS`
    after ``close`` is warned about and left to go on in the background. Training never
    waits for them and never fails for them.
    """

    def __init__(self, names: Sequence[str], info: RunInfo,
                 stored: Mapping[str, Mapping[str, Any]], through: int) -> None:
        self.names, self.key = tuple(names), info.run_dir.resolve()
        self._wake = threading.Event()
        self._started = threading.Event()   # the tracker runs started (or failed to)
        self._closing = False
        self._status = "finished"    # the last run() call's: the tracker runs end with it
        self._busy = self.names[0]   # the tracker the thread is calling
        self._writer: runs.RunWriter | None = None   # the run() call's, for new run ids
        self._entries: dict[str, dict[str, Any]] = {}   # the run ids this session recorded
        with _LOCK:
            before = _OPEN.get(self.key)
            _OPEN[self.key] = self
            _LIVE.add(self)
        if before is not None:
            before.close(wait=False)   # its new run ids come to this session (_record)
        _register_exit()
        self._thread = threading.Thread(
            target=self._work, args=(info, stored, through, before, time.time()),
            name="workbench-trackers", daemon=True)
        self._thread.start()

    def attach(self, writer: runs.RunWriter) -> None:
        """The ``run()`` call's run writer: the run ids recorded go to its ``run.json``."""
        with _LOCK:
            self._writer = writer
            self._write_entries()

    def event(self, kind: str, **fields: Any) -> None:
        """Events stay in ``metrics.jsonl``."""

    def update(self, record: dict[str, Any]) -> None:
        """The hot path: a step with an eval or a checkpoint wakes the thread; that is all."""
        if record.get("ckpt_time") or "eval_loss" in record:
            self._wake.set()

    def finish(self, status: str, message: str | None = None) -> None:
        """The end of a ``run()`` call: the thread sends its last steps soon, unwaited for.
        Only tracker runs still starting are waited for (at most :data:`FINISH_SECONDS`):
        their libraries start threads, which an exiting interpreter refuses, so a script
        that ends after this call would lose them."""
        self._status = status
        self._wake.set()
        if not self._started.wait(FINISH_SECONDS):
            warnings.warn(f"tracker {self._busy!r} is still starting its run "
                          f"{FINISH_SECONDS:g} s after the run() call ended; every step is in "
                          "metrics.jsonl, and it goes on in the background", UserWarning,
                          stacklevel=2)

    def close(self, *, wait: bool = True) -> None:
        """Sends the last steps and finishes the tracker runs; with ``wait``, waits at most
        :data:`FINISH_SECONDS` for that (then warns and leaves it to the background)."""
        self._closing = True
        self._wake.set()
        with _LOCK:
            if _OPEN.get(self.key) is self:
                del _OPEN[self.key]
        if wait:
            self._thread.join(FINISH_SECONDS)
            if self._thread.is_alive():
                self._still_busy()

    def _still_busy(self) -> None:
        warnings.warn(f"tracker {self._busy!r} is still sending {FINISH_SECONDS:g} s after "
                      "the run was closed; every step is in metrics.jsonl, and it goes on in "
                      "the background (until this process exits)", UserWarning, stacklevel=3)

    def _record(self, name: str, entry: dict[str, Any]) -> None:
        """Keeps a new tracker run's id in ``run.json`` (through the newest session of the
        run directory, whose writer is the current one)."""
        with _LOCK:
            target = _OPEN.get(self.key) or self
            target._entries[name] = entry
            target._write_entries()

    def _write_entries(self) -> None:
        """The recorded run ids into the writer's ``run.json`` (called holding ``_LOCK``)."""
        if self._writer is None:
            return
        have = self._writer.meta.get("trackers") or {}
        if any(have.get(n) != e for n, e in self._entries.items()):
            self._writer.update(trackers={**have, **self._entries})

    def _work(self, info: RunInfo, stored: Mapping[str, Mapping[str, Any]], through: int,
              before: Trackers | None, since: float) -> None:
        try:
            if before is not None:   # its runs end first: this session continues them
                before._thread.join()
                stored = {**_stored_again(info.run_dir, self.names, stored), **self._entries}
            self._send(info, stored, through, since)
        finally:
            self._started.set()
            with _LOCK:
                _LIVE.discard(self)

    def _send(self, info: RunInfo, stored: Mapping[str, Mapping[str, Any]], through: int,
              since: float) -> None:
        started = [c for c in (SENDERS[n]() for n in self.names)
                   if self._call(c, "start its run", lambda c=c: self._start(c, stored, info))]
        _register_exit()   # after the libraries' own exit hooks: this one runs before them
        self._started.set()
        sending, tail, first = list(started), runs.MetricsTail(info.run_dir), True
        while True:
            self._wake.clear()
            closing = self._closing   # read before the poll: every step written is in the file
            steps, _ = tail.poll()
            if first:   # the steps readers had before this session: TensorBoard has them
                through = max([through, *(r["step"] for r in steps if r.get("time", 0) < since)])
                first = False
            for client in list(sending):
                todo = steps if client.backfill else [r for r in steps if r["step"] > through]
                if todo and not self._call(client, "send metrics", lambda: client.log(todo)):
                    sending.remove(client)
            if closing:
                for client in started:
                    self._call(client, "close its run", lambda: client.close(self._status))
                return
            self._wake.wait(FLUSH_SECONDS)

    def _start(self, client: Any, stored: Mapping[str, Mapping[str, Any]],
               info: RunInfo) -> None:
        """Starts ``client``'s run; a new run's id goes to ``run.json``."""
        before = dict(stored.get(client.name) or {})
        entry = client.start(before, info)
        if entry is not None and entry != before:
            self._record(client.name, entry)

    def _call(self, client: Any, what: str, fn: Callable[[], Any]) -> bool:
        self._busy = client.name
        try:
            fn()
            return True
        except Exception as err:  # noqa: BLE001 - a tracker never fails the run
            warnings.warn(f"tracker {client.name!r} could not {what} ({type(err).__name__}: "
                          f"{str(err)[:500]}); it gets no more of this run's metrics, "
                          f"training goes on, and every step is in metrics.jsonl{_hint(err)}",
                          UserWarning, stacklevel=1)
            return False


def _stored_again(run_dir: Path, names: Sequence[str],
                  stored: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Mapping[str, Any]]:
    """``run.json``'s tracker runs read after an older session closed (it may have
    recorded one since); ``stored`` where the file cannot be read."""
    try:
        return {**stored, **stored_records(run_dir, names)}
    except (OSError, ValueError):
        return stored


def _hint(err: Exception) -> str:
    """The fix for a missing library of a tracker's store (MLflow's database store)."""
    if isinstance(err, ModuleNotFoundError) and err.name in ("sqlalchemy", "alembic"):
        return (f". MLflow's database store needs {err.name}: pip install mlflow (or "
                "sqlalchemy alembic), or set MLFLOW_TRACKING_URI to your tracking server")
    return ""


def _register_exit() -> None:
    """Puts :func:`_close_all` last among the exit hooks, so it runs first (before W&B's,
    which its service registers at the first ``wandb.init``)."""
    atexit.unregister(_close_all)
    atexit.register(_close_all)


def _close_all() -> None:
    """At interpreter exit: every session sends its last steps and finishes its runs,
    within :data:`FINISH_SECONDS` in all."""
    with _LOCK:
        live = list(_LIVE)
    for session in live:
        session.close(wait=False)
    deadline = time.monotonic() + FINISH_SECONDS
    for session in live:
        session._thread.join(max(0.0, deadline - time.monotonic()))
        if session._thread.is_alive():
            session._still_busy()


def open_trackers(names: Sequence[str], writer: runs.RunWriter,
                  through: int) -> Trackers | None:
    """The :class:`Trackers` of ``names`` for a Trainer (None without), continuing the
    tracker runs ``run.json`` records (:func:`stored_records`) with the steps of
    ``metrics.jsonl`` they lack, and keeping the ids of new ones in ``writer``'s
    ``run.json``. TensorBoard, which cannot say what it holds, gets only the steps after
    ``through`` and after those ``metrics.jsonl`` holds now."""
    if not names:
        return None
    info = RunInfo(writer.run_dir, writer.meta["config"], writer.meta, FLUSH_SECONDS)
    session = Trackers(names, info, stored_records(writer.run_dir, names), through)
    session.attach(writer)
    return session
