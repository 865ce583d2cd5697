"""Every notebook runs top to bottom in a fresh kernel on CPU, as a learner would run it,
and then a second time in the same folder: the cells that meet what the first run left
there (tests/_notebook_cells.py)."""
from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import re
import subprocess
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

from _noise import THIRD_PARTY_NOISE
from _notebook_cells import audit_cell, second_run, second_run_cells, touched_cells

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
EXPECTED = ["00_tour", "01_meshes_and_devices", "02_partition_specs",
            "03_sharded_model_step_by_step", "04_memory_math", "05_resumable_training",
            "06_launch_from_a_cell", "07_teaching_on_tpu_vms", "08_plan_for_a_pod",
            "09_bring_your_own_model", "10_pipelines", "11_experts_and_long_sequences",
            "12_train_on_your_own_text",
            "13_start_from_a_released_model"]


#: What a notebook says on its second run about what it reuses from the first.
SECOND_RUN_SAYS = {
    "00_tour": "is already at step 20 (target 20); nothing to do",
    "05_resumable_training": "this run starts a new run directory, runs/05-resumable-2, and "
                             "reuses nothing from them",
    "06_launch_from_a_cell": "runs/06-job already holds",
    "12_train_on_your_own_text": "run directory: runs/12-own-text-2",
    "13_start_from_a_released_model": "is already at step 20 (target 20); nothing to do",
}


#: Notebooks that name a Hub id: their test fills a Hugging Face cache with a tiny random
#: model under that same id (tests/_hub_cache.py) and points the kernel at it, offline
#: (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE=1), so the id resolves and nothing downloads.
ON_HUB = {"13_start_from_a_released_model": "Qwen/Qwen3-0.6B",
          "12_train_on_your_own_text": "Salesforce/wikitext"}   # a dataset (12 reads one)


def _hub_for(stem: str, factory: pytest.TempPathFactory) -> dict[str, str]:
    """The extra kernel environment of notebook ``stem``: an offline Hugging Face cache
    holding ``ON_HUB[stem]`` for the ON_HUB notebooks (one for both runs), else nothing."""
    if stem not in ON_HUB:
        return {}
    from _hub_cache import WIKITEXT_ID, hub_cache_with, hub_dataset_with, offline_env

    home = factory.mktemp("hf-home")
    fill = hub_dataset_with if ON_HUB[stem] == WIKITEXT_ID else hub_cache_with
    fill(home / "hub", ON_HUB[stem])
    return offline_env(home)


#: Notebooks whose SLURM cell submits where a controller answers (``sinfo``): their test
#: starts the cluster tests' own slurmctld + slurmd + munge (tests/_clusters.py) and points
#: the kernel at it (``SLURM_CONF``), so the notebook's launch runs on a real scheduler.
ON_SLURM = {"06_launch_from_a_cell"}


@contextlib.contextmanager
def _cluster_for(stem: str, factory: pytest.TempPathFactory):
    """The extra kernel environment of notebook ``stem``: a running local SLURM's for
    the ON_SLURM notebooks (stopped afterwards), else nothing. Where SLURM is not
    installed (outside `make test`; under CI that fails) the notebook runs without it."""
    if stem not in ON_SLURM:
        yield {}
        return
    from _clusters import LocalSlurm

    try:
        cluster = LocalSlurm(factory.mktemp("nb-slurm")).start()
    except pytest.skip.Exception:
        yield {}
        return
    try:
        yield dict(cluster.env)
    finally:
        cluster.stop()


def _accelerator_attached() -> bool:
    """Whether a TPU chip (JAX's own test) or an NVIDIA GPU is attached to this host."""
    from workbench.hardware._libtpu import tpu_chips_attached

    return tpu_chips_attached() or bool(glob.glob("/dev/nvidia[0-9]*"))


