"""Joining a multi-process JAX job: loopback launches, SLURM, TPU pods (jax.distributed).

Every worker of a job (started by :func:`workbench.jobs`, by ``srun``, or by
``gcloud ... ssh --worker=all``) calls :func:`initialize` once, before anything
touches a JAX backend. Three cases:

* explicit: a coordinator address, the process count and this process's id are given
  (the local launcher passes them). On CPU the processes talk through the gloo
  collectives and each gets ``devices_per_process`` simulated devices.
* a cluster JAX knows (SLURM, Open MPI, Cloud TPU pod, Kubernetes): plain
  ``jax.distributed.initialize()`` reads everything from the environment.
* neither: one process, no ``jax.distributed``.

The heartbeat and shutdown timeouts are short enough that when one process dies the
others notice it and exit instead of waiting forever in a collective. Joining itself is
bounded (``initialization_timeout``): the wait is shown and ended by
:mod:`workbench.jobs._joining`, since JAX's own timeout aborts the process from C++.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Literal

from workbench._validate import check_int
from workbench.jobs import _joining as joining

__all__ = ["LOCAL_HEARTBEAT_S", "DistributedSpec", "detect_cluster", "initialize", "validate"]

LOCAL_HEARTBEAT_S = 15  # loopback: a dead process is noticed within ~15 s
CLUSTER_HEARTBEAT_S = 60  # across hosts: tolerate short network hiccups


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedSpec:
    """How one worker joins its job.

    Attributes:
      mode: "auto" (explicit values if given, else a detected cluster, else one
        process), "on" (always call ``jax.distributed.initialize``) or "off".
      coordinator: "host:port" of process 0's coordinator service.
      num_processes: processes in the job.
      process_id: this process's index (0 is the coordinator and writes metrics).
      platform: "cpu", "gpu", "tpu" or None (JAX's default).
      devices_per_process: on CPU the number of simulated devices of this process; on
        GPU the number of GPUs each process of a one-host launch takes (process ``i``
        gets GPUs ``i*M .. i*M+M-1``). Ignored on TPU.
      heartbeat_timeout: seconds without a heartbeat after which a process counts as dead.
      shutdown_timeout: seconds the final shutdown barrier waits for the others.
      bind_address: where process 0's coordinator listens (default: the coordinator's
        own address for loopback launches, every interface otherwise).
      initialization_timeout: seconds to wait for every process to join (default 300,
        JAX's); then the process says what to check and exits with status 69.
    """

    mode: Literal["auto", "on", "off"] = "auto"
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    platform: str | None = None
    devices_per_process: int | None = None
    heartbeat_timeout: int | None = None
    shutdown_timeout: int = 60
    bind_address: str | None = None
    initialization_timeout: int = joining.DEFAULT_INITIALIZATION_TIMEOUT

    @property
    def explicit(self) -> bool:
        """True when coordinator, process count and id were all given."""
        return None not in (self.coordinator, self.num_processes, self.process_id)


def detect_cluster() -> str | None:
    """The cluster environment ``jax.distributed.initialize()`` would detect, or None.

    Asks JAX's own detectors (SLURM, Open MPI, Cloud TPU VM pods, GKE/Kubernetes),
    skipping the opt-in ones (mpi4py), so detection never differs from JAX's.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    try:
        from jax._src import clusters  # JAX's detector registry (no public equivalent)
    except ImportError:  # pragma: no cover - layout of a future JAX
        return None
    for env in getattr(clusters.ClusterEnv, "_cluster_types", []):
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            present = env.is_env_present()
        except Exception:  # noqa: BLE001 - a detector that cannot run is not present
            present = False
        if present:
            return env.__name__
    return None


def _set_cpu_devices(n: int) -> None:
    """``n`` simulated CPU devices for this process (before the backends start)."""
    import jax

    from workbench._xla_flags import cpu_device_flags

    os.environ["XLA_FLAGS"] = cpu_device_flags(os.environ.get("XLA_FLAGS", ""), n)
    jax.config.update("jax_num_cpu_devices", n)


def validate(spec: DistributedSpec) -> None:
    """Raises ValueError naming what is inconsistent in ``spec`` and how to fix it."""
    if spec.mode not in ("auto", "on", "off"):
        raise ValueError(f"distributed mode {spec.mode!r} is not one of 'auto', 'on', 'off'")
    given = {k: getattr(spec, k) for k in ("coordinator", "num_processes", "process_id")}
    if any(v is not None for v in given.values()) and not spec.explicit:
        missing = [k for k, v in given.items() if v is None]
        raise ValueError(f"a multi-process launch needs coordinator, num_processes and "
                         f"process_id together; got {given}; also pass {missing} "
                         "(or none of them to let jax.distributed detect the cluster)")
    for name in ("coordinator", "bind_address"):
        if getattr(spec, name) is not None:
            joining.parse_address(getattr(spec, name), name)
    check_int(spec.initialization_timeout, "initialization_timeout",
              fix="the seconds to wait for every process to join (default 300)")
    if spec.explicit:
        n, i = spec.num_processes, spec.process_id
        assert n is not None and i is not None
        if n < 1 or not 0 <= i < n:
            raise ValueError(f"process_id={i} must lie in [0, num_processes={n}) "
                             "and num_processes must be >= 1")
    if spec.devices_per_process is not None and spec.devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {spec.devices_per_process}")


def initialize(spec: DistributedSpec, *,
               on_timeout: Callable[[int], None] | None = None) -> str:
    """Configures JAX for this worker and joins the job; call before any JAX computation.

    A CPU worker of a multi-process job returns with JAX's backend started, its gloo
    network thread under the threads that compute (:func:`_lower_gloo_thread_priority`).

    Args:
      spec: how to join (see :class:`DistributedSpec`).
      on_timeout: called with the exit status when joining gives up, just before the
        process exits (:mod:`workbench.jobs._joining`).

    Returns:
      How the process joined: "single", "explicit" or the detected cluster's name.

    Raises:
      ValueError: inconsistent arguments (named in the message).
      RuntimeError: JAX already started its backends (too late to configure them).
    """
    validate(spec)
    gloo_nice = _gloo_nice()   # a bad WORKBENCH_GLOO_NICE fails here, before joining
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("JAX already started its backends in this process, so it cannot "
                           "join a multi-process job any more; call workbench.jobs._cluster."
                           "initialize() first thing in the worker")
    platform = spec.platform or os.environ.get("JAX_PLATFORMS", "").split(",")[0] or None
    if platform:
        jax.config.update("jax_platforms", platform)
    else:   # JAX's choice, without libtpu's probe where no TPU chip is attached
        from workbench.hardware._libtpu import quiet_libtpu

        quiet_libtpu()
    if platform == "cpu" and spec.devices_per_process:
        _set_cpu_devices(spec.devices_per_process)

    cluster = None if spec.explicit else detect_cluster()
    if spec.mode == "off" or (spec.mode == "auto" and not spec.explicit and cluster is None):
        return "single"
    if platform == "cpu":
        # XLA:CPU has no cross-process collectives of its own; gloo runs them over TCP.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = _initialize_kwargs(spec, platform, cluster)
    address = spec.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if address is not None and spec.coordinator is None:
        joining.parse_address(address, "JAX_COORDINATOR_ADDRESS")
    with joining.watch(address, spec.process_id, spec.num_processes,
                       spec.initialization_timeout, where=cluster or "explicit",
                       on_timeout=on_timeout):
        jax.distributed.initialize(**kwargs)  # type: ignore[arg-type]
    if platform == "cpu":
        jax.devices()   # starts the backend, and with it gloo's network thread
        _lower_gloo_thread_priority(gloo_nice)
    return "explicit" if spec.explicit else (cluster or "jax.distributed")


def _initialize_kwargs(spec: DistributedSpec, platform: str | None,
                       cluster: str | None) -> dict[str, object]:
    """The arguments of ``jax.distributed.initialize`` for ``spec`` (JAX's timeout is the
    bound plus a margin, so the watchdog of :mod:`workbench.jobs._joining` ends the wait)."""
    heartbeat = spec.heartbeat_timeout or (LOCAL_HEARTBEAT_S if spec.explicit
                                           else CLUSTER_HEARTBEAT_S)
    kwargs: dict[str, object] = {
        "heartbeat_timeout_seconds": heartbeat, "shutdown_timeout_seconds": spec.shutdown_timeout,
        "initialization_timeout": spec.initialization_timeout + joining.JAX_MARGIN_S}
    if spec.explicit:
        assert spec.coordinator is not None
        kwargs.update(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                      process_id=spec.process_id,
                      coordinator_bind_address=spec.bind_address or _loopback_bind(spec))
        if platform in ("gpu", "cuda", "rocm") and spec.devices_per_process:
            kwargs["local_device_ids"] = _gpu_ids(spec)
    elif cluster == "SlurmCluster" and platform in ("gpu", "cuda", "rocm") \
            and spec.devices_per_process:
        # JAX's SLURM detection gives each task one GPU ([SLURM_LOCALID]); a task that
        # drives M GPUs of its node takes GPUs localid*M .. localid*M+M-1.
        m, local = spec.devices_per_process, int(os.environ.get("SLURM_LOCALID", "0"))
        kwargs["local_device_ids"] = list(range(local * m, (local + 1) * m))
    return kwargs


#: What gloo's network thread is doing whenever it is idle: ``epoll_wait(epfd, events,
#: 64, 10)``: 64 events, a 10 ms tick (gloo/transport/tcp/loop.cc), as the kernel shows
#: it in /proc/<pid>/task/<tid>/syscall: the call's number (epoll_wait or epoll_pwait on
#: x86-64, epoll_pwait on arm64, which has no epoll_wait), then its arguments in hex.
_GLOO_WAIT_CALLS = {"x86_64": ("232", "281"), "aarch64": ("22",)}
_GLOO_WAIT_ARGS = ("0x40", "0xa")
#: The nice value gloo's network thread gets (19: the lowest priority above SCHED_IDLE),
#: unless the environment variable of this name says another (0 leaves it as it was).
GLOO_THREAD_NICE = 19
GLOO_NICE_ENV = "WORKBENCH_GLOO_NICE"


def _gloo_nice() -> int:
    raw = os.environ.get(GLOO_NICE_ENV, str(GLOO_THREAD_NICE))
    try:
        nice = int(raw)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"{GLOO_NICE_ENV}={raw!r}: give the nice value of gloo's network "
                         f"thread, an integer from 0 (as it was) to 19 (the default)")
    return nice


