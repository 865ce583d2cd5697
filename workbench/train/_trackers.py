"""Metrics to the trackers researchers already use: TensorBoard, Weights & Biases, MLflow.

``TrainConfig(trackers=["tensorboard", "wandb", "mlflow"])``. The trackers are one sink of
the run (``workbench.train._sinks``, :class:`Trackers`) whose ``update`` does no I/O: one
background thread reads the new steps of ``metrics.jsonl`` and sends them, in one batch per
tracker, every :data:`FLUSH_SECONDS` (and after an eval or a checkpoint, and at the end),
through each library's own client (tensorboardX's ``EventsWriter``, ``wandb.init``'s run,
``mlflow.MlflowClient.log_batch``). So nothing in the train step waits on a tracker, and a
failing one is a warning, not a failed run: every step stays in ``metrics.jsonl``. Sent: the
step's numbers (:data:`KEYS`: loss, eval loss, MFU, tokens/s, ...) under :func:`tag` names,
the config, and the plan's summary (:data:`SUMMARY_KEYS` of ``run.json``). A resumed run
continues the same W&B / MLflow run: its id is kept in ``run.json``'s ``trackers`` (checked
before anything is written, :func:`stored_records`), and gets the steps of ``metrics.jsonl``
it lacks (a run killed before its tracker had them: W&B and MLflow say which steps they
hold; TensorBoard, which cannot, gets new steps only, so a SIGKILL costs its curve the
steps of the last :data:`FLUSH_SECONDS`).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench import _runs as runs

#: The trackers ``TrainConfig.trackers`` names.
TRACKERS = ("tensorboard", "wandb", "mlflow")
#: tracker -> (the module its client is, how to install it)
PACKAGES = {"tensorboard": ("tensorboardX", "pip install tensorboardX"),
            "wandb": ("wandb", "pip install wandb"),
            "mlflow": ("mlflow", "pip install mlflow-skinny (or mlflow, with its local "
                                 "database store and UI)")}
#: The step record's numbers each tracker gets (``workbench.train._metrics.step_record``).
KEYS = ("loss", "eval_loss", "eval_perplexity", "grad_norm", "lr", "step_time", "data_time",
        "ckpt_time", "tokens_per_s", "mfu", "hfu")
#: ``run.json`` fields sent as the plan's summary (the hardware, the model's FLOPs, the
#: layout and, from ``Trainer.from_plan``, the prediction).
SUMMARY_KEYS = ("mesh", "device_kind", "process_count", "peak_flops", "peak_source",
                "model_flops_per_step", "memory_per_device", "attention", "dtype",
                "placement", "prediction")
#: Seconds between the trackers' sends (also after a step with an eval or a checkpoint, and
#: at the end of a ``run()`` call): what a SIGKILL can lose of a tracker's curve.
FLUSH_SECONDS = 10.0
#: Seconds ``finish`` waits for the trackers to send the last steps and close their runs.
FINISH_SECONDS = 60.0
#: The Trainer's W&B run: no system metrics, console capture or list of installed packages
#: (``run.json`` keeps the versions; W&B's init spends ~0.1 s of CPU listing them), and its
#: ``.wandb`` file written as often as the Trainer sends (``FLUSH_SECONDS``, added at init).
WANDB_SETTINGS = {"x_disable_stats": True, "console": "off", "x_save_requirements": False}
_STATUS = {"wandb": {"finished": 0, "interrupted": 130, "failed": 1},
           "mlflow": {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}}


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


def tag(key: str) -> str:
    """The name a step number has in every tracker: ``eval/loss`` for ``eval_loss``,
    ``train/<key>`` for the rest (``train/loss``, ``train/mfu``, ``train/tokens_per_s``)."""
    return "eval/" + key[5:] if key.startswith("eval_") else f"train/{key}"


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite numbers of :data:`KEYS`, by :func:`tag` name."""
    out = {}
    for key in KEYS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            out[tag(key)] = float(value)
    return out


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
def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class RunInfo:
    """What a tracker's run starts with: the run's name and folder, config and summary."""

    def __init__(self, run_dir: Path, config: dict[str, Any], meta: Mapping[str, Any]) -> None:
        self.run_dir, self.name, self.config = run_dir, run_dir.resolve().name, config
        self.summary = runs.json_safe({k: meta.get(k) for k in SUMMARY_KEYS
                                       if meta.get(k) is not None})


