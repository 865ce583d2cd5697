"""The host's cores as a profile sees them: how busy other processes kept them while a
trace ran (``HostLoad``, from ``/proc/stat``), and the cores this process's CPU devices share."""
from __future__ import annotations

import os
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jax
import numpy as np

from workbench.perf._shared_cores import host_core_ids, host_cores


def busy_core_seconds(stat: str, cores: Collection[int] | None) -> float | None:
    """Busy core-seconds since boot from the text of ``/proc/stat``: of the cores in
    ``cores`` (their ``cpuN`` lines), or of the whole machine (the ``cpu`` line) where
    ``cores`` is None. Idle and iowait are not busy. None where a core's line is missing."""
    rows = {}
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu"):
            rows[name] = [int(x) for x in rest.split()[:8]]
    names = ["cpu"] if cores is None else [f"cpu{c}" for c in cores]
    if not names or any(n not in rows or len(rows[n]) < 5 for n in names):
        return None
    ticks = sum(sum(v) - v[3] - v[4] for v in (rows[n] for n in names))
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_times() -> tuple[float, float, float] | None:
    """(wall seconds, busy core-seconds of the cores this process may run on, from
    ``/proc/stat``, this process's CPU seconds); None where there is no ``/proc/stat``.
    Only those cores: a process bound to some of the machine's (``taskset``, a cgroup
    cpuset, a SLURM task with core binding) shares only them, and counting the others'
    load as taken from it made its own step look shorter than it was, even negative."""
    try:
        stat = Path("/proc/stat").read_text()
        busy = busy_core_seconds(stat, host_core_ids())
        if busy is None:   # a core without its own line: the whole machine's
            busy = busy_core_seconds(stat, None)
    except (OSError, ValueError):
        return None
    if busy is None:
        return None
    return time.perf_counter(), busy, time.process_time()


class HostLoad:
    """Cores other processes kept busy while the block ran (``with HostLoad() as load:``,
    then ``load.others``): the busy cores of those this process may run on (``load.busy``,
    from ``/proc/stat``) less this process's (``load.own``, its CPU time), averaged over
    the wall time. All 0.0 where the kernel does not say."""

    others: float = 0.0
    busy: float = 0.0
    own: float = 0.0

    def __enter__(self) -> HostLoad:
        self._t0 = _cpu_times()
        return self

    def __exit__(self, *exc: Any) -> None:
        t1 = _cpu_times()
        if self._t0 is not None and t1 is not None and t1[0] > self._t0[0]:
            wall = t1[0] - self._t0[0]
            self.busy = (t1[1] - self._t0[1]) / wall
            self.own = (t1[2] - self._t0[2]) / wall
            self.others = max(0.0, self.busy - self.own)


def available_cores(cores_total: float, per_process: float, load: HostLoad) -> float:
    """Cores the traced steps had: the host's less what other processes used (on CPU,
    the run's other processes on this host included), at most this process's share."""
    return min(per_process, max(0.05 * per_process, cores_total - load.others))


def shared_cores() -> float:
    """The host cores this process's CPU devices get: its cores (affinity) divided among
    the processes of the run on this host (2 processes over gloo on one machine share
    it); on GPUs and TPUs, unused. Every process must call it (it gathers host names)."""
    cores = float(host_cores())
    if jax.process_count() == 1 or jax.devices()[0].platform != "cpu":
        return cores
    import hashlib
    import socket

    from jax.experimental import multihost_utils

    me = int.from_bytes(hashlib.sha1(socket.gethostname().encode()).digest()[:3], "little")
    hosts = np.asarray(multihost_utils.process_allgather(np.array(me, np.int32)))
    return cores / max(1, int((hosts == me).sum()))
