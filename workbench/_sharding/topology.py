"""TPU topologies for planning: the real TPU compiler's devices for slices you do not have.

With the ``libtpu`` wheel installed (``pip install "workbench[tpu-compile]"``), JAX can
describe any TPU slice as compile-only devices, and ``jax.jit(f).lower(...).compile()``
on a mesh of them runs the TPU compiler on this machine, CPU-only laptops included::

    from workbench._sharding.topology import tpu_mesh
    mesh = tpu_mesh(wb.abstract_mesh("v5p-256", data=-1, model=4))   # or None, see below
    compiled = jax.jit(step, in_shardings=...).lower(*shapes).compile()

Nothing here starts a JAX backend: the TPU plugin is loaded on the first request for a
topology, with libtpu's start-up messages (meant for TPU VMs) kept out of the output.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import tempfile
import threading
from typing import Any, Iterator

import numpy as np
from jax.sharding import AxisType, Mesh

from workbench.hardware import _catalogue as catalogue, generation, libtpu_installed, quiet_libtpu
from workbench.hardware._libtpu import tpu_chips_attached
from workbench._sharding.mesh import MeshInfo, mesh_info

__all__ = ["TpuTarget", "topology_name", "tpu_compiler_available", "tpu_devices", "tpu_mesh",
           "tpu_target"]

# libtpu's names for our presets come from the catalogue (``Generation.libtpu``,
# ``topology_name``, ``libtpu_options``); v2/v3 slices have two TensorCores per chip and
# the compile-only topology shows each as a device.
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def tpu_compiler_available() -> bool:
    """True when the TPU compiler (the ``libtpu`` package) can be used for planning.

    Cheap and cached: it only looks for the package on ``sys.path``; it neither imports
    libtpu nor starts a JAX backend.
    """
    return libtpu_installed()


def _libtpu_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return "unknown"


def topology_name(preset: str) -> str:
    """libtpu's topology name for one of our TPU presets, or a topology name as given.

    ``"v5p-256"`` -> ``"v5p:4x4x8"``, ``"v5e-16"`` -> ``"v5e:4x4"``, ``"v6e-8"`` ->
    ``"v6e:2x4"``; ``"v5p:2x2x1"`` is returned as is.

    Raises:
      ValueError: an unknown preset; the message lists the valid ones.
    """
    key = preset.strip()
    if ":" in key:
        return key
    gen = generation(key)
    if gen is None or gen.libtpu is None or key not in gen.slices:
        raise ValueError(
            f"unknown TPU topology {preset!r}; use a preset ({', '.join(_tpu_presets())}) "
            "or a libtpu topology name such as 'v5p:4x4x8', 'v5e:4x4', 'v6e:16x16'")
    return gen.topology_name(key)


def _tpu_presets() -> list[str]:
    """Every TPU slice preset of the catalogue."""
    return [p for g in catalogue.GENERATIONS if g.libtpu for p in g.slices]


def _libtpu_generation(name: str) -> Any:
    """The catalogue entry of a libtpu topology name ("v5e:4x4" -> v5e), or None."""
    gen = name.split(":")[0]
    return next((g for g in catalogue.GENERATIONS if g.libtpu == gen), None)


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Send file descriptor 2 to a temporary file (libtpu writes there from C++)."""
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def _chips_per_host(name: str) -> list[int] | None:
    """Single-chip slices of generations with single-host VMs (v5e/v6e) need a 1x1 host
    (libtpu's default host is 2x2)."""
    gen = _libtpu_generation(name)
    one = re.fullmatch(r"[^:]+:1(x1)*", name)
    return [1, 1, 1] if one and gen is not None and gen.single_host_chips else None


@functools.lru_cache(maxsize=32)
def _topology_devices(name: str, num_slices: int) -> tuple[Any, ...]:
    from jax._src.lib import xla_client
    from jax.experimental import topologies

    kwargs: dict[str, Any] = {}
    if num_slices > 1:
        kwargs["num_slices"] = num_slices
    if (bounds := _chips_per_host(name)) is not None:
        kwargs["chips_per_host_bounds"] = bounds
    gen = _libtpu_generation(name)
    if gen is not None:
        # v4: a chip's two TensorCores run as one JAX device (megacore), as on a real v4
        # VM; libtpu's compile-only default shows each core as a device.
        kwargs.update(gen.libtpu_options)
    with _LOCK:
        if not (xla_client.pjrt_plugin_loaded("tpu")
                and xla_client.pjrt_plugin_initialized("tpu")):
            # libtpu's start-up expects a TPU VM and prints about its absence; that noise is
            # not ours to show. Only the first load is captured; errors are raised below.
            # Without chips nothing needs libtpu's one-process-per-host lock (/tmp/
            # libtpu_lockfile), which would stop a second kernel from planning for TPUs.
            if not tpu_chips_attached():
                os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            with _captured_stderr():
                try:
                    topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
                except Exception:  # noqa: BLE001 - reported by the real call below
                    pass
        return tuple(topologies.get_topology_desc(
            platform="tpu", topology_name=name, **kwargs).devices)


