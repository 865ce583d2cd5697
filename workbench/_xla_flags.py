"""``XLA_FLAGS`` for simulated CPU devices (no JAX import: the launcher's and SLURM's
modules use it without starting JAX)."""
from __future__ import annotations

import re
from collections.abc import Mapping

COUNT_FLAG = "--xla_force_host_platform_device_count"


def cpu_device_flags(flags: str, n: int) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) asking for ``n`` simulated CPU devices: any
    device count already in them is replaced, every other flag kept in its order (a
    launcher's workers, SLURM tasks and ``simulate_devices`` all set the count this way)."""
    kept = re.sub(rf"{COUNT_FLAG}=\d+", "", flags).split()
    return " ".join([*kept, f"{COUNT_FLAG}={n}"])


def cpu_device_count(env: Mapping[str, str]) -> int:
    """The CPU devices a process started with environment ``env`` gets when nothing sets
    them in the process: ``JAX_NUM_CPU_DEVICES``, else the count in ``XLA_FLAGS``, else 1
    (JAX's order: ``jax_num_cpu_devices`` when >= 0 wins over the flag)."""
    raw = env.get("JAX_NUM_CPU_DEVICES", "").strip()
    if raw.isdigit():
        return int(raw)
    found = re.findall(rf"{COUNT_FLAG}=(\d+)", env.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 1
