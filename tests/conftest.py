"""Test set-up: 8 simulated CPU devices before JAX starts its backends; one cache, one
JupyterLab for the whole session (one Chromium per module); the tree left as the session found it."""
import atexit
import contextlib
import glob
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

#: XLA:CPU's LLVM backend without its optimisation passes, for this session and every
#: process it starts (kernels, jobs, SLURM tasks inherit XLA_FLAGS). The suite compiles
#: hundreds of small CPU programs and runs each a few steps, so LLVM's optimisation was
#: about a third of its CPU time (tests/test_moe.py: 118 -> 84 CPU seconds). Only machine
#: code changes: XLA's HLO passes, buffer assignment (the CPU plans' memory numbers) and
#: collectives are those of a default build (the same optimised HLO and memory numbers for
#: a tiny fsdp and a moe-tiny ep plan), and libtpu's TPU compiles ignore these XLA:CPU
#: flags (same memory and cycles, checked on a v5e plan). Results may differ from a default
#: build's in the last bit (a tiny fsdp_tp Trainer's losses: 1 ulp at 2 of 6 steps, from
#: the optimisation level alone): every reference a test compares with bitwise is computed
#: in this session under the same flags, and tolerances against other references follow
#: from float32 rounding, not from one build's bits.
#: And Eigen's kernels single-threaded (``--xla_cpu_multi_thread_eigen=false``): 8 simulated
#: devices already share the 2 cores, and the intra-op thread pool's hand-offs only cost
#: CPU: test_moe, test_remat, test_scan_layers, test_moe_pipeline and test_train took
#: 253 instead of 288 CPU seconds (140 instead of 163 s), with the same HLO and memory
#: numbers and bitwise the same results (matmuls, their gradients, a fsdp_tp Trainer's losses).
#: Benchmarks (`make bench`) run with XLA's defaults.
#: Not used, although it halves XLA:CPU's compile time (three CPU plans 16.4 -> 7.8 CPU s,
#: tiny's init 2.4 -> 1.5 s): ``--xla_cpu_use_fusion_emitters=false``. The older emitters
#: cannot emit a scatter, so XLA rewrites each one (the cross-entropy gradient holds two) into
#: a while loop. The plans then lose the compiler's FLOPs: cost analysis counts a loop body
#: once, so ``compiled_flops_per_device`` becomes None. The HLO and memory numbers change too
#: (344 -> 315 fusions, 2 loops; tiny's temp +3.8 KB), and 8 tests of ``make test-fast``
#: fail. The tests would no longer check the compiles users run.
FAST_CPU_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                    "--xla_cpu_multi_thread_eigen=false")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_CPU_COMPILE
os.environ.setdefault("JAX_PLATFORMS", "cpu")
#: jemalloc (Debian's libjemalloc2, `make test` installs it) as the C allocator of every
#: process the session starts: pytest-xdist's workers, kernels, jobs and SLURM tasks
#: inherit LD_PRELOAD from this environment. The TPU compiler (libtpu) and XLA:CPU
#: allocate and free millions of small objects per compile, and glibc's malloc was ~18%
#: of a TPU compile's CPU (perf: _int_malloc, unlink_chunk, malloc_consolidate). Measured
#: here, interleaved: a moe-tiny plan for v5p-8 (tests/test_moe_tpu_memory.py's smaller
#: case) 45-50 -> 30-32 CPU seconds with the same memory numbers; `make test-fast` 168-185
#: -> 157-170 s; the whole suite's user CPU ~5% less (2642 -> 2518 s, clean clones). Only
#: where memory comes from changes: that plan's memory numbers were identical, and the
#: suite passes on it. Without the library the tests run on glibc's malloc.
JEMALLOC = next(iter(sorted(glob.glob("/usr/lib/*/libjemalloc.so.2"))), None)
if JEMALLOC and "libjemalloc" not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = f"{JEMALLOC} {os.environ.get('LD_PRELOAD', '')}".strip()
# Calibrations a user stored (wb.calibrate) must not change the tests' predictions.
os.environ["WORKBENCH_CALIBRATION"] = tempfile.mkdtemp(prefix="wb-calibration-")
atexit.register(shutil.rmtree, os.environ["WORKBENCH_CALIBRATION"], ignore_errors=True)

