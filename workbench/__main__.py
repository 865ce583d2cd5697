"""The ``workbench`` command: train one worker of a job, launch a local job, ping, list runs.

Usage::

    python -m workbench train CONFIG.json|CONFIG.py --run-dir DIR     # one worker
    python -m workbench launch CONFIG.json --processes 2 --devices-per-process 4 --run-dir DIR
    python -m workbench export RUN_DIR OUT [--step N] [--overwrite]  # a Hugging Face folder
    python -m workbench ping                                         # check jax.distributed
    python -m workbench runs [ROOT ...]                              # list run directories

``train``, ``export`` and ``ping`` join a multi-process job first: with ``--coordinator``,
``--num-processes`` and ``--process-id`` (what ``workbench.jobs`` passes), or from the
cluster environment (SLURM, Open MPI, Cloud TPU pods) through ``jax.distributed``.
Nothing here imports JAX before it is configured.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _count(text: str) -> int:
    """argparse type of a count: a positive integer (``--steps 0`` is an error, not a no-op)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _steps(text: str) -> int:
    """argparse type of ``--steps``: a count the int32 step counter holds."""
    from workbench._validate import MAX_TRAIN_STEPS

    value = _count(text)
    if value > MAX_TRAIN_STEPS:
        raise argparse.ArgumentTypeError(
            f"{value} is past the int32 step counter's {MAX_TRAIN_STEPS}; give fewer steps")
    return value


def _index(text: str) -> int:
    """argparse type of an index: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _seconds(text: str) -> float:
    """argparse type of a duration: finite seconds >= 0 (``nan``/``inf`` would never end)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be finite seconds >= 0, e.g. 30")
    return value


