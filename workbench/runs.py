"""Run directories (``wb.runs``): ``run.json`` metadata plus the append-only
``metrics.jsonl``; write, read, list. Standard library only: the Jupyter server extension
reads runs through this module without importing JAX.

Example::

    from workbench import runs

    with runs.RunWriter("runs/demo", config={"model": "tiny"}) as w:
        w.log({"step": 1, "loss": 4.2, "mfu": 0.31})
    runs.read_metrics("runs/demo")            # [{"step": 1, "loss": 4.2, ...}]
    runs.list_runs("runs")                    # every run under runs/, newest first
"""
from workbench._runs import (HISTORY_EVENTS, METRICS, RUN_JSON, STATUSES, MetricsTail,
                             RunFileError, RunNotFound, RunWriter, check_run, clean_prediction,
                             columns, config_hash, effective_status, find_run_dirs, is_hidden,
                             json_safe, list_runs, pid_alive, pid_start_time, read_attempts,
                             read_events, read_metrics, read_run, resolve_run, run_id)

__all__ = ["HISTORY_EVENTS", "METRICS", "RUN_JSON", "STATUSES", "MetricsTail", "RunFileError",
           "RunNotFound", "RunWriter", "check_run", "clean_prediction", "columns", "config_hash",
           "effective_status", "find_run_dirs", "is_hidden", "json_safe",
           "list_runs", "pid_alive", "pid_start_time", "read_attempts", "read_events",
           "read_metrics", "read_run", "resolve_run", "run_id"]
