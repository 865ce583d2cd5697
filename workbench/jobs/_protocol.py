"""The ``Cluster`` protocol: what every place a job can run implements (``Local``, ``Slurm``,
``Hosts``, ``TPUSlice``), and the ``Submission`` a launch hands it.

``wb.launch``, ``workbench.jobs.ping`` and ``wb.attach`` know no cluster kind: they build a
:class:`Submission` (the worker subcommand, the files to write, the target) and call
``cluster.submit(submission)``; ``attach`` asks each kind whether the run directory holds
a job it started (``recorded``) and lets that kind find it again (``attach``). A new kind
(Kubernetes, an MPI launcher) is one class with these five members.

Example::

    from workbench.jobs import Cluster, Local
    isinstance(wb.Slurm(nodes=2), Cluster)          # True: every kind is a Cluster
    job = wb.launch(cfg, cluster=Local(processes=2, devices_per_process=4))
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from workbench.jobs._job import Job

__all__ = ["Cluster", "Submission", "check_mesh"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Submission:
    """One job as a cluster receives it.

    Attributes:
      run_dir: the run directory (absolute); on shared storage when the job spans hosts.
      command: what every worker runs after ``python -m workbench``: ``("train",
        "--config", ..., "--run-dir", ...)`` or ``("ping", "--hold", "0")``; the cluster
        adds how the worker joins the job (coordinator, process id, platform, devices).
      options: the subcommand's further options (``("--steps", "500")``: the launch's
        ``workbench train`` options, ``worker.train_args``).
      files: ``name -> text`` written into ``run_dir`` once it is locked (``config.json``).
      what: what the job does ("train" or "ping"), recorded in the run directory's lock.
      target_steps: the step the job trains to (None for a ping).
      checkpoint_every: the config's checkpoint interval (SLURM warns about a time limit
        shorter than one interval); None for a ping.
      mesh: the config's mesh axes, checked against the devices the cluster gives
        (:func:`check_mesh`); empty for a ping.
    """

    run_dir: Path
    command: tuple[str, ...]
    options: tuple[str, ...] = ()
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    what: str = "train"
    target_steps: int | None = None
    checkpoint_every: int | None = None
    mesh: Mapping[str, int] = dataclasses.field(default_factory=dict)


def check_mesh(mesh: Mapping[str, int], processes: int, devices_per_process: int | None) -> None:
    """Refuses a mesh whose size is not the job's processes x devices per process (the
    workers' ``make_mesh`` needs them equal), before any process starts. Nothing is
    checked when the devices per process are unknown (None)."""
    sizes = list(mesh.values())
    if not devices_per_process or not sizes or \
            not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        return
    have, known = processes * devices_per_process, math.prod(v for v in sizes if v != -1)
    inferred = -1 in sizes
    if (have % known if inferred else known != have) == 0:
        return
    need = (f"needs a multiple of {known} devices (the other axes' product, one axis -1)"
            if inferred else f"needs {known} devices")
    raise ValueError(f"config.mesh {dict(mesh)} {need}, but the launch gives "
                     f"processes={processes} x devices_per_process={devices_per_process} = "
                     f"{have}; launch processes x devices_per_process = {known} devices, or use "
                     f"a mesh of {have} devices (one axis may be -1, e.g. {{'data': -1}})")


@runtime_checkable
class Cluster(Protocol):
    """Where a job's workers run: ``wb.Local``, ``wb.Slurm``, ``wb.Hosts``, ``wb.TPUSlice``.

    The four methods below are the protocol (``isinstance(x, Cluster)`` checks them).
    Every kind also has ``tasks`` (worker processes) and ``devices_per_task`` (devices of
    each, or None), which its ``submit`` checks the config's mesh against
    (:func:`check_mesh`); they are not part of the runtime check, because reading a
    TPU slice's ``tasks`` may ask gcloud.
    """

    def submit(self, submission: Submission) -> Job:
        """Checks what can be checked here, locks ``submission.run_dir``, writes its files,
        starts (or queues) the workers; returns the running :class:`~workbench.jobs.Job`.
        Nothing is written when a check fails."""
        ...

    def remote_command(self, i: int, run_dir: Path, token: str, *, steps: int | None = None,
                       extra: Sequence[str] = (),
                       command: Sequence[str] | None = None) -> str:
        """The shell command worker ``i`` runs (a preview: nothing is started). ``command``:
        the worker subcommand (default: ``train`` into ``run_dir`` with ``steps`` and the
        launch's ``extra`` train options); ``token``: the run directory lock's."""
        ...

    @classmethod
    def recorded(cls, run_dir: Path) -> bool:
        """Whether ``run_dir`` holds a job of this kind (its record file)."""
        ...

    @classmethod
    def attach(cls, run_dir: Path) -> Job:
        """The job of this kind in ``run_dir``, watched again.

        Raises:
          NoJobError: (a FileNotFoundError) no such job is running (or queued) there.
        """
        ...