def tpu_devices(preset_or_topology: str, num_slices: int = 1) -> list[Any]:
    """The compile-only TPU devices of a slice (or ``num_slices`` slices over DCN).

    Args:
      preset_or_topology: one of our presets ("v5p-256", "v5e-16") or a libtpu topology
        name ("v5p:4x4x8", "v5e:4x4").
      num_slices: slices joined over the data-center network; their devices carry
        ``slice_index``.

    Returns:
      ``jax.Device`` objects with ``platform == "tpu"``, physical ``coords``, and
      ``device_kind`` ("TPU v5", "TPU v5 lite", ...). They compile, never run.

    Raises:
      RuntimeError: libtpu is not installed.
      ValueError: an unknown preset, or a topology the installed libtpu rejects.

    Example::

        devs = tpu_devices("v5e-16")     # 16 TPU v5 lite devices
    """
    if not tpu_compiler_available():
        raise RuntimeError(
            "the TPU compiler (libtpu) is not installed; install it with "
            "pip install 'workbench[tpu-compile]' to compile plans for TPU slices")
    quiet_libtpu()
    name = topology_name(preset_or_topology)
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    try:
        return list(_topology_devices(name, int(num_slices)))
    except Exception as err:  # noqa: BLE001 - libtpu raises JaxRuntimeError
        raise ValueError(
            f"libtpu {_libtpu_version()} does not accept the TPU topology {name!r} "
            f"(num_slices={num_slices}): {str(err).splitlines()[0]}. Known presets: "
            f"{', '.join(_tpu_presets())}") from err


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuTarget:
    """Where a mesh's plan can be compiled by the TPU compiler, or why not.

    Attributes:
      mesh: a ``jax.sharding.Mesh`` of TPU devices (compile-only for abstract meshes),
        with the MeshInfo's axis names and sizes and Auto axis types; None when the TPU
        compiler cannot compile for this mesh.
      topology: libtpu's topology name ("v5p:4x4x8"), where there is one.
      num_slices: slices over DCN.
      reason: what the mesh is compiled for, or why it cannot be (shown once by plans).
    """

    mesh: Mesh | None
    topology: str | None
    num_slices: int
    reason: str

    def __bool__(self) -> bool:
        return self.mesh is not None


def tpu_target(mesh: Any) -> TpuTarget:
    """The TPU compiler's mesh for ``mesh`` (a MeshInfo or any mesh), with the reason.

    A real TPU mesh is its own target. An abstract mesh of a TPU preset
    (``wb.abstract_mesh("v5p-256", ...)``, multi-slice via ``dcn=``) is laid over the
    topology's compile-only devices with ``mesh_utils``' physical ordering. Anything else
    (CPU/GPU meshes, abstract meshes without a TPU preset, libtpu missing, a topology the
    installed libtpu does not know) gives ``mesh=None`` and says why.
    """
    info = mesh_info(mesh)
    if info.jax_mesh is not None and info.platform == "tpu":
        return TpuTarget(mesh=info.jax_mesh, topology=None, num_slices=info.num_slices,
                         reason="compiled for the TPU devices at hand")
    gen = generation(info.hardware) if info.hardware is not None else None
    if gen is None or gen.libtpu is None:
        what = info.hardware or f"{info.platform} devices"
        return TpuTarget(mesh=None, topology=None, num_slices=1,
                         reason=f"not a TPU slice ({what}); TPU presets: "
                                f"{', '.join(_tpu_presets())}")
    name = topology_name(info.hardware)
    if not tpu_compiler_available():
        return TpuTarget(mesh=None, topology=name, num_slices=info.num_slices, reason=(
            "the TPU compiler (libtpu) is not installed, so numbers are estimates; "
            "pip install 'workbench[tpu-compile]' for TPU-compiled plans"))
    try:
        devs = tpu_devices(info.hardware, info.num_slices)
    except ValueError as err:
        return TpuTarget(mesh=None, topology=name, num_slices=info.num_slices, reason=str(err))
    if len(devs) != info.size:
        return TpuTarget(mesh=None, topology=name, num_slices=info.num_slices, reason=(
            f"libtpu {_libtpu_version()} describes {name} x {info.num_slices} slice(s) as "
            f"{len(devs)} devices ({devs[0].device_kind}, {len(devs) // info.size} per chip: "
            f"no megacore in compile-only topologies), but the mesh has {info.size}; "
            f"use tpu_devices({info.hardware!r}) for a mesh of {len(devs)} TensorCores"))
    grid = _device_grid(info, devs)
    types = (AxisType.Auto,) * len(info.axis_names)
    return TpuTarget(mesh=Mesh(grid, info.axis_names, axis_types=types), topology=name,
                     num_slices=info.num_slices,
                     reason=f"compiled by the TPU compiler (libtpu {_libtpu_version()}) for "
                            f"{name}" + (f" x {info.num_slices} slices" if info.num_slices > 1
                                          else ""))


def _device_grid(info: MeshInfo, devs: list[Any]) -> np.ndarray:
    from jax.experimental import mesh_utils

    if info.num_slices > 1:
        return mesh_utils.create_hybrid_device_mesh(
            list(info.ici_axis_sizes), list(info.dcn_axis_sizes or ()), devs,
            allow_split_physical_axes=True)
    try:
        return mesh_utils.create_device_mesh(list(info.axis_sizes), devs,
                                             allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        # shapes mesh_utils cannot lay onto the torus: chips in coordinate order.
        order = sorted(devs, key=lambda d: (tuple(reversed(d.coords)), d.core_on_chip))
        return np.array(order, dtype=object).reshape(info.axis_sizes)


def tpu_mesh(mesh: Any) -> Mesh | None:
    """A ``jax.sharding.Mesh`` of TPU devices for ``mesh``, or None (see ``tpu_target``
    for the reason).

    Example::

        m = tpu_mesh(wb.abstract_mesh("v5e-4", data=2, model=2))
        if m is not None:
            jax.jit(f, in_shardings=NamedSharding(m, P("data"))).lower(x).compile()
    """
    return tpu_target(mesh).mesh

