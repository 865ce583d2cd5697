"""Multi-process training jobs over ``jax.distributed``: launch from a cell, run on pods.

Three verbs and one protocol. ``launch(config, ...)`` starts a training job and returns a
:class:`Job`; ``ping(...)`` starts one that only checks the collectives; ``attach(run_dir)``
finds a job again (after a kernel restart). Where the workers run is a :class:`Cluster`:
``Local(processes=N, devices_per_process=M)`` (the default: ``launch(config,
processes=N)``), ``Slurm(...)`` (``sbatch``), ``Hosts([...])`` (ssh) or ``TPUSlice(...)``
(every worker of a Cloud TPU VM slice). Every worker runs ``python -m workbench train``,
the command a SLURM task or a TPU pod worker runs; the returned Job is the same object and
widget whatever the cluster.

Example::

    import workbench as wb

    job = wb.launch(wb.TrainConfig(model="tiny", steps=200), processes=2,
                    devices_per_process=4, run_dir="runs/tiny-2x4")
    job                      # live widget: processes, loss, log tails, Stop button
    job.wait()               # "finished" | "failed" | "stopped"
    job = wb.launch(cfg, cluster=wb.Slurm(nodes=2, gpus_per_node=8), run_dir="/shared/r")
    job = wb.attach("/shared/r")
"""
from workbench.jobs._cluster import DistributedSpec, detect_cluster
from workbench.jobs._dispatch import attach, launch, ping
from workbench.jobs._hosts import Hosts, TPUSlice
from workbench.jobs._job import Job, NoJobError, ProcessInfo
from workbench.jobs._local import Local
from workbench.jobs._protocol import Cluster, Submission
from workbench.jobs._slurm import Slurm, SlurmError
from workbench.jobs._slurm import available as slurm_available
from workbench.jobs._worker import EXIT_STOPPED
from workbench._run_lock import JobRunningError, RunLock

__all__ = ["EXIT_STOPPED", "Cluster", "DistributedSpec", "Hosts", "Job", "JobRunningError",
           "Local", "NoJobError", "ProcessInfo", "RunLock", "Slurm", "SlurmError", "Submission",
           "TPUSlice", "attach", "detect_cluster", "launch", "ping", "slurm_available"]