import pytest  # noqa: E402 - after the environment above, before any test imports JAX

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # jupyterlab_harness, _tolerance

REPO = pathlib.Path(__file__).resolve().parent.parent
#: The markers `make test-fast` deselects (pyproject.toml says what each means).
HEAVY_MARKERS = ("slow", "multiprocess", "notebook", "browser", "tpu")


def git_status() -> str | None:
    """``git status --porcelain`` of the checkout (ignored files left out), or None outside
    a git checkout."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


TREE_AT_START = pytest.StashKey[str | None]()
HOST_SPEED = pytest.StashKey["HostSpeed"]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[TREE_AT_START] = git_status()
    if hasattr(config, "workerinput"):
        _pin_worker(config.workerinput)
    elif not config.option.collectonly:   # the controller (or the only process)
        from _host_speed import HostSpeed

        config.stash[HOST_SPEED] = HostSpeed().start()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """How fast the host's cores ran during the session (tests/_host_speed.py)."""
    speed = config.stash.get(HOST_SPEED, None)
    if speed is not None:
        speed.stop()
        for line in speed.summary().splitlines():
            terminalreporter.write_line(line)
    if hasattr(config, "workerinput") or not TPU_PLANS.is_dir() \
            or os.environ.get("WORKBENCH_TEST_TPU_PLANS", "1") == "0":
        return
    base = config._tmp_path_factory.getbasetemp()   # pytest-xdist's workers' are inside
    committed = {p.name for p in TPU_PLANS.glob("*.json.gz")}
    live = {p.name for p in base.glob("**/wb-cache/plans/*.json.gz")} - committed
    if live:
        terminalreporter.write_line(
            f"TPU plans: {len(live)} compiled live, not in tests/tpu_plans (a program the "
            "tests compile changed): `make tpu-plans` makes the folder again", yellow=True)


def _pin_worker(workerinput: dict) -> None:
    """Each pytest-xdist worker, and every process it starts (kernels, jobs, SLURM
    daemons and tasks inherit it), on its own share of the cores: worker i of n on the
    i-th of every n cores this session may use. Both cores stay busy through a run
    (idle ~3%), so sharing them only added contention: XLA:CPU's and the TPU compiler's
    thread pools (sized by the cores a process may use) spread one worker's compile
    over both cores while the other worker's work waits, and threads migrate. Measured,
    interleaved (tests/test_moe_tpu_predictions.py + test_remat.py + test_context.py on
    2 workers): 185-186 s and 294 CPU s shared, 153-157 s and 255 CPU s pinned; a clean
    clone's whole `make test` (2.5 GHz Xeon): 3028 s shared, 2113 s pinned. The
    same programs compile and run; only their threads' placement changes. Not done
    where the session has fewer cores than workers. Browser tests run pinned too: their
    JupyterLab pages start slower on one core, so they wait for what they click to show
    (``jupyterlab_harness.act_until_visible``), never a fixed count of key presses."""
    cpus = sorted(os.sched_getaffinity(0))
    n, i = int(workerinput["workercount"]), int(workerinput["workerid"].lstrip("gw"))
    if len(cpus) >= n:
        _set_affinity(set(cpus[i::n]))


