"""The trackers' own clients behind one protocol (``start``, ``log``, ``close``, ``name``,
``backfill``): TensorBoard event files (tensorboardX), a W&B run, an MLflow run. Each is
called from the trackers' thread only (``workbench.train._trackers.Trackers``).
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from workbench import _runs as runs

#: The step record's numbers each tracker gets (``workbench.train._metrics.step_record``).
KEYS = ("loss", "eval_loss", "eval_perplexity", "grad_norm", "lr", "step_time", "data_time",
        "ckpt_time", "tokens_per_s", "mfu", "hfu")
#: ``run.json`` fields sent as the plan's summary (the hardware, the model's FLOPs, the
#: layout and, from ``Trainer.from_plan``, the prediction).
SUMMARY_KEYS = ("mesh", "device_kind", "process_count", "peak_flops", "peak_source",
                "model_flops_per_step", "memory_per_device", "attention", "dtype",
                "placement", "prediction")
#: The Trainer's W&B run: no system metrics, console capture or list of installed packages
#: (``run.json`` keeps the versions; W&B's init spends ~0.1 s of CPU listing them), and its
#: ``.wandb`` file written as often as the Trainer sends (``RunInfo.flush_seconds``).
WANDB_SETTINGS = {"x_disable_stats": True, "console": "off", "x_save_requirements": False}
_STATUS = {"wandb": {"finished": 0, "interrupted": 130, "failed": 1},
           "mlflow": {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}}


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


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class RunInfo:
    """What a tracker's run starts with: the run's name and folder, config and summary, and
    the seconds between the Trainer's sends."""

    def __init__(self, run_dir: Path, config: dict[str, Any], meta: Mapping[str, Any],
                 flush_seconds: float = 10.0) -> None:
        self.run_dir, self.name, self.config = run_dir, run_dir.resolve().name, config
        self.flush_seconds = flush_seconds
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
                                    x_transaction_log_flush_interval=info.flush_seconds))
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
