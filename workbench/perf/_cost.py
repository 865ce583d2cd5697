"""``StepCost``: the numbers one step's prediction needs (its FLOPs, HBM bytes and
collectives per device, on its mesh, with where each comes from), the one argument of
``perf.predict`` beside the hardware spec. ``perf.predict_plan`` makes it from a plan's
report; a caller with a compiled program of its own fills it by hand."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from workbench._compiled.hlo import Collective
from workbench._sharding.mesh import MeshInfo, mesh_info
from workbench._validate import check_bool, check_float, check_int, check_str
from workbench.perf._host import HostTime

__all__ = ["StepCost"]

_WHERE = "StepCost: "


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCost:
    """What one training step costs on one device, as a roofline reads it.

    Example::

        ca = compiled.cost_analysis()
        cost = StepCost(flops=ca["flops"], bytes_accessed=ca["bytes accessed"],
                        collectives=parse_collectives(compiled.as_text(), names, sizes),
                        mesh=mesh, tokens_per_step=batch * seq, model_flops=model_flops)
        perf.predict(cost, wb.hardware.effective_spec(mesh_info(mesh), calibration=False))

    Attributes:
      flops: FLOPs per device per step (the compiler's ``cost_analysis()["flops"]``, or an
        analytic count divided by devices).
      bytes_accessed: HBM bytes read + written per device per step
        (``cost_analysis()["bytes accessed"]``).
      mesh: the mesh (``MeshInfo``, ``Mesh`` or ``AbstractMesh``; held as its
        ``MeshInfo``): its coords, hosts and DCN axes decide which links each collective
        uses.
      collectives: the step's collectives (``workbench._compiled.hlo.parse_collectives``).
      tokens_per_step: global batch x sequence length, for tokens/s; None: no tokens/s.
      model_flops: analytic model FLOPs per step (all devices, no rematerialization) for
        MFU; None: no MFU.
      fp8_flops: the part of ``flops`` (per device) that runs in fp8 matmuls, timed at the
        chip's fp8 peak (the bf16 one where the table has none); MFU is then given against
        both peaks.
      compiler_seconds: the TPU compiler's estimate (``optimal_seconds``), carried beside
        ours; a negative one is the compiler's "unknown" and is not shown.
      compute_seconds: the local work timed by the compiler itself (TPU cycle estimates at
        the chip's clock, or a GPU's measured efficiencies): replaces the roofline's
        ``max(compute, memory)``; ``compute_source`` says where it comes from.
      exposed_axes: mesh axes whose collectives are never hidden behind compute (tensor
        parallel: the next matmul waits for them).
      sync_exposed: the collectives say whether the compiled program runs them
        asynchronously (``Collective.overlapped``): the synchronous ones count in full.
      host: the step's host transfers, timed (``workbench.perf._host.host_seconds``);
        None: nothing moves to host memory (``host_source`` says why when not timed).
      flops_source, bytes_source: where ``flops`` and ``bytes_accessed`` come from.
    """

    flops: float
    bytes_accessed: float
    mesh: Any
    collectives: Sequence[Collective] = ()
    tokens_per_step: int | None = None
    model_flops: float | None = None
    fp8_flops: float = 0.0
    compiler_seconds: float | None = None
    compute_seconds: float | None = None
    compute_source: str = ""
    exposed_axes: tuple[str, ...] = ()
    sync_exposed: bool = False
    host: HostTime | None = None
    host_source: str = ""
    flops_source: str = "compiled cost analysis"
    bytes_source: str = "compiled cost analysis"

    def __post_init__(self) -> None:
        for name in ("flops", "bytes_accessed", "fp8_flops"):
            check_float(getattr(self, name), name, minimum=0.0, where=_WHERE)
        for name in ("model_flops", "compute_seconds"):
            if getattr(self, name) is not None:
                check_float(getattr(self, name), name, minimum=0.0, where=_WHERE)
        if self.tokens_per_step is not None:
            check_int(self.tokens_per_step, "tokens_per_step", where=_WHERE)
        seconds = self.compiler_seconds
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(
                seconds, (int, float)) or math.isinf(seconds)):
            raise TypeError(f"{_WHERE}compiler_seconds={seconds!r} is not a number; give the "
                            "compiler's optimal_seconds (a float, negative for its "
                            "'unknown') or None")
        check_bool(self.sync_exposed, "sync_exposed", where=_WHERE)
        for name in ("compute_source", "host_source", "flops_source", "bytes_source"):
            check_str(getattr(self, name), name, where=_WHERE, empty=True)
        object.__setattr__(self, "mesh", _mesh(self.mesh))
        object.__setattr__(self, "collectives", _collectives(self.collectives))
        object.__setattr__(self, "exposed_axes", _axes(self.exposed_axes, self.mesh))
        if self.host is not None and not isinstance(self.host, HostTime):
            raise TypeError(f"{_WHERE}host={self.host!r:.80} is a {type(self.host).__name__}, "
                            "not a HostTime; give workbench.perf._host.host_seconds(...) or "
                            "None")


def _mesh(mesh: Any) -> MeshInfo:
    try:
        return mesh_info(mesh)
    except TypeError:
        raise TypeError(f"{_WHERE}mesh={mesh!r:.80} is a {type(mesh).__name__}, not a mesh; "
                        "give wb.make_mesh(...), wb.abstract_mesh(...) or plan.mesh") from None


def _collectives(collectives: Any) -> tuple[Collective, ...]:
    if isinstance(collectives, (str, bytes, Collective)) or not isinstance(
            collectives, Sequence):
        raise TypeError(f"{_WHERE}collectives={collectives!r:.80} is a "
                        f"{type(collectives).__name__}; give a list of Collective records "
                        "(hlo.parse_collectives, plan.collectives), [] for none")
    bad = [c for c in collectives if not isinstance(c, Collective)]
    if bad:
        raise TypeError(f"{_WHERE}collectives holds {bad[0]!r:.80} ({type(bad[0]).__name__}), "
                        "not a Collective; give hlo.parse_collectives(...)'s records")
    return tuple(collectives)


def _axes(axes: Any, mesh: MeshInfo) -> tuple[str, ...]:
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise TypeError(f"{_WHERE}exposed_axes={axes!r:.80} is a {type(axes).__name__}; give "
                        f"a tuple of mesh axis names, e.g. ('model',), () for none")
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"{_WHERE}exposed_axes names {unknown[0]!r}, not an axis of the mesh "
                         f"{tuple(mesh.axis_names)}; give some of its axes, () for none")
    return tuple(axes)