def kernel_env(cache: pathlib.Path) -> dict[str, str]:
    """The environment of a fresh kernel: no simulated-device flag, so each notebook must set
    up its own devices with wb.simulate_devices(8) like a learner's kernel. ``cache`` is the
    session's ``WORKBENCH_CACHE``: what one run compiled for a TPU slice (a plan) the next
    reads back, as a learner's second run does from ``~/.cache/workbench``.

    JAX's persistent compilation cache is on from the kernel's start, in the directory and
    with the settings a ``wb.Trainer`` turns it on with (``<cache>/jax-compile``, every
    compile kept: ``workbench.train._setup.enable_compile_cache``), so a second run reads
    back the steps the first compiled, as a learner's does once a Trainer ran in the
    kernel. Without it a notebook's ``wb.plan`` compiles for CPU devices were redone in
    every kernel: notebook 03's second run (four plans, ~4.5 s of XLA CPU compile each)
    cost as much as its first. Multi-process CPU workers still turn it off
    (``workbench.jobs._worker``).

    On a host without accelerators JAX picks its platform itself (no ``JAX_PLATFORMS``),
    as in a learner's kernel: where libtpu is installed it would probe for a TPU at the
    first ``jax.devices()`` and print libtpu's warnings, which the notebooks must not show
    (``wb.simulate_devices`` skips that probe; THIRD_PARTY_NOISE checks). Where a GPU or
    TPU is attached the kernel stays on CPU (``JAX_PLATFORMS=cpu``)."""
    env = dict(os.environ)
    env["WORKBENCH_CACHE"] = str(cache)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache / "jax-compile")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    if _accelerator_attached():
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    env.pop("MPLBACKEND", None)
    return env


#: Seconds a cell may take, and both runs of a notebook together. A hung cell fails within
#: CELL_S. 360: a clean-clone run beside a TPU compile (2026-11-29) saw notebook 03's cell of
#: three tiny CPU plans (19 s alone) pass 240 s; rerun at once, the notebook took 80 s.
CELL_S, NOTEBOOK_S = 360, 600
#: Notebooks that compile for an abstract TPU slice (the plans land in the session's
#: WORKBENCH_CACHE; their second run reads them back).
TPU = {"07_teaching_on_tpu_vms", "08_plan_for_a_pod", "11_experts_and_long_sequences"}
#: Seconds for each cell and both runs together of a notebook that compiles for TPU slices
#: (one limit for cells and runs: a compile's time grows with the load, CI beside other
#: work ran 2.6x slower, so a per-cell limit below it only fails a loaded machine sooner,
#: and a hung cell is still stopped). 08, on SHRINK's workload: ~100 s of CPU for its
#: seven compiles and the rest. 11 compiles MoE and long-sequence steps for v5p slices (83 s
#: for both runs in a clean-clone CI run, one compile cell ~40 s, before SHRINK halved
#: it): beside a second pytest-xdist worker and other work (load average ~30) one compile
#: cell passed the 240 s cell limit. Both get ~5x their loaded time.
HEAVY_S = {"08_plan_for_a_pod": 1200, "11_experts_and_long_sequences": 1200}
#: Code a test runs right after a notebook's cell holding the anchor, to run every cell of
#: the notebook on a smaller workload. 08 plans Llama-2-70B at 4096 tokens on v5p-128 and
#: v5p-512: seven TPU compiles of 60-240 s of CPU each on this machine (a 70B step for
#: v5p-128: 209-237 s), ~10 minutes of the suite's 2 cores. Model size and slice size
#: barely move a TPU compile (a 1B model on v5p-8: 83-115 s; a width-512 model on v5p-128
#: at 4096 tokens: 75 s), the token count, width and vocabulary do. CPU seconds of one
#: plan (the notebook's first, v5p-128, 80 scanned layers; its last, splash on v5p-512):
#: width 512, 512 tokens, 32000-token vocabulary: 56, 52; width 256 at 256 tokens: 22, 18;
#: at 128 tokens: 21, 18; with a 4096-token vocabulary: 10.5 (width 128: no faster; 8
#: layers instead of 80: 15). So the model keeps its 80 scanned layers at width 256
#: (2 query heads of 128 sharing one key/value head, GQA as in the 70B), 128 tokens (one
#: splash block) and a 4096-token vocabulary: every plan of the notebook still fits, so
#: each cell runs the code path a learner's does (search, the compiled re-rank, splash,
#: the remat policies). The published configuration itself is compiled by `make bench`
#: (bench_calibration's "70b fsdp remat=full ... on v5p-128" row, the reference rows for
#: v5p-512).
SHRINK = {"08_plan_for_a_pod": (
    'GPTConfig.preset("70b")',
    "cfg = cfg.replace(d_model=256, n_heads=2, n_kv_heads=1, head_dim=128, d_ff=896,\n"
    "                  vocab_size=4096)\n"
    "SEQ = 128   # the test's smaller workload (tests/test_notebooks.py, SHRINK)"),
    # 11 plans moe-small (16 experts, top-2, a shared expert) for v5p-8 at its 1024 tokens:
    # one TPU compile of 44 s of CPU; at width 256 and 256 tokens 21-23 s, with the same
    # experts, capacity factor and scanned layers, so the step still fits and its program
    # still holds the all-to-alls over `expert` that the cell prints (the vocabulary
    # barely moves this one).
    "11_experts_and_long_sequences": (
        'GPTConfig.preset("moe-small"',
        "small_moe = small_moe.replace(d_model=256, head_dim=32, d_ff=512, expert_d_ff=512,\n"
        "                              seq_len=256)   # the test's smaller workload (SHRINK)"),
}