def _gloo_loop_threads(pid: int | str = "self") -> list[int]:
    """The threads of process ``pid`` that the kernel shows waiting like gloo's network
    thread ([] off Linux, or on another machine type)."""
    import platform

    calls, task = _GLOO_WAIT_CALLS.get(platform.machine(), ()), f"/proc/{pid}/task"
    if not calls or not os.path.isdir(task):
        return []
    found = []
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/syscall", encoding="ascii") as f:
                call = f.read().split()
        except OSError:   # the thread ended
            continue
        if call[:1] and call[0] in calls and tuple(call[3:5]) == _GLOO_WAIT_ARGS:
            found.append(int(tid))
    return found


def _lower_gloo_thread_priority(nice: int, *, tries: int = 20) -> list[int]:
    """Runs gloo's network thread (the CPU collectives' TCP loop) at ``nice`` (19 unless
    ``WORKBENCH_GLOO_NICE`` says another), under the threads that compute.

    Why: a gloo message that arrives before this process has posted the buffer it goes
    to (this process is still computing, or compiling, a step behind its peer) is left
    on the socket for the loop's next turn, and the loop's level-triggered
    ``epoll_wait`` returns at once for it again: the thread spins until the compute
    thread catches up, and takes the CPU that compute thread needs. Where the processes
    of a job share cores (a laptop, a test machine) that was a fifth of a job's CPU:
    2 processes x 4 devices of tiny on one core, 30 steps, 58-68 s with the spin and
    41-53 s at nice 19, interleaved. At nice 19 the loop still runs whenever nothing
    else of higher priority does, which is when a collective waits for it, and on idle
    cores it runs as before. Only the priority changes: every collective moves the same
    bytes in the same order, so results are bitwise the same.

    Linux only (``/proc/self/task``); elsewhere, or when no thread of this process waits
    like gloo's loop (another gloo version), nothing changes. ``nice=0`` changes nothing.

    Returns:
      The thread ids lowered (one per process: gloo's TCP loop; [] when none was found).
    """
    import time

    for attempt in range(tries if nice else 0):
        found = []
        for tid in _gloo_loop_threads():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:   # the thread ended
                continue
            found.append(tid)
        if found:
            return found
        if attempt + 1 < tries:   # caught between two ticks of its loop: look again
            time.sleep(0.005)
    return []


def _loopback_bind(spec: DistributedSpec) -> str | None:
    """Binds a loopback coordinator to loopback only (never every interface)."""
    assert spec.coordinator is not None
    host = spec.coordinator.rpartition(":")[0]
    return spec.coordinator if host in ("127.0.0.1", "localhost", "[::1]") else None


def _gpu_ids(spec: DistributedSpec) -> Sequence[int]:
    m, i = spec.devices_per_process, spec.process_id
    assert m is not None and i is not None
    return list(range(i * m, (i + 1) * m))
