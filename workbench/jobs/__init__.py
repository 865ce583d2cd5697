"""Multi-process training jobs over ``jax.distributed``: launch from a cell, run on pods.

``launch(config, processes=N, devices_per_process=M, run_dir=...)`` starts N worker
processes on this machine, each running ``python -m workbench train`` (the same command
a SLURM task or a TPU pod worker runs), and returns a :class:`Job`.

Example::

    import workbench as wb

    job = wb.launch(wb.TrainConfig(model="tiny", steps=200), processes=2,
                    devices_per_process=4, run_dir="runs/tiny-2x4")
    job                      # live widget: processes, loss, log tails, Stop button
    job.wait()               # "finished" | "failed" | "stopped"
"""
from workbench.jobs.cluster import DistributedSpec, detect_cluster
from workbench.jobs.job import Job, ProcessInfo, attach
from workbench.jobs.local import launch, ping
from workbench.run_lock import JobRunningError, RunLock
from workbench.jobs.worker import EXIT_STOPPED

__all__ = ["EXIT_STOPPED", "DistributedSpec", "Job", "JobRunningError", "ProcessInfo",
           "RunLock", "attach", "detect_cluster", "launch", "ping"]