def _shrink(nb: nbformat.NotebookNode, stem: str) -> None:
    """Adds ``SHRINK[stem]``'s code after the one code cell holding its anchor."""
    if stem not in SHRINK:
        return
    anchor, code = SHRINK[stem]
    at = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and anchor in c.source]
    assert len(at) == 1, f"{stem}: {len(at)} code cells hold {anchor!r}; update SHRINK"
    nb.cells.insert(at[0] + 1, nbformat.v4.new_code_cell(code))


def _marks(stem: str) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.timeout(HEAVY_S.get(stem, NOTEBOOK_S))]
    if stem in TPU:
        marks.append(pytest.mark.tpu)
    if stem in HEAVY_S:
        marks.append(pytest.mark.slow)
    return marks


def run_notebook(path: pathlib.Path, cwd: pathlib.Path, cache: pathlib.Path,
                 env: dict[str, str] | None = None, *, audit: pathlib.Path | None = None,
                 keep: list[int] | None = None) -> tuple[nbformat.NotebookNode, float]:
    """Runs the notebook at ``path`` in a fresh kernel in ``cwd``: only its code cells
    ``keep`` where given; with ``audit``, first the cell recording which cells touch
    ``cwd`` into that file (tests/_notebook_cells.py; not in the notebook returned)."""
    nb = nbformat.read(path, as_version=4)
    _shrink(nb, path.stem)
    if keep is not None:
        code = [c for c in nb.cells if c.cell_type == "code"]
        nb.cells = [code[i] for i in keep]
    if audit is not None:
        nb.cells.insert(0, nbformat.v4.new_code_cell(audit_cell(audit)))
    client = NotebookClient(nb, timeout=HEAVY_S.get(path.stem, CELL_S), kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    t0 = time.perf_counter()
    try:
        client.execute(env={**kernel_env(cache), **(env or {})}, cwd=str(cwd))
    finally:
        if audit is not None:
            nb.cells.pop(0)
    return nb, time.perf_counter() - t0


def _slowest_cells(nb: nbformat.NotebookNode, n: int = 3) -> str:
    """The ``n`` slowest code cells as "cell i: s" (nbclient's timing metadata)."""
    from datetime import datetime

    took = []
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        t = cell.metadata.get("execution", {})
        start, end = t.get("iopub.execute_input"), t.get("shell.execute_reply")
        if start and end:
            seconds = (datetime.fromisoformat(end.replace("Z", "+00:00"))
                       - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()
            took.append((seconds, i))
    return ", ".join(f"cell {i}: {s:.0f} s" for s, i in sorted(took, reverse=True)[:n])


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


@pytest.mark.notebook
@pytest.mark.parametrize("path", [
    pytest.param(p, id=p.stem, marks=_marks(p.stem)) for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom_and_again_in_the_same_folder(path, tmp_path, cache_dir,
                                                                  tmp_path_factory):
    """A learner runs the notebook, then runs it again from the top in the same folder:
    both runs finish without an error, whatever the first left behind in the folder (run
    directories, checkpoints, config files, job folders). The second run runs the cells
    that meet what the first left: those that touched the folder in the first run (an audit
    hook in the kernel records it), those naming an entry the folder now holds, and the
    cells binding the names those read (tests/_notebook_cells.py says how they are
    chosen); a cell that never looked at the folder meets nothing new in it (a cached plan
    read back in a new process is tests/test_tpu_plans.py's
    test_plan_cache_on_disk_serves_a_new_process). A first run that left nothing in the
    folder has no second run."""
    hub = _hub_for(path.stem, tmp_path_factory)
    report = tmp_path_factory.mktemp("audit") / "touched.json"
    keep = None
    for attempt in ("first run", "second run in the same folder"):
        if attempt != "first run":
            if not any(tmp_path.iterdir()):
                assert SECOND_RUN_SAYS.get(path.stem) is None, f"{path.stem} left nothing behind"
                print(f"{path.stem}: the first run left nothing in its folder; no second run")
                return
            sources = [c.source for c in nb.cells if c.cell_type == "code"]
            keep, why = second_run(tmp_path, sources, report)
            print(f"{path.stem}, second run: {len(keep)} of {len(sources)} code cells: "
                  + "; ".join(f"{i} ({why[i]})" for i in keep))
        with _cluster_for(path.stem, tmp_path_factory) as env:
            nb, seconds = run_notebook(path, tmp_path, cache_dir, {**env, **hub},
                                       audit=report if keep is None else None, keep=keep)
        on_slurm = "SLURM_CONF" in env
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
                  if o.output_type == "error"]
        assert not errors, f"{path.stem}, {attempt}: {errors[0].get('ename')}: " \
                           f"{errors[0].get('evalue')}"
        text = "\n".join(_text(o) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        assert "Traceback" not in text, f"{path.stem}, {attempt}"
        noise = third_party_noise(nb)
        assert not noise, f"{path.stem}, {attempt}: third-party log lines in the outputs:\n" + \
            "\n".join(noise)
        left = _still_running_in(tmp_path)
        assert not left, f"{path.stem} left processes running ({attempt}): {left}"
        print(f"{path.stem}, {attempt}: {seconds:.1f} s ({_slowest_cells(nb)})")
        if on_slurm:   # the SLURM cell submitted, and the job completed
            assert "'state': 'COMPLETED'" in text, f"{path.stem}, {attempt}: no SLURM run"
    said = SECOND_RUN_SAYS.get(path.stem)
    assert said is None or said in text, f"{path.stem}'s second run does not say {said!r}"


def third_party_noise(nb: nbformat.NotebookNode) -> list[str]:
    """Each line of an executed notebook's stream outputs that THIRD_PARTY_NOISE matches,
    as "cell i (first line of its code), stderr: the line" (i counts code cells from 0).
    Mostly stderr; stdout too, where a cell prints what a process it ran wrote (notebook
    05 prints the CLI's stderr)."""
    found = []
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
        for out in cell.outputs:
            if out.output_type == "stream":
                found += [f"cell {i} ({first[:60]}), {out.name}: {line}"
                          for line in out.text.splitlines() if THIRD_PARTY_NOISE.search(line)]
    return found


def test_third_party_noise_names_the_cell_and_line_and_passes_our_own_warnings():
    cells = [nbformat.v4.new_code_cell("import workbench as wb\nwb.simulate_devices(8)"),
             nbformat.v4.new_code_cell("ckpts = wb.train.Checkpoints('runs/x', read_only=True)")]
    cells[0].outputs = [nbformat.v4.new_output("stream", name="stderr", text=(
        "WARNING: Logging before InitGoogle() is written to STDERR\n"
        "E0000 00:00:1795870317.188758    1543 common_lib.cc:554] INVALID_ARGUMENT: Error: "
        "unexpected worker hostname\n"))]
    cells[1].outputs = [
        nbformat.v4.new_output("stream", name="stderr", text=(
            "WARNING:absl:CheckpointManagerOptions.read_only=True, setting max_to_keep=None.\n"
            "/work/main/workbench/train/checkpoint.py:763: UserWarning: runs/x/7 is not a "
            "complete checkpoint\n  warnings.warn(\n")),
        nbformat.v4.new_output("stream", name="stdout", text="WARNING:absl:on stdout\n")]
    nb = nbformat.v4.new_notebook(cells=cells)
    assert third_party_noise(nb) == [
        "cell 0 (import workbench as wb), stderr: WARNING: Logging before InitGoogle() is "
        "written to STDERR",
        "cell 0 (import workbench as wb), stderr: E0000 00:00:1795870317.188758    1543 "
        "common_lib.cc:554] INVALID_ARGUMENT: Error: unexpected worker hostname",
        "cell 1 (ckpts = wb.train.Checkpoints('runs/x', read_only=True)), stderr: "
        "WARNING:absl:CheckpointManagerOptions.read_only=True, setting max_to_keep=None.",
        "cell 1 (ckpts = wb.train.Checkpoints('runs/x', read_only=True)), stdout: "
        "WARNING:absl:on stdout"]


def _text(output: nbformat.NotebookNode) -> str:
    if output.output_type == "stream":
        return output.text
    data = output.get("data", {})
    return data.get("text/plain", "") if isinstance(data.get("text/plain", ""), str) else ""


#: Seconds the processes of a notebook's folder get to end once its kernel was told to shut
#: down. nbclient returns when jupyter_client has asked the kernel to exit, sent SIGTERM
#: after 2.5 s and SIGKILL after 5 s, and waited up to 5 s more; on a loaded clean-clone run
#: (load ~13) the kernels of notebooks 00 and 13 were still in /proc 0.5 s after that, while
#: alone both were gone at once. A process the notebook really left behind (a job, a
#: server) outlives any such wait.
SETTLE_S = 30


def _still_running_in(directory: pathlib.Path, seconds: float = SETTLE_S) -> list[str]:
    """:func:`_processes_in` ``directory`` once they are gone, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        time.sleep(0.5)
        left = _processes_in(directory)
        if not left or time.monotonic() > deadline:
            return left


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


def test_second_run_keeps_what_met_the_folder_and_the_cells_binding_what_those_read():
    """Hand-picked against tests/_notebook_cells.py's three rules."""
    sources = [
        "import workbench as wb\nwb.simulate_devices(8)\nimport numpy as np",   # 0 first
        "cfg = wb.models.GPTConfig.preset('tiny')",       # 1 binds cfg (read by 4)
        "plan = wb.plan(cfg, mesh=wb.make_mesh())\nplan",  # 2 nothing kept reads plan
        "RUN = 'runs/a'",                                 # 3 names runs/, binds RUN
        "trainer = wb.Trainer(cfg, run_dir=RUN)",         # 4 touched
        "x = np.arange(3)\ntrainer.fit(steps=3)",         # 5 touched (binds x)
        "trainer.config.lr = 1.0",                        # 6 changes trainer (read by 8)
        "print(plan.summary(), x)",                       # 7 reads plan: not kept
        "%time trainer.fit(steps=6)",                     # 8 touched, a magic
        "import os\nos.path.exists('./runs/a')",          # 9 names runs/
        "y = [1]\ny.append(2)",                           # 10 nothing
        "def f():\n    return y\nf()",                    # 11 touched: needs 10's y
    ]
    keep, why = second_run_cells(sources, {4, 5, 8, 11}, {"runs", "data.txt"})
    assert keep == [0, 1, 3, 4, 5, 6, 8, 9, 10, 11]
    assert why[0] == "the first cell" and why[1] == "binds cfg" and why[6] == "changes trainer"
    assert why[9] == "names 'runs'" and why[8] == "touched the folder"
    assert second_run_cells(sources, set(), set()) == ([0], {0: "the first cell"})


@pytest.mark.multiprocess
def test_the_audit_records_each_cell_that_touches_the_folder(tmp_path):
    """The first run's audit cell in a real kernel: writes, listings, removals and
    processes started in the folder count; the same calls elsewhere do not, nor an
    import's search of the folder, nor a name opened relative to another directory."""
    folder, outside = tmp_path / "nb", tmp_path / "elsewhere"
    folder.mkdir(), outside.mkdir()
    sources = [
        "x = 1",                                                             # 0
        "import pathlib\npathlib.Path('a.txt').write_text('hi')",            # 1 open
        f"open({str(outside / 'b.txt')!r}, 'w').close()",                    # 2 elsewhere
        "import os\nos.listdir('.')",                                        # 3 listing
        f"import subprocess\nsubprocess.run(['true'], cwd={str(outside)!r})",  # 4 elsewhere
        "subprocess.run(['true'])",                                          # 5 cwd: folder
        f"os.makedirs({str(folder / 'runs' / 'r')!r})",                      # 6 absolute
        "import shutil\nshutil.rmtree('runs')",                              # 7 removal
        "print(x)",                                                          # 8
        "import colorsys",                      # 9 the import system lists the folder
        f"d = os.open({str(outside)!r}, os.O_RDONLY)\n"                       # 10 elsewhere,
        "os.close(os.open('b.txt', os.O_RDONLY, dir_fd=d))",                   # by dir_fd
    ]
    report = tmp_path / "touched.json"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(audit_cell(report))]
                                  + [nbformat.v4.new_code_cell(s) for s in sources])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute(cwd=str(folder))
    errors = [o for c in nb.cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    touched = touched_cells(report, sources)
    assert set(touched) == {1, 3, 5, 6, 7}, touched
    assert touched[1].startswith("open (") and touched[7].startswith("shutil.rmtree (")
