"""The one effective hardware spec a prediction uses: the catalogue's entry (or, for CPU
devices, the one measured on this machine), then a calibration's achieved rates, with
where each number came from. Resolved here and passed explicitly to
``workbench.perf._predict``, which reads nothing from disk itself.

Usage::

    spec = wb.hardware.effective_spec(plan.mesh)          # + the stored calibration, if any
    spec = wb.hardware.effective_spec(plan.mesh, calibration=False)   # the catalogue alone
    print(spec)                                           # every number and its source
"""
from __future__ import annotations

import dataclasses
from typing import Any

from workbench.hardware._calibration import Calibration, load_calibration
from workbench.hardware._catalogue import HardwareSpec, hardware_spec
from workbench.hardware._efficiency import Efficiency, efficiency_origin, measured_efficiency
from workbench.hardware._measure import cpu_spec

__all__ = ["EffectiveSpec", "effective_spec"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EffectiveSpec:
    """The hardware numbers of one prediction, and where each comes from.

    Attributes:
      spec: the numbers the roofline divides by: ``table`` with the calibration's achieved
        FLOP/s and HBM bandwidth (``Calibration.apply_spec``), or ``table`` itself.
      table: the entry before calibration: the catalogue's (``hardware_spec``), the one
        measured on this machine for CPU devices (``cpu_spec``), or the one given.
      origin: where ``table`` comes from: ``"catalogue"``, ``"measured"`` or ``"given"``.
      calibration: the ``Calibration`` applied (its achieved rates, collective latencies
        and bandwidths, and measured overlap), or None.
      calibration_origin: ``"stored"`` (read from ``calibration_dir()``), ``"given"``, or
        why there is none: ``"none stored"``, ``"not asked (calibration=False)"``, ``"not
        looked up: hardware named by the caller"``.
      for_mesh: True when it is the mesh's own device kind (``hardware`` not named): only
        then do a plan's TPU-compiler cycle estimates time its local work.
      efficiency: the catalogue entry's efficiencies measured on a lent GPU
        (``workbench.hardware._efficiency``), applied where no calibration is: a plan's
        local work is timed with them; None where none was measured or a calibration is.
      efficiency_origin: ``"measured on <run> (<date>, ...)"``, ``"table: no measured run
        for <entry> ..."``, or why none applies (``"calibrated"``, ``"not a catalogue
        entry"``).
    """

    spec: HardwareSpec
    table: HardwareSpec
    origin: str
    calibration: Calibration | None = None
    calibration_origin: str = "not asked (calibration=False)"
    for_mesh: bool = True
    efficiency: Efficiency | None = None
    efficiency_origin: str = "not a catalogue entry"

    @property
    def name(self) -> str:
        """The device kind's name in the table (``"TPU v5p"``, ``"CPU (...)"``)."""
        return self.table.name

    @property
    def table_latency(self) -> float:
        """Seconds per collective instruction in ``table`` (0 where it has none): what a
        calibration's collective factors are relative to."""
        return self.table.collective_latency or 0.0

    def sources(self) -> dict[str, str]:
        """Where each number comes from, by name: ``entry``, ``peak_flops``,
        ``hbm_bandwidth``, ``calibration``."""
        cal = (f"{self.calibration_origin}: {self.calibration.source}"
               if self.calibration is not None else self.calibration_origin)
        return {"entry": f"{self.origin}: {self.table.name}",
                "peak_flops": self.spec.source,
                "hbm_bandwidth": self.spec.source_of("hbm_bandwidth"),
                "calibration": cal, "efficiency": self.efficiency_origin}

    def __str__(self) -> str:
        s = self.spec
        lines = [f"{self.name} ({self.origin}"
                 + (", calibrated" if self.calibration is not None else "") + ")",
                 f"  peak {s.peak_flops / 1e12:.4g} TFLOP/s per device"
                 + (f", HBM {s.hbm_bandwidth / 1e9:.4g} GB/s" if s.hbm_bandwidth else "")]
        lines += [f"  {k}: {v}" for k, v in self.sources().items()]
        return "\n".join(lines)


def effective_spec(mesh: Any, *, hardware: HardwareSpec | str | None = None,
                   calibration: Calibration | bool | None = None) -> EffectiveSpec:
    """The hardware spec to predict a step on ``mesh`` with: catalogue -> measured ->
    calibrated, each step named (``EffectiveSpec.sources``).

    Args:
      mesh: a ``MeshInfo`` (``plan.mesh``), or anything with
        its ``device_kind``, ``platform`` and ``size``.
      hardware: a ``HardwareSpec`` or device kind ("TPU v5p", "H100") to predict for
        another chip; default the mesh's device kind (measured on this machine for CPU
        devices).
      calibration: None (default): the calibration stored for the device kind
        (``wb.calibrate``), if any, when ``hardware`` is not named; False: none; or a
        ``Calibration`` to apply.

    Raises:
      ValueError: no catalogue entry for the device kind.
      TypeError: ``mesh`` has no device kind, platform and size.
    """
    if not all(hasattr(mesh, a) for a in ("device_kind", "platform", "size")):
        raise TypeError(f"effective_spec: mesh is a {type(mesh).__name__}, not a MeshInfo; "
                        "pass wb.mesh.mesh_info(mesh) (or plan.mesh)")
    table, origin = _table(hardware, mesh)
    if calibration is not None and calibration is not False and \
            not isinstance(calibration, Calibration):
        raise TypeError(f"effective_spec: calibration is a {type(calibration).__name__}; "
                        "pass a Calibration (wb.calibrate(...)), False for none, or None "
                        "for the stored one")
    if isinstance(calibration, Calibration):
        cal, why = calibration, "given"
    elif calibration is None and hardware is None:
        cal = load_calibration(table.name)
        why = "stored" if cal is not None else "none stored"
    elif calibration is None:
        cal, why = None, "not looked up: hardware named by the caller"
    else:
        cal, why = None, "not asked (calibration=False)"
    if cal is not None:
        eff, eff_why = None, "calibrated: the calibration's rates replace the measured ones"
    elif origin == "catalogue":
        eff, eff_why = measured_efficiency(table.name), efficiency_origin(table.name)
    else:
        eff, eff_why = None, f"not a catalogue entry ({origin})"
    return EffectiveSpec(spec=cal.apply_spec(table) if cal is not None else table,
                         table=table, origin=origin, calibration=cal,
                         calibration_origin=why, for_mesh=hardware is None, efficiency=eff,
                         efficiency_origin=eff_why)


def _table(hardware: HardwareSpec | str | None, mesh: Any) -> tuple[HardwareSpec, str]:
    """The entry before calibration and where it comes from."""
    if isinstance(hardware, HardwareSpec):
        return hardware, "given"
    kind = hardware or mesh.device_kind
    if kind.lower() == "cpu" or (hardware is None and mesh.platform == "cpu"):
        return cpu_spec(mesh.size), "measured"
    spec = hardware_spec(kind)
    if spec is None:
        raise ValueError(f"no hardware entry for {kind!r}; pass hardware= a HardwareSpec "
                         "or a device kind such as 'TPU v5p' or 'H100'")
    return spec, "catalogue"