class TensorBoardSender:
    """TensorBoard event files in ``<run_dir>/tensorboard`` (tensorboardX's ``EventsWriter``,
    written and flushed from the trackers' thread: ``SummaryWriter`` would add a thread and
    a process queue of its own); the config and summary as text. A file per call."""

    name = "tensorboard"
    backfill = False   # event files cannot say which steps they hold

    def start(self, stored: Mapping[str, Any], info: RunInfo) -> dict[str, Any] | None:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.summary import text

        folder = info.run_dir / "tensorboard"
        folder.mkdir(parents=True, exist_ok=True)
        # the suffix keeps two calls within a second from sharing (truncating) a file
        self.writer = EventsWriter(str(folder / "events"), f".{time.time_ns()}")
        now = time.time()
        self._write([(text("config", json.dumps(info.config, indent=1)), 0, now),
                     (text("plan", json.dumps(info.summary, indent=1)), 0, now)])
        return None

    def log(self, records: list[dict[str, Any]]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import scalar

        # one event per step holding its scalars (a third cheaper than one per scalar)
        self._write([(Summary(value=[v for name, value in scalars(rec).items()
                                     for v in scalar(name, value).value]),
                      rec["step"], rec.get("time") or time.time()) for rec in records])

    def _write(self, summaries: list[tuple[Any, int, float]]) -> None:
        """Writes ``(summary, step, walltime)`` events and flushes the file."""
        from tensorboardX.proto.event_pb2 import Event

        for summary, step, when in summaries:
            self.writer.write_event(Event(summary=summary, step=step, wall_time=when))
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class WandbSender:
    """A W&B run (``wandb.init(id=..., resume="allow")``): online, or offline with
    ``WANDB_MODE=offline`` (``wandb sync`` uploads it). Its files go to ``WANDB_DIR``, else to
    the run directory; the project is ``WANDB_PROJECT``'s (W&B's own default otherwise)."""

    name = "wandb"
    backfill = True   # W&B drops the steps it holds (below run.step) itself

    def start(self, stored: Mapping[str, Any], info: RunInfo) -> dict[str, Any]:
        import wandb

        self.run = wandb.init(
            id=stored.get("id"), project=stored.get("project"), entity=stored.get("entity"),
            name=info.name, config={**info.config, "plan": info.summary},
            dir=None if os.environ.get("WANDB_DIR") else str(info.run_dir),
            resume="allow", reinit="create_new", allow_val_change=True,
            settings=wandb.Settings(**WANDB_SETTINGS,
                                    x_transaction_log_flush_interval=FLUSH_SECONDS))
        return {"id": self.run.id, "project": self.run.project,
                "entity": self.run.entity or None}

    def log(self, records: list[dict[str, Any]]) -> None:
        first = self.run.step   # read once: the property costs ~0.1 ms, records rise
        for rec in records:
            if rec["step"] >= first:   # lower steps: W&B keeps its first records
                self.run.log(scalars(rec), step=rec["step"])

    def close(self, status: str) -> None:
        self.run.finish(exit_code=_STATUS["wandb"][status])


class MlflowSender:
    """An MLflow run in the tracking store MLflow is set to (``MLFLOW_TRACKING_URI``, else
    its default) and experiment (``MLFLOW_EXPERIMENT_NAME`` / ``_ID``, else Default). The
    config and summary are its params (``plan.*``); a resumed run goes on in the store it
    started in, from the step after the last it holds."""

    name = "mlflow"
    backfill = True

    def start(self, stored: Mapping[str, Any], info: RunInfo) -> dict[str, Any]:
        import mlflow
        from mlflow.entities import Param

        client = self.client = mlflow.MlflowClient(
            tracking_uri=stored.get("tracking_uri") or mlflow.get_tracking_uri())
        if stored.get("run_id"):
            run = client.get_run(stored["run_id"])
            client.update_run(run.info.run_id, status="RUNNING")
            self.last = max((m.step for m in client.get_metric_history(
                run.info.run_id, tag("loss"))), default=0)
        else:
            run = client.create_run(_experiment_id(client), run_name=info.name,
                                    tags={"workbench.run_dir": str(info.run_dir.resolve())})
            self.last = 0
        self.run_id = run.info.run_id
        params = _flatten({**info.config, "plan": info.summary})
        have = run.data.params   # MLflow params cannot change: the run's first are kept
        new = [Param(k[:250], json.dumps(v) if not isinstance(v, str) else v)
               for k, v in params.items() if k[:250] not in have]
        for i in range(0, len(new), 100):   # MLflow's limit of params per batch
            client.log_batch(self.run_id, params=[Param(p.key, p.value[:6000])
                                                  for p in new[i:i + 100]])
        return {"run_id": self.run_id, "tracking_uri": client.tracking_uri,
                "experiment_id": run.info.experiment_id}

    def log(self, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        # whole steps per batch (MLflow's limit: 1000 metrics), each batch one transaction:
        # a resume, which goes on after the last step the store holds, then misses none
        batch: list[Any] = []
        for rec in records:
            if rec["step"] > self.last:
                when = int(rec.get("time", time.time()) * 1000)
                step = [Metric(k, v, when, rec["step"]) for k, v in scalars(rec).items()]
                if len(batch) + len(step) > 1000:
                    self.client.log_batch(self.run_id, metrics=batch)
                    batch = []
                batch += step
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, _STATUS["mlflow"][status])


def _experiment_id(client: Any) -> str:
    """The experiment MLflow's environment names (created when missing), else Default."""
    from mlflow.environment_variables import MLFLOW_EXPERIMENT_ID, MLFLOW_EXPERIMENT_NAME

    if MLFLOW_EXPERIMENT_ID.get():
        return str(MLFLOW_EXPERIMENT_ID.get())
    name = MLFLOW_EXPERIMENT_NAME.get()
    if not name:
        return "0"
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found else client.create_experiment(name)


SENDERS: dict[str, Callable[[], Any]] = {"tensorboard": TensorBoardSender,
                                         "wandb": WandbSender, "mlflow": MlflowSender}


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
    return [Trackers([SENDERS[n]() for n in names], stored,
                     RunInfo(writer.run_dir, config, writer.meta), record, through)]
