"""What a plan reads from its compiled executable (``CompiledNumbers``): the cost
analysis, the while loops' trip counts, the TPU compiler's cycle estimates, the
instructions it left without one and the transfers to host memory, read once from the
program's text when the plan is made, and kept in ``PlanReport.compiled_numbers`` as plain
data (its JSON is ``to_dict()``)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workbench._flops import compiled_cost
from workbench._compiled.loops import compiler_cycles, loop_trip_counts, unestimated_instructions
from workbench.perf._host import HostTraffic, host_traffic

__all__ = ["CompiledNumbers"]


class CompiledNumbers:
    """What a plan reads from its compiled executable, read once when the plan is made
    (its program text printed once): the cost analysis, the while loops' trip counts, the
    TPU compiler's own cycle estimates, the instructions it left without one and the
    transfers to host memory; or given (a report read back from JSON). Plain data: it
    keeps no reference to the executable.

    Args:
        compiled: the ``jax.stages.Compiled`` step, or None when ``values`` are given.
        tpu: whether the TPU compiler compiled it (only its programs carry cycles).
        values: ``to_dict()`` of an earlier instance.

    Attributes:
        cost: per-device ``compiled.cost_analysis()`` (``flops``, ``bytes accessed``, ...).
        loops: ``{loop body: trip count}`` of the program's while loops (scanned layers).
        cycles: ``(cycles, instructions)`` of the TPU compiler's estimates; (0, 0) off TPU.
        unknown: ``(name, bytes, runs per step)`` of each instruction the TPU compiler
            left without a cycle estimate (``unestimated_instructions``); empty off TPU.
        host: what the step moves between device and host memory (activations a remat
            policy offloads), with the schedule around it (``perf._host.host_traffic``);
            empty off TPU.
    """

    def __init__(self, compiled: Any = None, *, tpu: bool = False,
                 values: Mapping[str, Any] | None = None) -> None:
        if values is None:
            values = _read_compiled(compiled, tpu)
        self.cost: dict[str, float] = dict(values["cost"])
        self.loops: dict[str, int] = dict(values["loops"])
        self.cycles: tuple[int, int] = tuple(values["cycles"])
        self.unknown: list[tuple[str, int, int]] = [tuple(u) for u in values.get("unknown", [])]
        host = values.get("host")
        self.host: HostTraffic = host if isinstance(host, HostTraffic) \
            else HostTraffic.from_dict(host)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly values."""
        return {"cost": dict(self.cost), "loops": dict(self.loops),
                "cycles": list(self.cycles), "unknown": [list(u) for u in self.unknown],
                "host": self.host.to_dict()}


def _read_compiled(compiled: Any, tpu: bool) -> dict[str, Any]:
    """``CompiledNumbers``' values read from ``compiled`` (its text printed once)."""
    text = compiled.as_text()
    unknown = [[u.name, u.bytes, u.count] for u in unestimated_instructions(text)] if tpu \
        else []
    return {"cost": compiled_cost(compiled), "loops": loop_trip_counts(text),
            "cycles": compiler_cycles(text) if tpu else (0, 0), "unknown": unknown,
            "host": host_traffic(text) if tpu else HostTraffic()}
