"""`make lab` / `make install` choose the accelerator's JAX (workbench/hardware/_accelerator.py),
and `wb.devices()` warns when a GPU or TPU is there but JAX sees only CPUs (issue 57, item 2).

A stand-in ``nvidia-smi`` first on PATH (what the real one prints for ``-L`` and in its header)
makes make's own dry run (``make -n``) name JAX's CUDA plugin; device files are stood in by a
folder passed as ``dev``. Nothing is installed or downloaded. The reference for the extras is
JAX's own metadata: the extra the Makefile asks for must be one the installed jax declares.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import subprocess
import warnings

import pytest

import workbench as wb
import workbench.hardware._accelerator as accelerator

REPO = pathlib.Path(__file__).resolve().parent.parent
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5b1f0c1e)"


def _stand_in_nvidia_smi(folder: pathlib.Path, cuda: str | None, gpus: int = 1) -> pathlib.Path:
    """An ``nvidia-smi`` that lists ``gpus`` H100s and prints ``CUDA Version: <cuda>``."""
    folder.mkdir(parents=True, exist_ok=True)
    listing = "\n".join(H100.replace("GPU 0", f"GPU {i}") for i in range(gpus))
    header = f"| NVIDIA-SMI 580.65.06  Driver Version: 580.65.06  CUDA Version: {cuda} |" \
        if cuda else "| NVIDIA-SMI has failed because it couldn't communicate with the driver |"
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = \"-L\" ]; then\ncat <<'E'\n{listing}\nE\n"
                      f"exit 0\nfi\necho '{header}'\n")
    script.chmod(0o755)
    return folder


def _env(path_first: pathlib.Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ACCEL", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}   # as a user's shell
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', os.defpath)}"
    return {**env, **extra}


def _dry_run(env: dict[str, str]) -> subprocess.CompletedProcess:
    make = shutil.which("make")
    if make is None:
        pytest.skip("`make` is not installed")
    return subprocess.run([make, "-n", "-B", "install"], cwd=REPO, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120, check=False)


# (the driver's CUDA version nvidia-smi prints, ACCEL, the extra make must install, or None)
DRY_RUNS = [
    pytest.param("13.0", None, "cuda13", id="cuda-13-driver"),
    pytest.param("12.4", None, "cuda12", id="cuda-12-driver"),
    pytest.param("13.1", "cuda12", "cuda12", id="accel-overrides-the-driver"),
    pytest.param("12.8", "cpu", None, id="accel-cpu-on-a-gpu-host"),
    pytest.param("11.8", None, None, id="driver-too-old-for-any-plugin"),
    pytest.param(None, None, "cuda12", id="gpu-listed-driver-version-unreadable"),
]


@pytest.mark.parametrize(("cuda", "accel", "extra"), DRY_RUNS)
def test_make_installs_the_plugin_for_the_drivers_cuda(tmp_path, cuda, accel, extra) -> None:
    env = _env(_stand_in_nvidia_smi(tmp_path / "bin", cuda), **({"ACCEL": accel} if accel else {}))
    out = _dry_run(env)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    chosen = extra or "cpu"
    assert first.startswith(f"make: accelerator {chosen}, installing "), first
    assert ("ACCEL given" in first) == bool(accel), first
    if cuda and not accel:
        assert f"driver CUDA {cuda}" in first and H100 in first, first
    deps = next(ln for ln in out.stdout.splitlines() if "tools/requirements.py" in ln)
    editable = next(ln for ln in out.stdout.splitlines() if "pip install" in ln and " -e " in ln)
    installs = [ln for ln in out.stdout.splitlines() if "pip install --no-compile" in ln]
    # the JAX stack at the versions CI tests (tools/lock.txt), whatever the accelerator
    assert installs and all("-c tools/lock.txt" in ln for ln in installs + [editable]), installs
    if extra:
        assert f"jax[{extra}]" in first
        assert deps.split()[2] == f"test,tpu-compile,{extra}" and f",{extra}]" in editable
        # the other major's plugin is removed, not this one's
        removed = next(ln for ln in out.stdout.splitlines() if "pip uninstall" in ln)
        assert f"jax-{extra}-plugin" not in removed and "jax-cuda" in removed
    else:
        assert "cuda" not in deps and "cuda" not in editable
    if cuda == "11.8":
        assert "update the NVIDIA driver" in first


def test_the_extras_make_names_are_jaxs_own() -> None:
    """pyproject's cuda12/cuda13 extras ask for the jax extras the installed jax declares."""
    spec = importlib.util.spec_from_file_location("requirements", REPO / "tools" /
                                                  "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    requirements = module.requirements
    declared = set(importlib.metadata.metadata("jax").get_all("Provides-Extra"))
    for extra in ("cuda12", "cuda13"):
        assert extra in declared, sorted(declared)
        assert f"jax[{extra}]" in requirements([extra])
    assert set(accelerator.CHOICES) == {"cpu", "cuda12", "cuda13", "tpu"}


def test_a_cpu_host_installs_the_cpu_build_and_says_why() -> None:
    out = _dry_run(_env())
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    if shutil.which("nvidia-smi") or accelerator.detect(_env()).kind:
        pytest.skip("this host has an accelerator")
    assert first.startswith("make: accelerator cpu, installing JAX's CPU build: no NVIDIA GPU")


@pytest.mark.parametrize("accel", ["CUDA12", "cuda11", "gpu", " tpu7x"])
def test_a_bad_accel_stops_make_with_the_choices(accel) -> None:
    out = _dry_run(_env(ACCEL=accel))
    assert out.returncode != 0
    assert f"ACCEL={accel.strip()!r} is not one of cpu, cuda12, cuda13, tpu" in out.stderr
    assert "pip install" not in out.stdout


# --- device files (a folder stands in for /dev) ----------------------------------------------

@pytest.mark.parametrize(("files", "choice", "kind"), [
    pytest.param(["nvidia0", "nvidiactl"], "cuda12", "gpu", id="nvidia-device-files"),
    pytest.param(["accel0", "accel1"], "tpu", "tpu", id="tpu-v4-v5p-accel-files"),
    pytest.param(["vfio/0", "vfio/vfio"], "tpu", "tpu", id="tpu-v5e-v6e-vfio-files"),
    pytest.param(["vfio/vfio", "null"], "cpu", None, id="vfio-control-file-only"),
    pytest.param([], "cpu", None, id="nothing"),
])
def test_device_files_choose(tmp_path, files, choice, kind) -> None:
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    env = {"PATH": str(tmp_path / "empty")}
    found = accelerator.detect(env, dev=str(tmp_path))
    assert (found.choice, found.kind) == (choice, kind), found


# --- the warning -----------------------------------------------------------------------------

def _warnings_of(call) -> list[str]:
    accelerator._checked = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_devices_warns_once_when_jax_does_not_see_the_gpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(_stand_in_nvidia_smi(tmp_path, "12.6")) + os.pathsep +
                       os.environ["PATH"])
    try:
        seen = _warnings_of(wb.devices)
        assert len(seen) == 1, seen
        assert seen[0].startswith("wb.devices: this host has an NVIDIA GPU (nvidia-smi lists 1 "
                                  "GPU(s)"), seen
        assert "JAX sees only CPU devices" in seen[0] and "make install ACCEL=cuda12" in seen[0]
        again = []
        with warnings.catch_warnings(record=True) as caught:  # once per process
            warnings.simplefilter("always")
            wb.make_mesh(data=-1)
            again = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        assert again == []
        accelerator._checked = False
        assert "wb.make_mesh: this host has an NVIDIA GPU" in _warnings_of(
            lambda: wb.make_mesh(data=-1))[0]
    finally:
        accelerator._checked = True


def test_no_warning_without_an_accelerator_or_when_jax_sees_it(tmp_path) -> None:
    stand_in = {"PATH": str(_stand_in_nvidia_smi(tmp_path, "13.0"))}
    assert accelerator.unseen_warning({"gpu"}, stand_in, dev=str(tmp_path)) is None
    assert accelerator.unseen_warning({"cpu", "gpu"}, stand_in, dev=str(tmp_path)) is None
    assert accelerator.unseen_warning({"cpu"}, {"PATH": str(tmp_path / "none")},
                                      dev=str(tmp_path / "none")) is None
    (tmp_path / "accel0").touch()
    tpu = accelerator.unseen_warning({"cpu"}, {"PATH": str(tmp_path / "none")},
                                     dev=str(tmp_path))
    assert tpu is not None and tpu.startswith("this host has TPU chips (TPU device files (")
    assert "make install ACCEL=tpu" in tpu
    if not shutil.which("nvidia-smi") and not accelerator.detect(_env()).kind:
        accelerator._checked = False
        try:
            assert _warnings_of(wb.devices) == []
        finally:
            accelerator._checked = True
