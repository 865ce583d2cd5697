"""Metrics to the trackers researchers already use: TensorBoard, Weights & Biases, MLflow.

``TrainConfig(trackers=["tensorboard", "wandb", "mlflow"])``. The trackers are one sink of
the run (``workbench.train._sinks``, :class:`Trackers`) whose ``update`` does no I/O: one
background thread reads the new steps of ``metrics.jsonl`` and sends them, in one batch per
tracker, every :data:`FLUSH_SECONDS` (and after an eval or a checkpoint, and at the end),
through each library's own client (``workbench.train._tracker_clients``: tensorboardX's
``EventsWriter``, ``wandb.init``'s run, ``mlflow.MlflowClient.log_batch``). So nothing in the
train step waits on a tracker, and a failing one is a warning, not a failed run: every step
stays in ``metrics.jsonl``. Sent: the step's numbers (``KEYS``: loss, eval loss, MFU,
tokens/s, ...) under ``tag`` names, the config, and the plan's summary (``SUMMARY_KEYS`` of
``run.json``). A resumed run
continues the same W&B / MLflow run: its id is kept in ``run.json``'s ``trackers`` (checked
before anything is written, :func:`stored_records`), and gets the steps of ``metrics.jsonl``
it lacks (a run killed before its tracker had them: W&B and MLflow say which steps they
hold; TensorBoard, which cannot, gets new steps only, so a SIGKILL costs its curve the
steps of the last :data:`FLUSH_SECONDS`).
"""
from __future__ import annotations

import importlib.util
import threading
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
#: at the end of a ``run()`` call): what a SIGKILL can lose of a tracker's curve.
FLUSH_SECONDS = 10.0
#: Seconds ``finish`` waits for the trackers to send the last steps and close their runs.
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


# ----------------------------------------------------------------------------- clients
# ----------------------------------------------------------------------------- the sink
class Trackers:
    """Every tracker of a run as one run sink, sent to by one background thread.

    ``update`` does no I/O and holds nothing: the thread reads the steps from
    ``metrics.jsonl`` itself (``runs.MetricsTail``: each step once, as readers of the file
    have it) and sends what each tracker lacks in one batch, every :data:`FLUSH_SECONDS`,
    after a step with an eval or a checkpoint, and at ``finish``. It starts the tracker
    runs first (``record`` keeps their ids) and closes them at ``finish``. A tracker that
    raises is warned about once and sends nothing more; one still busy
    :data:`FINISH_SECONDS` after ``finish`` is warned about and left to go on in the
    background. Training never waits for them and never fails for them.
    """

    def __init__(self, clients: Sequence[Any], stored: Mapping[str, Mapping[str, Any]],
                 info: RunInfo, record: Callable[[str, dict[str, Any]], None],
                 through: int) -> None:
        self.names = tuple(c.name for c in clients)
        self._wake = threading.Event()
        self._stop: str | None = None
        self._busy = self.names[0]   # the tracker the thread is calling
        self._thread = threading.Thread(
            target=self._work, args=(list(clients), stored, info, record, through),
            name="workbench-trackers", daemon=True)
        self._thread.start()

    def event(self, kind: str, **fields: Any) -> None:
        """Events stay in ``metrics.jsonl``."""

    def update(self, record: dict[str, Any]) -> None:
        """The hot path: a step with an eval or a checkpoint wakes the thread; that is all."""
        if record.get("ckpt_time") or "eval_loss" in record:
            self._wake.set()

    def finish(self, status: str, message: str | None = None) -> None:
        """Lets the thread send the last steps and close the runs, waiting at most
        :data:`FINISH_SECONDS`."""
        self._stop = status
        self._wake.set()
        self._thread.join(FINISH_SECONDS)
        if self._thread.is_alive():
            warnings.warn(f"tracker {self._busy!r} is still sending {FINISH_SECONDS:g} s "
                          "after the run ended; every step is in metrics.jsonl, and it goes "
                          "on in the background (until this process exits)", UserWarning,
                          stacklevel=2)

    def _work(self, clients: list[Any], stored: Mapping[str, Mapping[str, Any]],
              info: RunInfo, record: Callable[[str, dict[str, Any]], None],
              through: int) -> None:
        started = [c for c in clients if self._call(c, "start its run", lambda c=c: _start(
            c, stored.get(c.name) or {}, info, record))]
        sending, tail = list(started), runs.MetricsTail(info.run_dir)
        while True:
            stop = self._stop   # read before the poll: every step of the call is in the file
            steps, _ = tail.poll()
            for client in list(sending):
                todo = steps if client.backfill else [r for r in steps if r["step"] > through]
                if todo and not self._call(client, "send metrics", lambda: client.log(todo)):
                    sending.remove(client)
            if stop is not None:
                for client in started:
                    self._call(client, "close its run", lambda: client.close(stop))
                return
            self._wake.wait(FLUSH_SECONDS)
            self._wake.clear()

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


def _start(client: Any, stored: Mapping[str, Any], info: RunInfo,
           record: Callable[[str, dict[str, Any]], None]) -> None:
    """Starts ``client``'s run; a new run's id goes to ``run.json``."""
    entry = client.start(stored, info)
    if entry is not None and entry != dict(stored):
        record(client.name, entry)


def _hint(err: Exception) -> str:
    """The fix for a missing library of a tracker's store (MLflow's database store)."""
    if isinstance(err, ModuleNotFoundError) and err.name in ("sqlalchemy", "alembic"):
        return (f". MLflow's database store needs {err.name}: pip install mlflow (or "
                "sqlalchemy alembic), or set MLFLOW_TRACKING_URI to your tracking server")
    return ""


def tracker_sinks(names: Sequence[str], writer: runs.RunWriter, config: dict[str, Any],
                  stored: Mapping[str, Mapping[str, Any]],
                  history: Sequence[dict[str, Any]]) -> list[Trackers]:
    """One :class:`Trackers` sink for ``names`` (none without), continuing the runs
    ``stored`` (:func:`stored_records`) with the steps of ``metrics.jsonl`` they lack and
    keeping the ids of new ones in ``writer``'s ``run.json``. ``history`` is what readers of
    ``metrics.jsonl`` had before this call: TensorBoard, which cannot say what it holds,
    gets only the steps after it."""
    if not names:
        return []
    lock = threading.Lock()

    def record(name: str, entry: dict[str, Any]) -> None:
        with lock:
            writer.update(trackers={**(writer.meta.get("trackers") or {}), name: entry})

    through = max((rec["step"] for rec in history), default=0)
    info = RunInfo(writer.run_dir, config, writer.meta, FLUSH_SECONDS)
    return [Trackers([SENDERS[n]() for n in names], stored, info, record, through)]
