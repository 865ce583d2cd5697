"""Every notebook runs top to bottom in a fresh kernel on CPU, as a learner would run it,
and then a second time in the same folder."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
EXPECTED = ["00_tour", "01_meshes_and_devices", "02_partition_specs",
            "03_sharded_model_step_by_step", "04_memory_math", "05_resumable_training",
            "06_launch_from_a_cell", "07_teaching_on_tpu_vms", "08_plan_for_a_pod",
            "09_bring_your_own_model", "10_pipelines", "11_experts_and_long_sequences",
            "12_start_from_a_released_model"]


#: What a notebook says on its second run about what it reuses from the first.
SECOND_RUN_SAYS = {
    "00_tour": "is already at step 20 (target 20); nothing to do",
    "05_resumable_training": "this run starts a new run directory, runs/05-resumable-2, and "
                             "reuses nothing from them",
    "06_launch_from_a_cell": "runs/06-job already holds",
}


def kernel_env() -> dict[str, str]:
    """The environment of a fresh kernel: no simulated-device flag, so each notebook must set
    up its own devices with wb.simulate_devices(8) like a learner's kernel."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    env.pop("MPLBACKEND", None)
    return env


#: Notebooks whose first run compiles large models with the TPU compiler (one 70B compile
#: per cell, a minute or two each on 2 cores; their second run reads the plan cache):
#: seconds per cell and for both runs together.
TPU_COMPILING = {"08_plan_for_a_pod": (600, 2400)}


def run_notebook(path: pathlib.Path, cwd: pathlib.Path) -> tuple[nbformat.NotebookNode, float]:
    nb = nbformat.read(path, as_version=4)
    cell_timeout = TPU_COMPILING.get(path.stem, (240, 0))[0]
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    t0 = time.perf_counter()
    client.execute(env=kernel_env(), cwd=str(cwd))
    return nb, time.perf_counter() - t0


def test_every_notebook_is_there_and_built_from_its_source():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED
    out = subprocess.run([sys.executable, str(ROOT / "notebooks" / "build.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stripped_and_simulates_devices_first(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "outputs not stripped"
    assert "wb.simulate_devices(8)" in code[0].source
    assert code[0].source.index("wb.simulate_devices(8)") < code[0].source.find("import jax") \
        or "import jax" not in code[0].source


@pytest.mark.slow
@pytest.mark.parametrize("path", [
    pytest.param(p, id=p.stem,
                 marks=pytest.mark.timeout(TPU_COMPILING.get(p.stem, (0, 600))[1]))
    for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom_and_again_in_the_same_folder(path, tmp_path):
    """A learner runs the notebook, then runs it again from the top in the same folder:
    both runs finish without an error, whatever the first left behind (run directories,
    checkpoints, config files)."""
    for attempt in ("first run", "second run in the same folder"):
        nb, seconds = run_notebook(path, tmp_path)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
                  if o.output_type == "error"]
        assert not errors, f"{path.stem}, {attempt}: {errors[0].get('ename')}: " \
                           f"{errors[0].get('evalue')}"
        text = "\n".join(_text(o) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        assert "Traceback" not in text, f"{path.stem}, {attempt}"
        time.sleep(0.5)
        assert not _processes_in(tmp_path), f"{path.stem} left processes running ({attempt})"
        print(f"{path.stem}, {attempt}: {seconds:.1f} s")
    said = SECOND_RUN_SAYS.get(path.stem)
    assert said is None or said in text, f"{path.stem}'s second run does not say {said!r}"


def _text(output: nbformat.NotebookNode) -> str:
    if output.output_type == "stream":
        return output.text
    data = output.get("data", {})
    return data.get("text/plain", "") if isinstance(data.get("text/plain", ""), str) else ""


def _processes_in(directory: pathlib.Path) -> list[str]:
    """Processes still running whose working directory or command line is under
    ``directory`` (the notebook's own scratch directory, so never another test's)."""
    found = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if str(directory) in cmd or cwd.startswith(str(directory)):
            found.append(f"{proc.name}: {cmd[:120]}")
    return found
