"""Devices: simulated CPU devices, the device inventory, and peak FLOP/s per device."""
from __future__ import annotations

import dataclasses
import os
import platform as _platform
from typing import Any, Sequence

import jax

from workbench.hardware._accelerator import warn_if_unseen
from workbench._display import Displayable
from workbench._validate import check_int
from workbench._xla_flags import COUNT_FLAG as _COUNT_FLAG
from workbench._xla_flags import cpu_device_flags
from workbench.hardware._catalogue import GENERATIONS, GIB, hardware_spec
from workbench.hardware._libtpu import backends_started as _backends_started
from workbench.hardware._libtpu import quiet_libtpu
from workbench.hardware._measure import measured_cpu_peak

__all__ = ["DeviceInfo", "DeviceInventory", "JaxAlreadyStarted", "devices", "peak_flops",
           "simulate_devices"]


def _check_devices(devices: Any) -> list[Any]:
    """``devices`` as a list of JAX devices, or an error naming the argument."""
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"wb.devices: devices={devices!r} is a {type(devices).__name__}; give a "
                        "sequence of JAX devices, e.g. jax.devices()[:4]")
    devs = list(devices)
    bad = [d for d in devs if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(f"wb.devices: devices holds {bad[0]!r} ({type(bad[0]).__name__}), not a "
                        "JAX device; give device objects, e.g. jax.devices()[:4]")
    return devs


class JaxAlreadyStarted(RuntimeError):
    """``wb.simulate_devices(n)`` after JAX started its backends with another device count."""



def simulate_devices(n: int = 8) -> None:
    """Arrange ``n`` simulated CPU devices; call before JAX starts its backends.

    On a laptop this gives a realistic multi-device JAX (each simulated device is a
    separate XLA CPU device sharing the host's cores). On GPU/TPU it only adds CPU
    devices, which JAX does not use by default.

    Where libtpu is installed (for TPU-compiled plans) but no TPU chip is attached, it
    also makes JAX skip its TPU backend (``quiet_libtpu``, as ``wb.devices`` and
    ``wb.make_mesh`` do), so the first ``jax.devices()`` neither loads libtpu nor prints
    its "could not determine TPU accelerator type" warnings. Whether chips are attached is
    JAX's own test (TPU PCI devices, ``/dev/accel*``, ``/dev/vfio``): on a TPU VM the TPU
    backend starts as before.

    Args:
      n: number of CPU devices.

    Raises:
      RuntimeError: JAX already started with a different number of CPU devices.

    Example::

        import workbench as wb
        wb.simulate_devices(8)       # first cell of the notebook
    """
    n = check_int(n, "n", where="wb.simulate_devices: ", fix="the number of CPU devices, e.g. 8")
    if _backends_started():
        have = len(jax.devices("cpu"))
        if have == n:
            return
        raise JaxAlreadyStarted(
            f"wb.simulate_devices(n={n}): JAX already started with {have} CPU device(s), so "
            f"{n} cannot be simulated now. "
            f"Restart the kernel and call wb.simulate_devices({n}) before any JAX computation "
            f"(or set XLA_FLAGS={_COUNT_FLAG}={n} before starting Python)."
        )
    os.environ["XLA_FLAGS"] = cpu_device_flags(os.environ.get("XLA_FLAGS", ""), n)
    jax.config.update("jax_num_cpu_devices", n)
    quiet_libtpu()


def peak_flops(device: Any = None) -> tuple[float, str]:
    """Peak dense bf16 FLOP/s of one device, and where the number comes from.

    Args:
      device: a ``jax.Device``, a device-kind string, or None for ``jax.devices()[0]``.

    Returns:
      ``(flops_per_second, source)``. For CPUs and unknown kinds the number is measured
      (``measured_cpu_peak``) and divided by the number of local CPU devices, since
      simulated devices share the host's cores; the source then starts with "measured".
    """
    if device is None:
        quiet_libtpu()
        device = jax.devices()[0]
    kind = device if isinstance(device, str) else getattr(device, "device_kind", None)
    if not isinstance(kind, str):
        raise TypeError(f"wb.peak_flops: device={device!r} is a {type(device).__name__}; give a "
                        "jax.Device, a device-kind string such as 'TPU v5p', or None for "
                        "jax.devices()[0]")
    spec = hardware_spec(kind)
    if spec is not None:
        return spec.peak_flops, f"table: {spec.source}"
    if isinstance(device, str):
        _check_kind(device)
    n_local = max(1, jax.local_device_count("cpu")) if _backends_started() else 1
    host = measured_cpu_peak()
    return host / n_local, (
        f"measured: float32 1024^3 matmul on this host ({host / 1e9:.1f} GFLOP/s), "
        f"shared by {n_local} CPU device(s)")


def _check_kind(kind: str) -> None:
    """A device-kind string the catalogue lacks must name a local device ("cpu", or an
    unlisted accelerator this process has): else it is a typo, not this host's peak."""
    quiet_libtpu()
    local = {d.device_kind.lower() for d in jax.devices()} | {"cpu"}
    if kind.lower().strip() in local:
        return
    known = ", ".join(g.name for g in GENERATIONS)
    raise ValueError(
        f"wb.peak_flops: device={kind!r} is not a device kind in the catalogue ({known}) "
        f"nor one of this process's devices ({', '.join(sorted(local))}); give one of "
        "them, a jax.Device, or None for jax.devices()[0]")


# ---------------------------------------------------------------------------
# Inventory
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceInfo(Displayable):
    """One device as a user needs to see it.

    Attributes:
      id: JAX device id.
      kind: ``device_kind`` ("cpu", "TPU v5p", "NVIDIA H100 80GB HBM3").
      platform: "cpu", "gpu" or "tpu".
      process_index: the process (host) that owns it.
      coords: physical chip coordinates where the platform has them (TPU), else None.
      core_on_chip: core index on the chip where the platform has it, else None.
      memory_bytes: memory limit in bytes where known, else None.
      host: host name of the owning process when it is this process, else None.
    """

    id: int
    kind: str
    platform: str
    process_index: int
    coords: tuple[int, ...] | None = None
    core_on_chip: int | None = None
    memory_bytes: int | None = None
    host: str | None = None

    @classmethod
    def from_device(cls, d: Any) -> "DeviceInfo":
        memory = None
        try:
            stats = d.memory_stats() if d.process_index == jax.process_index() else None
            if stats and stats.get("bytes_limit"):
                memory = int(stats["bytes_limit"])
        except Exception:  # noqa: BLE001 - CPU devices and some plugins do not implement it
            memory = None
        if memory is None:
            spec = hardware_spec(d.device_kind)
            memory = spec.memory_bytes if spec else None
        coords = getattr(d, "coords", None)
        return cls(
            id=int(d.id), kind=str(d.device_kind), platform=str(d.platform),
            process_index=int(d.process_index),
            coords=tuple(int(c) for c in coords) if coords is not None else None,
            core_on_chip=getattr(d, "core_on_chip", None),
            memory_bytes=memory,
            host=_platform.node() if d.process_index == jax.process_index() else None,
        )


class DeviceInventory(Displayable, tuple):
    """A tuple of ``DeviceInfo`` that prints as a table and shows as a widget."""

    def __str__(self) -> str:
        rows = [("id", "kind", "platform", "process", "coords", "core", "memory")]
        for d in self:
            rows.append((str(d.id), d.kind, d.platform, str(d.process_index),
                         "" if d.coords is None else ",".join(map(str, d.coords)),
                         "" if d.core_on_chip is None else str(d.core_on_chip),
                         "" if d.memory_bytes is None else f"{d.memory_bytes / GIB:.1f} GiB"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        peak, source = peak_flops(self[0].kind) if self else (0.0, "")
        lines.append(f"{len(self)} device(s); peak {peak / 1e12:.3g} TFLOP/s per device ({source})")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def devices(backend: str | None = None, *, devices: Sequence[Any] | None = None) -> DeviceInventory:
    """The device inventory: id, kind, platform, process, coords, core, memory.

    Example::

        wb.show(wb.devices())
    """
    if devices is not None:
        return DeviceInventory(DeviceInfo.from_device(d) for d in _check_devices(devices))
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"wb.devices: backend={backend!r} is a {type(backend).__name__}; give a "
                        "platform name ('cpu', 'gpu', 'tpu') or None for JAX's default")
    quiet_libtpu()
    try:
        devs = jax.devices(backend)
    except RuntimeError as e:
        raise ValueError(f"wb.devices: backend={backend!r} has no devices here ({e}); use one of "
                         f"{sorted({d.platform for d in jax.devices()})} or None") from None
    if backend is None:
        warn_if_unseen({d.platform for d in devs}, "wb.devices")
    return DeviceInventory(DeviceInfo.from_device(d) for d in devs)

