"""``XLA_FLAGS`` for simulated CPU devices (no JAX import: the launcher's and SLURM's
modules use it without starting JAX)."""
from __future__ import annotations

import re

COUNT_FLAG = "--xla_force_host_platform_device_count"


def cpu_device_flags(flags: str, n: int) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) asking for ``n`` simulated CPU devices: any
    device count already in them is replaced, every other flag kept in its order (a
    launcher's workers, SLURM tasks and ``simulate_devices`` all set the count this way)."""
    kept = re.sub(rf"{COUNT_FLAG}=\d+", "", flags).split()
    return " ".join([*kept, f"{COUNT_FLAG}={n}"])
