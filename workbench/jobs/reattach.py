"""Finding a job again from its run directory, whoever started it: SLURM, ssh, or this host."""
from __future__ import annotations

import os
from pathlib import Path

from workbench._validate import check_path
from workbench.jobs import job as local
from workbench.jobs.hosts import HOSTS_FILE, attach_hosts
from workbench.jobs.slurm import SLURM_FILE
from workbench.jobs.slurm_job import attach_slurm

__all__ = ["attach"]


def attach(run_dir: str | os.PathLike[str]) -> local.Job:
    """Watches the job of ``run_dir`` again (e.g. after a kernel restart).

    A job submitted to SLURM (``run_dir/slurm.json``) is found in any state, queued,
    running or ended: its state comes from SLURM. A job started over ssh
    (``run_dir/hosts.json``) or as local processes is found while it runs.

    Raises:
      NoJobError: (a FileNotFoundError) no running job holds ``run_dir`` (and none was
        submitted to SLURM).
    """
    path = check_path(run_dir, "run_dir", where="wb.attach: ")
    if (path / SLURM_FILE).exists():
        return attach_slurm(path)
    if (path / HOSTS_FILE).exists():
        return attach_hosts(path)
    return local.attach(path)