def _set_affinity(cpus: set[int]) -> None:
    """``cpus`` for every thread of this process (threads already started included)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


#: Test files whose tests may run on any worker, one by one (``make test`` runs two pytest-xdist
#: workers): their tests share no module fixture, so each is a group of its own.
SPLIT = {"test_notebooks.py"}
#: Test files that share results through a per-process cache (tests/_moe_steps.py: the
#: dense dropless reference steps both compare with): one group, so one worker makes them
#: once (both files in one process: 208 -> 168 CPU s).
JOINED = dict.fromkeys(("test_moe_gmm.py", "test_moe_grouped.py"),
                       "test_moe_gmm.py+test_moe_grouped.py")
#: Groups scheduled first: the longest (minutes each on 2 cores), so that no worker is left
#: with one of them at the end while the other idles. In this order.
NB = "test_notebooks.py::test_notebook_runs_top_to_bottom_and_again_in_the_same_folder"
FIRST = ("browser", "test_clusters.py", f"{NB}[06_launch_from_a_cell]", "test_pipeline.py",
         "test_binder.py", "test_profile.py", "test_text_train.py", "test_moe.py",
         "test_moe_pipeline.py", "test_fit_and_speed.py", "test_context.py",
         f"{NB}[11_experts_and_long_sequences]", "test_jobs.py", f"{NB}[08_plan_for_a_pod]")


def _group(item: pytest.Item) -> str:
    """The pytest-xdist group of ``item`` (``--dist loadgroup``: a group runs on one worker,
    in order): every browser test on the one worker whose session JupyterLab they share;
    each test of a SPLIT file alone; the files of a JOINED group together; any other test
    with its module (its module fixtures are made once)."""
    if item.get_closest_marker("browser") is not None:
        return "browser"
    name = item.path.name
    return item.nodeid.split("/")[-1] if name in SPLIT else JOINED.get(name, name)


def _rank(group: str, heavy: set[str]) -> int:
    """FIRST's groups in its order, then the other groups holding a heavy test (a marker of
    HEAVY_MARKERS), then the rest: only quick groups (12 s at most) are left for the end,
    when the other worker may have finished (a 25 s group last left one core idle for
    22 s of a clean clone's run)."""
    if group in FIRST:
        return FIRST.index(group)
    return len(FIRST) + (group not in heavy)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test on the session's JupyterLab or Chromium is a ``browser`` test whatever its file
    says; each test gets its xdist group, the longest groups first and the quick ones last
    (a stable sort: the files' order otherwise)."""
    heavy = set()
    for item in items:
        if {"lab", "browser"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.browser)
        item.add_marker(pytest.mark.xdist_group(_group(item)))
        if any(item.get_closest_marker(m) is not None for m in HEAVY_MARKERS):
            heavy.add(_group(item))
    items.sort(key=lambda i: _rank(_group(i), heavy))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After every test (on the controller when pytest-xdist runs workers): ``git status``
    is what it was when the session started, so no test wrote into the checkout; under CI
    (a fresh clone after ``make install``) it was clean from the start, so installing wrote
    nothing either. Either failing fails the session."""
    config = session.config
    if hasattr(config, "workerinput") or config.option.collectonly:
        return
    start, now = config.stash.get(TREE_AT_START, None), git_status()
    if start is None or now is None:
        return
    problems = []
    if now != start:
        problems.append(f"the tests changed the checkout:\nbefore:\n{start}\nafter:\n{now}")
    if os.environ.get("CI", "").lower() not in ("", "0", "false") and start != "":
        problems.append(f"`make install` left the fresh clone changed:\n{start}")
    if problems:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        for text in problems:
            if reporter is not None:
                reporter.write_line(f"FAILED (clean tree): {text}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


#: The TPU compiler's plans for the programs the ``tpu`` tests and notebooks compile, as the
#: plan cache stores them (``workbench.planning._compile``: memory and cost analysis and the
#: optimised HLO, under the SHA-256 of the lowered program, its compile options, the
#: devices and the jax, jaxlib and libtpu versions). Each session's cache starts with a
#: copy, so a plan whose program is unchanged is read back instead of compiled again: the
#: TPU compiles were ~670 of the suite's ~3400 CPU seconds. The comparisons are the same:
#: what a test compares with is what the installed compiler returned for that very program;
#: a program that changed (a model, a rule, a flag, another libtpu) has another name and is
#: compiled live, and the session's summary counts those. ``make tpu-plans`` remakes the
#: folder from a run without it; test_tpu_plans checks an entry against a live compile.
TPU_PLANS = REPO / "tests" / "tpu_plans"


def seed_plans(cache: pathlib.Path) -> None:
    """Copy TPU_PLANS into ``cache``'s plan cache (unless ``WORKBENCH_TEST_TPU_PLANS=0``,
    as ``make tpu-plans`` runs)."""
    if os.environ.get("WORKBENCH_TEST_TPU_PLANS", "1") == "0" or not TPU_PLANS.is_dir():
        return
    plans = cache / "plans"
    plans.mkdir(parents=True, exist_ok=True)
    for entry in TPU_PLANS.glob("*.json.gz"):
        shutil.copyfile(entry, plans / entry.name)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """The session's one data and compile cache (``WORKBENCH_CACHE``), one per pytest-xdist
    worker, its plan cache seeded with TPU_PLANS: the check that only ``tpu`` tests compile
    TPU plans (below) reads what appeared in it during a test, which another worker's
    writes would falsify."""
    cache = tmp_path_factory.getbasetemp() / "wb-cache"
    seed_plans(cache)
    return cache


@pytest.fixture(scope="session", autouse=True)
def _session_cache(cache_dir):
    """Every test, and every process and kernel a test starts, uses the session's cache:
    compiled steps, TPU plans and corpora are made once per run whatever the order of the
    tests, and nothing reads or writes the user's ``~/.cache/workbench``. Undone when the
    session ends."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBENCH_CACHE", str(cache_dir))
        yield cache_dir


