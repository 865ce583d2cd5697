"""Which accelerator this host has, from the outside: the JAX build to install, and the check
that JAX sees it.

Standard library only, and nothing of Workbench's is imported: the Makefile runs this file by
its path (``tools/accelerator.py``) with the system's Python, before ``.venv`` exists, to choose
what ``make lab`` / ``make install`` install; ``wb.devices()`` asks the same questions to warn
when a GPU or TPU is there but JAX sees only CPUs.

The evidence, in order:

- ``ACCEL`` (``cpu``, ``cuda12``, ``cuda13``, ``tpu``): the user's choice, taken as given.
- NVIDIA GPUs: ``nvidia-smi`` on ``PATH`` lists them (``nvidia-smi -L``); the CUDA major version
  the driver supports is the ``CUDA Version`` of its header, which picks JAX's plugin: 13 or
  newer ``cuda13``, 12 ``cuda12``; an older driver cannot run either plugin (the CPU build, with
  the reason). Device files (``/dev/nvidia0``) without ``nvidia-smi``: ``cuda12``, saying that the
  driver's version could not be read.
- Cloud TPU chips: the TPU device files (``/dev/accel*`` on v2-v5p hosts, ``/dev/vfio/<n>`` on
  v5e/v6e and later), JAX's own test for attached chips.
- Otherwise the CPU build.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

#: The choices ``ACCEL`` may name, and what each installs (the pyproject.toml extra).
CHOICES = {"cpu": "JAX's CPU build",
           "cuda12": "JAX with its CUDA 12 plugin (jax[cuda12])",
           "cuda13": "JAX with its CUDA 13 plugin (jax[cuda13])",
           "tpu": "JAX with libtpu (installed everywhere for TPU-compiled plans)"}
#: How long ``nvidia-smi`` may take to answer (a hung driver must not hang ``make``).
NVIDIA_SMI_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """What this host has: ``choice`` (a key of ``CHOICES``), ``kind`` (``"gpu"``, ``"tpu"`` or
    ``None``: what hardware was found, whatever is installed) and ``why`` (the evidence)."""

    choice: str
    kind: str | None
    why: str


def _nvidia_smi(path: str) -> tuple[list[str], str | None]:
    """The GPUs ``nvidia-smi -L`` lists and the driver's CUDA version from its header."""
    def ask(*args: str) -> str:
        try:
            out = subprocess.run([path, *args], capture_output=True, text=True,
                                 timeout=NVIDIA_SMI_TIMEOUT_S, stdin=subprocess.DEVNULL,
                                 check=False)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout if out.returncode == 0 else ""

    gpus = [line.strip() for line in ask("-L").splitlines() if line.startswith("GPU ")]
    version = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", ask()) if gpus else None
    return gpus, (f"{version.group(1)}.{version.group(2)}" if version else None)


def _gpu(env: Mapping[str, str], dev: str) -> Accelerator | None:
    """The CUDA choice where NVIDIA GPUs are found, else None."""
    smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    gpus, cuda = _nvidia_smi(smi) if smi else ([], None)
    if gpus and cuda:
        major = int(cuda.split(".")[0])
        found = f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0]}), driver CUDA {cuda}"
        if major >= 13:
            return Accelerator("cuda13", "gpu", found)
        if major == 12:
            return Accelerator("cuda12", "gpu", found)
        return Accelerator("cpu", "gpu", f"{found}: JAX's CUDA plugins need a driver for CUDA "
                                         "12 or newer; update the NVIDIA driver, then run "
                                         "`make install` again (the CPU build until then)")
    files = sorted(glob.glob(os.path.join(dev, "nvidia[0-9]*")))
    if gpus or files:
        seen = gpus[0] if gpus else f"{files[0]} exists"
        return Accelerator("cuda12", "gpu", f"an NVIDIA GPU ({seen}) but no driver CUDA version "
                                            "read from nvidia-smi: chose cuda12; give ACCEL="
                                            "cuda13 for a driver for CUDA 13")
    return None


def _tpu(dev: str) -> Accelerator | None:
    files = sorted(glob.glob(os.path.join(dev, "accel*")) +
                   glob.glob(os.path.join(dev, "vfio", "[0-9]*")))
    if files:
        return Accelerator("tpu", "tpu", f"TPU device files ({', '.join(files[:2])}"
                                         f"{', ...' if len(files) > 2 else ''})")
    return None


def detect(env: Mapping[str, str] | None = None, dev: str = "/dev") -> Accelerator:
    """This host's accelerator and the JAX build for it; ``env['ACCEL']`` overrides.

    Args:
      env: the environment to read (``ACCEL``, ``PATH``); ``os.environ`` by default.
      dev: where the device files are (``/dev``).

    Raises:
      ValueError: ``ACCEL`` names no choice.
    """
    env = os.environ if env is None else env
    found = _gpu(env, dev) or _tpu(dev)
    given = env.get("ACCEL", "").strip()
    if given:
        if given not in CHOICES:
            raise ValueError(f"ACCEL={given!r} is not one of {', '.join(CHOICES)}; leave it "
                             "unset to choose from this host's hardware")
        return Accelerator(given, found.kind if found else None, "ACCEL given")
    return found or Accelerator("cpu", None, "no NVIDIA GPU (nvidia-smi, /dev/nvidia*) and no "
                                             "TPU device files (/dev/accel*, /dev/vfio)")


def unseen_warning(platforms: set[str], env: Mapping[str, str] | None = None,
                   dev: str = "/dev") -> str | None:
    """The warning for a host whose GPU/TPU JAX does not see (``platforms``: those of JAX's
    devices), or None when JAX sees it, or there is none."""
    if platforms - {"cpu"}:
        return None
    found = _gpu(os.environ if env is None else env, dev) or _tpu(dev)
    if found is None or found.kind is None:
        return None
    if found.kind == "gpu":
        fix = (f"install JAX's CUDA plugin: `make install ACCEL={found.choice}` in the Workbench "
               f"checkout, or `pip install \"jax[{found.choice}]\"` (same version as jax)"
               if found.choice != "cpu" else found.why)
        what = "an NVIDIA GPU"
    else:
        fix = ("install libtpu: `make install ACCEL=tpu`, or `pip install \"jax[tpu]\"`; if it is "
               "installed, another process may hold the chips (only one may)")
        what = "TPU chips"
    return (f"this host has {what} ({found.why}) but JAX sees only CPU devices, so everything "
            f"runs on the CPU; {fix}; then restart the kernel")


_checked = False


def warn_if_unseen(platforms: set[str], where: str) -> None:
    """Warn once per process, from ``where`` (the entry point that started JAX's backends:
    ``wb.devices``, ``wb.make_mesh``; the Trainer and ``wb.plan`` build their default mesh with
    it), when this host's GPU/TPU is not among JAX's ``platforms``."""
    global _checked
    if _checked:
        return
    _checked = True
    message = unseen_warning(platforms)
    if message:
        import warnings

        warnings.warn(f"{where}: {message}", RuntimeWarning, stacklevel=3)
