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

On a cluster, ``launch(config, cluster=...)`` runs the same worker command there:
``Slurm(...)`` submits it with ``sbatch`` (``jobs.slurm``), ``Hosts([...])`` starts it on
every host over ssh and ``TPUSlice(...)`` on every worker of a Cloud TPU VM slice
(``jobs.hosts``). The returned Job is the same object and widget.
"""
from workbench.jobs.cluster import DistributedSpec, detect_cluster
from workbench.jobs.job import Job, ProcessInfo
from workbench.jobs.hosts import Hosts, TPUSlice
from workbench.jobs.local import launch, ping
from workbench.jobs.slurm import Slurm, SlurmError
from workbench.jobs.reattach import attach
from workbench.run_lock import JobRunningError, RunLock
from workbench.jobs.worker import EXIT_STOPPED

__all__ = ["EXIT_STOPPED", "DistributedSpec", "Hosts", "Job", "JobRunningError", "ProcessInfo",
           "RunLock", "Slurm", "SlurmError", "TPUSlice", "attach", "detect_cluster", "launch",
           "ping"]