def _add_distributed(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("joining a multi-process job (all optional)")
    g.add_argument("--distributed", choices=("auto", "on", "off"), default="auto",
                   help="auto: explicit flags, else a detected cluster (SLURM, TPU pod, "
                        "Open MPI), else one process; on: always jax.distributed.initialize(); "
                        "off: one process")
    g.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator")
    g.add_argument("--num-processes", type=_count, help="processes in the job")
    g.add_argument("--process-id", type=_index, help="index of this process (0 writes metrics)")
    g.add_argument("--platform", choices=("cpu", "gpu", "cuda", "rocm", "tpu"),
                   help="JAX platform (default: JAX_PLATFORMS or JAX's choice)")
    g.add_argument("--devices-per-process", type=_count,
                   help="CPU: simulated devices of this process; one-host GPU: GPUs per process")
    g.add_argument("--heartbeat-timeout", type=_count,
                   help="seconds without heartbeat before a process counts as dead "
                        "(default 15 for loopback, 60 on clusters)")
    g.add_argument("--initialization-timeout", type=_count, default=300, metavar="SECONDS",
                   help="seconds to wait for every process to join (default 300); then exit "
                        "with status 69, saying what to check")


def _spec(args: argparse.Namespace):  # -> DistributedSpec (import kept lazy)
    from workbench.jobs._cluster import DistributedSpec, validate

    spec = DistributedSpec(mode=args.distributed, coordinator=args.coordinator,
                           num_processes=args.num_processes, process_id=args.process_id,
                           platform=args.platform, devices_per_process=args.devices_per_process,
                           heartbeat_timeout=args.heartbeat_timeout,
                           initialization_timeout=args.initialization_timeout)
    try:
        validate(spec)
    except ValueError as e:
        args.parser.error(str(e))
    return spec


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="workbench", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train CONFIG in RUN_DIR (one worker of a job)")
    t.add_argument("config_file", nargs="?", metavar="CONFIG", help="CONFIG.json or CONFIG.py")
    t.add_argument("--config", dest="config_opt", metavar="CONFIG", help="same as CONFIG")
    t.add_argument("--run-dir", help="run directory (default: the directory of CONFIG.json); "
                                     "on shared storage when the job spans hosts")
    t.add_argument("--steps", type=_steps, help="train until this many steps in total")
    t.add_argument("--data-changed", choices=("ok",),
                   help="continue the run although its data changed since it was recorded "
                        "(wb.Trainer(data_changed='ok'); recorded in run.json's history)")
    t.add_argument("--restart", choices=("ok",),
                   help="start a new attempt of a run whose recorded steps no checkpoint "
                        "restores (wb.Trainer(restart='ok'); recorded in run.json's history)")
    _add_distributed(t)
    t.set_defaults(parser=t)

    la = sub.add_parser("launch", help="start a local multi-process job and follow it")
    la.add_argument("config_file", metavar="CONFIG", help="CONFIG.json or CONFIG.py")
    la.add_argument("--run-dir", required=True)
    la.add_argument("--processes", type=_count, default=2)
    la.add_argument("--devices-per-process", type=_count)
    la.add_argument("--steps", type=_steps)
    la.add_argument("--platform", choices=("cpu", "gpu", "tpu"))
    la.set_defaults(parser=la)

    ex = sub.add_parser("export", help="write RUN_DIR's checkpoint as a Hugging Face folder "
                                       "(one worker of a job, or one process)")
    ex.add_argument("run_dir", metavar="RUN_DIR")
    ex.add_argument("out", metavar="OUT", help="the folder to create")
    ex.add_argument("--step", type=_index, help="checkpoint step (default the newest)")
    ex.add_argument("--dtype", help="tensor dtype written (default the parameters' own)")
    ex.add_argument("--overwrite", action="store_true",
                    help="replace OUT if it is a model folder an earlier export wrote (never "
                         "a run directory or any other folder)")
    _add_distributed(ex)
    ex.set_defaults(parser=ex)

    pg = sub.add_parser("ping", help="check jax.distributed and a cross-process all-reduce")
    pg.add_argument("--hold", type=_seconds, default=0.0, help="keep all-reducing for SECONDS")
    _add_distributed(pg)
    pg.set_defaults(parser=pg)

    r = sub.add_parser("runs", help="list run directories (newest first)")
    r.add_argument("roots", nargs="*", default=["runs"], help="folders to search (default runs)")
    return ap


def _checked_config(args: argparse.Namespace, path: str) -> object:
    """The ``TrainConfig`` of CONFIG.json / CONFIG.py, or a usage error (exit status 2,
    no traceback) naming the file and what is wrong, before any run directory exists."""
    import json

    from workbench.jobs._worker import load_config

    try:
        return load_config(path)
    except (OSError, json.JSONDecodeError, ValueError, TypeError) as err:
        args.parser.exit(2, f"{args.parser.prog}: error: config {path}: {err}\n")
        raise  # unreachable: exit() exits


def _train(args: argparse.Namespace) -> int:
    from workbench._validate import no_new_empty_dirs
    from workbench.jobs import _worker as worker

    config = args.config_opt or args.config_file
    if not config:
        args.parser.error("give CONFIG.json or CONFIG.py (positional or --config)")
    run_dir = args.run_dir
    if run_dir is None:
        if not str(config).endswith(".json"):
            args.parser.error("--run-dir is required with a CONFIG.py")
        run_dir = str(Path(config).resolve().parent)
    _checked_config(args, config)  # the worker reads it again after joining the job
    try:
        with no_new_empty_dirs(run_dir):
            return worker.train(config, run_dir, _spec(args), steps=args.steps,
                                data_changed=args.data_changed, restart=args.restart)
    except worker.ConfigRejected as err:  # a usage error like argparse's: no traceback
        args.parser.exit(2, f"{args.parser.prog}: error: the Trainer refused config {config} "
                            f"for run directory {run_dir}: {err}\n")
        raise  # unreachable: exit() exits


def _launch(args: argparse.Namespace) -> int:
    from workbench.jobs import EXIT_STOPPED, launch

    cfg = _checked_config(args, args.config_file)
    try:
        job = launch(cfg, processes=args.processes, devices_per_process=args.devices_per_process,
                     run_dir=args.run_dir, steps=args.steps, platform=args.platform)
    except (ValueError, TypeError) as err:  # refused before any process started
        args.parser.exit(2, f"{args.parser.prog}: error: {err}\n")
        raise  # unreachable: exit() exits
    print(f"launched {args.processes} processes; logs in {job.run_dir / 'logs'}", flush=True)
    shown = -1
    try:
        while not job.done:
            p = job.progress()
            if p["step"] != shown:
                shown = p["step"]
                loss = p.get("loss")
                print(f"step {shown} of {p['target_steps']}"
                      + (f"  loss {loss:.4f}" if isinstance(loss, float) else ""), flush=True)
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("stopping (every process checkpoints, then exits)...", flush=True)
        job.stop()
    print(repr(job))
    return {"finished": 0, "stopped": EXIT_STOPPED}.get(job.wait(), 1)


def _when(updated: object) -> str:
    """``run.json``'s ``updated`` as local time, or "?" when it is not a time."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(updated or 0)))
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


def _runs(args: argparse.Namespace) -> int:
    from workbench import _runs as runs

    found = runs.list_runs(args.roots)
    if not found:
        print(f"no runs under {', '.join(args.roots)}")
        return 0
    print(f"{'run':<32} {'status':<12} {'step':>12}  {'updated':<19}  name")
    for r in found:
        step = f"{r.get('step') or 0}/{r.get('target_steps') or '?'}"
        when = _when(r.get("updated"))
        print(f"{r['id']:<32} {r['status']:<12} {step:>12}  {when:<19}  {r.get('name', '')}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m workbench`` and the ``workbench`` script."""
    args = _parser().parse_args(argv)
    if args.command == "launch":
        return _launch(args)
    if args.command == "runs":
        return _runs(args)
    from workbench.jobs import _worker as worker

    code = 1
    try:
        if args.command == "train":
            code = _train(args)
        elif args.command == "export":
            code = worker.export(args.run_dir, args.out, _spec(args), step=args.step,
                                 dtype=args.dtype, overwrite=args.overwrite)
        else:
            code = worker.run_ping(_spec(args), hold=args.hold)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
        raise
    finally:
        worker.record_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
