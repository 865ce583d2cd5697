"""Hardware: the catalogue (one entry per device generation: published peaks with sources,
links, clock, ``device_kind``, libtpu topology names, mesh presets), the device inventory,
simulated CPU devices, the measured CPU entry, and libtpu.

Modules: ``catalogue`` (``GENERATIONS``, ``HardwareSpec``, ``hardware_spec``),
``inventory`` (``devices``, ``DeviceInfo``, ``simulate_devices``, ``peak_flops``),
``measure`` (the CPU entry, measured and cached per machine), ``calibration`` (achieved
rates fitted to profiles, stored per device kind; fitted by ``wb.calibrate``, removed by
``wb.remove_calibration``), ``effective`` (``effective_spec``: the
one spec a prediction uses, catalogue -> measured -> calibrated, each number with its
source), ``libtpu`` (whether the TPU compiler is installed; ``quiet_libtpu``, called by
the entry points that start JAX's backends). Importing this package changes nothing in
JAX or the environment.
"""
from workbench.hardware._catalogue import (GENERATIONS, Generation, HardwareSpec, generation,
                                          hardware_presets, hardware_spec)
from workbench.hardware._calibration import (Calibration, CalibrationWarning, calibration_dir,
                                            load_calibration)
from workbench.hardware._effective import EffectiveSpec, effective_spec
from workbench.hardware._inventory import (DeviceInfo, DeviceInventory, devices, peak_flops,
                                          simulate_devices)
from workbench.hardware._libtpu import libtpu_installed, quiet_libtpu
from workbench.hardware._measure import (cpu_spec, measured_cpu_collective_bandwidth,
                                        measured_cpu_collective_latency,
                                        measured_cpu_memory_bandwidth, measured_cpu_peak,
                                        measured_loopback_bandwidth, psum_seconds)

__all__ = [
    "GENERATIONS", "Calibration", "CalibrationWarning", "DeviceInfo", "DeviceInventory",
    "EffectiveSpec", "Generation", "HardwareSpec", "calibration_dir", "cpu_spec", "devices",
    "effective_spec", "generation", "hardware_presets", "hardware_spec", "libtpu_installed",
    "load_calibration",
    "measured_cpu_collective_bandwidth", "measured_cpu_collective_latency",
    "measured_cpu_memory_bandwidth", "measured_cpu_peak", "measured_loopback_bandwidth",
    "peak_flops", "psum_seconds", "quiet_libtpu", "simulate_devices",
]