class UnmarkedTPUCompile(pytest.PytestWarning):
    """A test compiled for an abstract TPU slice without the ``tpu`` marker."""


@pytest.fixture(autouse=True)
def _tpu_marker_is_honest(request, cache_dir):
    """Warns (in the summary) when a test not marked ``tpu`` compiled for a TPU slice: each
    such compile writes its plan under ``$WORKBENCH_CACHE/plans``, in this process, a child
    or a kernel. So ``-m "not tpu"`` keeps what it promises on a machine without libtpu.
    (A plan read back from TPU_PLANS writes nothing: those were made by ``tpu`` tests.)"""
    plans = cache_dir / "plans"
    before = set(os.listdir(plans)) if plans.is_dir() else set()
    yield
    new = (set(os.listdir(plans)) if plans.is_dir() else set()) - before
    if new and request.node.get_closest_marker("tpu") is None:
        import warnings

        warnings.warn(UnmarkedTPUCompile(
            f"{request.node.nodeid} compiled {len(new)} plan(s) for a TPU slice: mark it "
            "@pytest.mark.tpu (or use a module fixture's plan from a tpu test)"))


@pytest.fixture
def wb_cache(cache_dir, monkeypatch):
    """Points ``WORKBENCH_CACHE`` at the session's cache for one test (the session already
    does; kept for tests that say so with ``pytest.mark.usefixtures("wb_cache")``)."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(cache_dir))
    return cache_dir


# --- one JupyterLab for every browser test, one Chromium per test module ----------------------

@pytest.fixture(scope="session")
def _lab_server(tmp_path_factory, cache_dir):
    from jupyterlab_harness import require_chromium, start_lab

    require_chromium()
    root = tmp_path_factory.mktemp("lab")
    # the session's XLA_FLAGS (8 devices, FAST_CPU_COMPILE): its kernels compile like
    # every other process of the suite
    env = {"XLA_FLAGS": os.environ["XLA_FLAGS"], "JAX_PLATFORMS": "cpu",
           "WORKBENCH_CACHE": str(cache_dir)}
    with start_lab(root, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def lab(_lab_server):
    """The session's JupyterLab (root ``lab.root_dir``), as each test module first sees it:
    no kernel running and the default layout (the previous module's tabs are not restored).
    Modules share the root: each names its own runs and notebooks."""
    from jupyterlab_harness import reset_lab

    reset_lab(_lab_server)
    return _lab_server


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (a Playwright ``Browser``) for one test module; open a page per
    test. Not session-wide: Playwright's sync API keeps an asyncio loop marked running in
    the main thread while it is open, and every later test that runs a loop there (the
    jupyter_server fixtures of test_server, test_prediction_runs ...) would then fail with
    "This event loop is already running". Starting Chromium takes about a second."""
    from jupyterlab_harness import chromium, require_chromium

    require_chromium()
    with chromium() as b:
        yield b
