"""Devices: simulated CPU devices, the device inventory, and peak FLOP/s per device kind."""
from __future__ import annotations

import dataclasses
import json
import os
import platform as _platform
import re
import time
from pathlib import Path
from typing import Any, Sequence

import jax

from workbench._display import Displayable

__all__ = [
    "DeviceInfo",
    "DeviceInventory",
    "HardwareSpec",
    "devices",
    "hardware_spec",
    "measured_cpu_peak",
    "peak_flops",
    "simulate_devices",
]

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _backends_started() -> bool:
    from jax._src import xla_bridge  # the only reliable way to ask without starting them

    return bool(xla_bridge.backends_are_initialized())


def simulate_devices(n: int = 8) -> None:
    """Arrange ``n`` simulated CPU devices; call before JAX starts its backends.

    On a laptop this gives a realistic multi-device JAX (each simulated device is a
    separate XLA CPU device sharing the host's cores). On GPU/TPU it only adds CPU
    devices, which JAX does not use by default.

    Args:
      n: number of CPU devices.

    Raises:
      RuntimeError: JAX already started with a different number of CPU devices.

    Example::

        import workbench as wb
        wb.simulate_devices(8)       # first cell of the notebook
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate_devices(n) needs a positive int, got {n!r}")
    if _backends_started():
        have = len(jax.devices("cpu"))
        if have == n:
            return
        raise RuntimeError(
            f"JAX already started with {have} CPU device(s), so {n} cannot be simulated now. "
            f"Restart the kernel and call wb.simulate_devices({n}) before any JAX computation "
            f"(or set XLA_FLAGS={_COUNT_FLAG}={n} before starting Python)."
        )
    flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()
    jax.config.update("jax_num_cpu_devices", n)


# ---------------------------------------------------------------------------
# Peak FLOP/s and memory by device kind
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """Published numbers for one device kind, per JAX device.

    Attributes:
      name: short name ("TPU v5p", "H100 SXM").
      peak_flops: dense bf16 FLOP/s per JAX device (a TPU v2/v3 device is one core).
      memory_bytes: HBM per JAX device.
      source: where the numbers come from.
      platform: "tpu" or "gpu".
      cores_per_chip: JAX devices per chip (2 on TPU v2/v3, else 1).
      chips_per_host: chips attached to one host in the usual VM/server shape.
      topology_dims: 2 (v2/v3/v5e/v6e tori) or 3 (v4/v5p).
    """

    name: str
    peak_flops: float
    memory_bytes: int
    source: str
    platform: str
    cores_per_chip: int = 1
    chips_per_host: int = 4
    topology_dims: int = 2


_GIB = 1024**3
_GB = 1000**3
_TPU_DOC = "Google Cloud TPU system architecture docs"
# Order matters: the first pattern that matches a JAX device_kind wins.
_HARDWARE: list[tuple[str, HardwareSpec]] = [
    (r"v2", HardwareSpec(name="TPU v2", peak_flops=45e12 / 2, memory_bytes=8 * _GIB,
                         source=f"{_TPU_DOC}: 45 TFLOP/s bf16 and 16 GiB per chip, 2 cores",
                         platform="tpu", cores_per_chip=2)),
    (r"v3", HardwareSpec(name="TPU v3", peak_flops=123e12 / 2, memory_bytes=16 * _GIB,
                         source=f"{_TPU_DOC}: 123 TFLOP/s bf16 and 32 GiB per chip, 2 cores",
                         platform="tpu", cores_per_chip=2)),
    (r"v4", HardwareSpec(name="TPU v4", peak_flops=275e12, memory_bytes=32 * _GIB,
                         source=f"{_TPU_DOC}: 275 TFLOP/s bf16, 32 GiB per chip (megacore)",
                         platform="tpu", topology_dims=3)),
    (r"v5 ?lite|v5e", HardwareSpec(name="TPU v5e", peak_flops=197e12, memory_bytes=16 * _GIB,
                                   source=f"{_TPU_DOC}: 197 TFLOP/s bf16, 16 GiB per chip",
                                   platform="tpu")),
    (r"v5p|v5$", HardwareSpec(name="TPU v5p", peak_flops=459e12, memory_bytes=95 * _GIB,
                              source=f"{_TPU_DOC}: 459 TFLOP/s bf16, 95 GiB per chip (megacore)",
                              platform="tpu", topology_dims=3)),
    (r"v6 ?lite|v6e", HardwareSpec(name="TPU v6e", peak_flops=918e12, memory_bytes=32 * _GIB,
                                   source=f"{_TPU_DOC}: 918 TFLOP/s bf16, 32 GiB per chip",
                                   platform="tpu")),
    (r"a100.*80", HardwareSpec(name="A100 80GB", peak_flops=312e12, memory_bytes=80 * _GB,
                               source="NVIDIA A100 datasheet: 312 TFLOP/s dense bf16",
                               platform="gpu", chips_per_host=8)),
    (r"a100", HardwareSpec(name="A100 40GB", peak_flops=312e12, memory_bytes=40 * _GB,
                           source="NVIDIA A100 datasheet: 312 TFLOP/s dense bf16",
                           platform="gpu", chips_per_host=8)),
    (r"h100.*nvl", HardwareSpec(name="H100 NVL", peak_flops=835e12, memory_bytes=94 * _GB,
                                source="NVIDIA H100 datasheet: 1671 TFLOP/s bf16 with "
                                "sparsity, so 835 dense", platform="gpu", chips_per_host=8)),
    (r"h100.*pcie", HardwareSpec(name="H100 PCIe", peak_flops=756e12, memory_bytes=80 * _GB,
                                 source="NVIDIA H100 datasheet: 1513 TFLOP/s bf16 with "
                                 "sparsity, so 756 dense", platform="gpu", chips_per_host=8)),
    (r"h100", HardwareSpec(name="H100 SXM", peak_flops=989e12, memory_bytes=80 * _GB,
                           source="NVIDIA H100 datasheet: 1979 TFLOP/s bf16 with sparsity, "
                           "so 989 dense", platform="gpu", chips_per_host=8)),
    (r"h200", HardwareSpec(name="H200", peak_flops=989e12, memory_bytes=141 * _GB,
                           source="NVIDIA H200 datasheet: 1979 TFLOP/s bf16 with sparsity, "
                           "so 989 dense; 141 GB HBM3e", platform="gpu", chips_per_host=8)),
    (r"b200", HardwareSpec(name="B200", peak_flops=2250e12, memory_bytes=180 * _GB,
                           source="NVIDIA DGX B200 datasheet: 72 PFLOP/s fp8 training per 8 "
                           "GPUs, so 2.25 PFLOP/s dense bf16 per GPU; 180 GB",
                           platform="gpu", chips_per_host=8)),
]


def hardware_spec(device_kind: str) -> HardwareSpec | None:
    """The published numbers for a JAX ``device_kind`` (or a short name), or None."""
    kind = device_kind.lower().strip()
    for pattern, spec in _HARDWARE:
        if re.search(pattern, kind):
            return spec
    return None


def _cache_dir() -> Path:
    root = os.environ.get("WORKBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "workbench")
    return Path(root)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def measured_cpu_peak(*, refresh: bool = False, size: int = 1024) -> float:
    """The host's measured matmul FLOP/s (float32), cached per machine.

    A ``size``-cubed float32 matmul on one CPU device is timed (best of 5 after a
    warm-up); XLA's CPU matmul uses every core, so this is the whole host's peak. The
    result is cached in ``~/.cache/workbench/cpu_peak.json`` keyed by host, CPU model,
    core count and JAX version.
    """
    key = f"{_platform.node()}|{_cpu_name()}|{os.cpu_count()}|{jax.__version__}|{size}"
    path = _cache_dir() / "cpu_peak.json"
    if not refresh:
        try:
            cached = json.loads(path.read_text())
            if key in cached:
                return float(cached[key])
        except (OSError, ValueError):
            pass
    import numpy as np

    dev = jax.devices("cpu")[0]
    a = jax.device_put(np.ones((size, size), np.float32), dev)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    peak = 2 * size**3 / best
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cached = json.loads(path.read_text()) if path.exists() else {}
        cached[key] = peak
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass
    return peak


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
        device = jax.devices()[0]
    kind = device if isinstance(device, str) else device.device_kind
    spec = hardware_spec(kind)
    if spec is not None:
        return spec.peak_flops, f"table: {spec.source}"
    n_local = max(1, jax.local_device_count("cpu")) if _backends_started() else 1
    host = measured_cpu_peak()
    return host / n_local, (
        f"measured: float32 1024^3 matmul on this host ({host / 1e9:.1f} GFLOP/s), "
        f"shared by {n_local} CPU device(s)")


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

    _view = "devices_view:devices_widget"

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

    _view = "devices_view:devices_widget"

    def __str__(self) -> str:
        rows = [("id", "kind", "platform", "process", "coords", "core", "memory")]
        for d in self:
            rows.append((str(d.id), d.kind, d.platform, str(d.process_index),
                         "" if d.coords is None else ",".join(map(str, d.coords)),
                         "" if d.core_on_chip is None else str(d.core_on_chip),
                         "" if d.memory_bytes is None else f"{d.memory_bytes / _GIB:.1f} GiB"))
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
    devs = list(devices) if devices is not None else jax.devices(backend)
    return DeviceInventory(DeviceInfo.from_device(d) for d in devs)

