"""libtpu, the TPU compiler installed for planning: whether it is there, whether TPU chips
are attached, and ``quiet_libtpu()``, the explicit call that keeps it quiet where no TPU is.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import os
from typing import Any

__all__ = ["libtpu_installed", "quiet_libtpu", "tpu_chips_attached"]


@functools.lru_cache(maxsize=1)
def libtpu_installed() -> bool:
    """True when the ``libtpu`` package is importable; nothing is imported or started."""
    try:
        return importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        return False


def tpu_chips_attached() -> bool:
    """JAX's own test for a Cloud TPU host (TPU PCI devices), plus TPU device files."""
    from jax._src import hardware_utils

    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0


def backends_started() -> bool:
    """Whether JAX has started its backends (asked without starting them)."""
    from jax._src import xla_bridge  # the only reliable way to ask without starting them

    return bool(xla_bridge.backends_are_initialized())


def quiet_libtpu() -> bool:
    """Skip JAX's TPU backend on hosts without TPU chips when libtpu is installed.

    libtpu is installed for TPU-compiled plans (``workbench[tpu-compile]``). JAX then
    tries to start a TPU backend on every host at the first ``jax.devices()``: on a
    host without TPU chips it loads the 700 MB library, prints "could not determine TPU
    accelerator type" and fails (quietly), then falls back to CPU/GPU. This wraps JAX's
    TPU backend factory so that, where no TPU chip is attached (JAX's own PCI test),
    it fails at once instead, with the reason.

    Nothing does this at import: the entry points that start JAX's backends or load the
    TPU compiler call it (``wb.simulate_devices``, ``wb.devices``, ``wb.make_mesh``, the
    CLI's and launched workers' ``jobs.cluster.initialize`` when no platform is given,
    the compile-only TPU devices of ``workbench._sharding.topology``). Idempotent. On TPU
    hosts nothing changes; nothing is done when libtpu is not installed, when JAX's
    backends have already started, or when ``JAX_FORCE_TPU_INIT`` is set.

    Returns:
        True when JAX's TPU backend factory is (now, or already) the quiet one.
    """
    if not libtpu_installed() or os.environ.get("JAX_FORCE_TPU_INIT") or backends_started():
        return False
    from jax._src import xla_bridge

    registration = xla_bridge._backend_factories.get("tpu")
    if registration is None:
        return False
    if getattr(registration.factory, "_workbench_quiet", False):
        return True
    factory = registration.factory

    def tpu_factory() -> Any:
        if not tpu_chips_attached():
            raise RuntimeError("no TPU chip is attached to this host; workbench skipped "
                               "loading libtpu (set JAX_FORCE_TPU_INIT=1 to try anyway)")
        return factory()

    tpu_factory._workbench_quiet = True  # type: ignore[attr-defined]
    xla_bridge._backend_factories["tpu"] = dataclasses.replace(registration, factory=tpu_factory)
    return True
