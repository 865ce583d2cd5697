"""The Binder set-up works: repo2docker's steps, replayed in a fresh virtual environment.

repo2docker (what mybinder.org runs) installs ``binder/requirements.txt`` into a Python
3.12 environment that has Node 20, runs ``binder/postBuild`` from the repository root,
and starts every process through ``binder/start``. This test does the same on a clean
copy of the repository (no ``.venv``, no ``node_modules``, no built extension): pip and
npm use their usual caches, so it is slow only the first time.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_binder_files_are_what_repo2docker_expects():
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.12"
    for script in ("postBuild", "start"):
        text = (BINDER / script).read_text()
        assert text.startswith("#!/bin/bash\n") and os.access(BINDER / script, os.X_OK)
    assert "set -euo pipefail" in (BINDER / "postBuild").read_text()
    assert 'exec "$@"' in (BINDER / "start").read_text()
    pins = dict(line.split("==") for line in (BINDER / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    from importlib.metadata import version
    for name in ("jax", "flax", "optax", "orbax-checkpoint", "grain", "anywidget", "jupyterlab"):
        assert pins[name] == version(name), f"binder pins {name}=={pins[name]}, tests use {version(name)}"
    readme = (ROOT / "README.md").read_text()
    assert "https://mybinder.org/badge_logo.svg" in readme and "mybinder.org/v2/" in readme


def _repository_copy(dest: pathlib.Path) -> pathlib.Path:
    """The files a clone would have (tracked, plus new files not ignored yet)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True)
    for rel in filter(None, out.stdout.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _registries_reachable() -> bool:
    """pip and npm answer from the registries they are configured with (whichever those
    are: asked through the clients themselves, never by a host name)."""
    asks = ([sys.executable, "-m", "pip", "index", "versions", "pip"],
            [shutil.which("npm") or "npm", "view", "npm", "version"])
    for cmd in asks:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                 stdin=subprocess.DEVNULL, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        if out.returncode != 0:
            return False
    return True


def _run(cmd: list[str], env: dict, cwd: pathlib.Path, timeout: int) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("npm") is None, reason="repo2docker's image has Node; this one has not")
def test_binder_steps_in_a_fresh_venv(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to copy")
    if not _registries_reachable():
        pytest.skip("repo2docker's steps install with pip and npm, whose registries do not "
                    "answer here")
    repo = _repository_copy(tmp_path / "repo")
    assert not (repo / ".venv").exists() and not (repo / "workbench" / "labextension").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    home = tmp_path / "home"
    home.mkdir()
    real_home = pathlib.Path.home()
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "HOME": str(home),  # kernel specs and Jupyter config land here, not in ~
        "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(real_home / ".cache" / "pip")),
        "npm_config_cache": os.environ.get("npm_config_cache", str(real_home / ".npm")),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        # no byte-compiling of the ~18k installed files up front (~15 s of CPU): which
        # bytecode exists changes nothing this test checks (Python writes it on import)
        "PIP_NO_COMPILE": "1",
        "LANG": "C.UTF-8",
    }
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", "-r", "binder/requirements.txt"], env, repo, 600)
    build = _run(["bash", "binder/postBuild"], env, repo, 900)
    assert "workbench-lab" in build and "workbench.server" in build
    lock = "labextension/package-lock.json"  # the build installed from it, unchanged
    assert (repo / lock).read_bytes() == (ROOT / lock).read_bytes(), f"the build rewrote {lock}"

    # The kernel spec gives every kernel 8 devices, without wb.simulate_devices.
    spec = json.loads((venv / "share/jupyter/kernels/python3/kernel.json").read_text())
    assert spec["env"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    probe = ("from jupyter_client.manager import start_new_kernel\n"
             "km, kc = start_new_kernel(kernel_name='python3')\n"
             "try:\n"
             "    r = kc.execute_interactive('import jax; print(len(jax.devices()), jax.default_backend())',"
             " timeout=120, output_hook=lambda m: m['msg_type'] == 'stream' and print(m['content']['text'], end=''))\n"
             "    assert r['content']['status'] == 'ok'\n"
             "finally:\n"
             "    kc.stop_channels(); km.shutdown_kernel(now=True)\n")
    assert _run([py, "-c", probe], env, repo, 180).split() == ["8", "cpu"]

    # binder/start sets up processes that are not kernels (terminals, python -m workbench).
    clean = {k: v for k, v in env.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = _run(["bash", "binder/start", py, "-c",
                "import jax, workbench as wb; print(len(jax.devices()), wb.make_mesh(data=-1).shape)"],
               clean, repo, 180)
    assert out.split()[0] == "8"

    # The installed package (not the copy) is what runs, with its lab extension files.
    where = _run([py, "-c", "import workbench, pathlib; print(pathlib.Path(workbench.__file__).parent)"],
                 env, tmp_path, 60).strip()
    assert str(venv) in where
    assert (venv / "share/jupyter/labextensions/workbench-lab/package.json").is_file()
