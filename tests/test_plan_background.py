"""Plans and searches that never hold the notebook (issue 59 items 1 and 2):
``wb.plan(wait=False)`` returns the formula's plan at once while a worker process compiles
the step, and the same plan (and its widget) turns into the compiler's numbers when they
land; ``wb.search(wait=False)`` returns the formula's ranking and re-ranks as each compile
lands. Checked against the blocking plan and search (the same numbers, the same program),
the formula's plan (``compile=False``), a worker cancelled (its process gone), interrupted
(SIGINT, as a kernel interrupt sends) and killed with SIGKILL (a clear error, the formula
plan still usable), and the plan cache a background compile writes for a blocking plan."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

import workbench as wb
from _tpu import tpu
from workbench.models import GPTConfig
from workbench.planning import _background as background

TINY = GPTConfig.preset("tiny")
#: the plan of every case: wb.plan's arguments besides the mesh
PLAN = dict(rules="fsdp_tp", batch=8, seq=64, progress=False)


@pytest.fixture(scope="module")
def mesh():
    return wb.make_mesh(data=4, model=2)


def _program(hlo: str) -> str:
    """The compiled program's text without source locations (the worker traced the same
    step from other files: its stack-frame tables and op metadata name them)."""
    hlo = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", "\n",
                 hlo)
    return re.sub(r", metadata=\{[^}]*\}", "", hlo)


def _until(predicate, seconds: float = 120.0) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- the formula now, the compiler's numbers when they land ------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
def test_background_plan_is_the_formulas_then_the_blocking_plans(mesh):
    from workbench.widgets._plan_view import PlanView

    formula = wb.plan(TINY, mesh=mesh, compile=False, **PLAN)
    p = wb.plan(TINY, mesh=mesh, wait=False, **PLAN)
    # returned before the compile: the formula's plan, said so
    assert p.compile_state in ("queued", "compiling") and not p.ready
    assert p.source == "estimate" and "background worker process" in p.source_reason
    assert p.memory == formula.memory and p.formula is p.report and p.changes == []
    assert p.predicted.step_seconds == formula.predicted.step_seconds
    view = PlanView(p)                       # the widget drawn before the compile is in
    assert view.summary.payload["background"]["state"] in ("queued", "compiling")
    assert view.summary.payload["estimate"] is True

    assert p.wait() is p and p.ready and p.compile_state == "compiled"
    blocking = wb.plan(TINY, mesh=mesh, **PLAN)
    assert p.source == blocking.source == "cpu-compiler"
    assert p.memory == blocking.memory and p.memory != formula.memory
    assert p.compiled.memory_analysis().temp_size_in_bytes == \
        blocking.compiled.memory_analysis().temp_size_in_bytes
    assert _program(p.compiled.as_text()) == _program(blocking.compiled.as_text())
    assert p.predicted.step_seconds == blocking.predicted.step_seconds
    assert [c.to_dict() for c in p.collectives] == [c.to_dict() for c in blocking.collectives]
    assert p.formula.memory == formula.memory     # the formula's report is kept
    changes = {c["what"]: c for c in p.changes}
    assert changes["memory"]["formula"] == formula.memory["total"]
    assert changes["memory"]["compiled"] == blocking.memory["total"]
    assert changes["step"]["compiled"] == blocking.predicted.step_seconds
    assert changes["fits"]["compiled"] == blocking.fits
    # the same widget, redrawn with the compiler's numbers and what changed
    payload = view.summary.payload
    assert payload["background"]["state"] == "compiled" and payload["estimate"] is False
    assert payload["memory"]["total"] == blocking.memory["total"]
    assert payload["background"]["changes"] == [c["text"] for c in p.changes]
    assert p.train_step() is p.jitted       # runnable: compiled here on its first call


@pytest.mark.slow
def test_devices_a_worker_cannot_open_compile_in_a_thread(mesh, monkeypatch):
    """A GPU or TPU the kernel holds: the compile runs in a thread of this process, with
    the same answer as a blocking plan (CPU devices stand in: the switch is the mesh's
    platform, ``_planner._in_worker``)."""
    from workbench.planning import _planner

    monkeypatch.setattr(_planner, "_in_worker", lambda info: False)
    p = wb.plan(TINY, mesh=mesh, wait=False, **PLAN)
    assert p.source == "estimate" and "background thread" in p.source_reason
    p.wait()
    blocking = wb.plan(TINY, mesh=mesh, **PLAN)
    assert p.source == "cpu-compiler" and p.memory == blocking.memory
    assert p.compiled is blocking.compiled     # this process's compile cache: one compile
    assert p.__dict__["_background"].pid is None


def test_widget_says_formula_then_what_the_compiler_changed(tmp_path, mesh):
    """The plan widget's front end draws the background state and the changes."""
    import json
    import shutil
    import subprocess
    from pathlib import Path

    from workbench.widgets import _assets
    from workbench.widgets._plan_view import plan_payload

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (needed to run the widget ESM)")
    payload = plan_payload(wb.plan(TINY, mesh=mesh, compile=False, **PLAN))
    states = {"compiling": dict(state="compiling", text="the formula's numbers; compiling",
                                since=0.0, changes=[]),
              "compiled": dict(state="compiled", text="the compiler's numbers", since=0.0,
                               changes=["memory: 2 MiB -> 3 MiB (+50%)"])}
    (tmp_path / "plan.mjs").write_text(_assets.esm("plan"))
    texts = {}
    for name, bg in states.items():
        state = {"payload": dict(payload, background=bg), "tab": "overview",
                 "selected_collective": -1, "collective_note": ""}
        (tmp_path / "state.json").write_text(json.dumps(state))
        out = subprocess.run([node, str(Path(__file__).parent / "widgets_js" / "render.mjs"),
                              str(tmp_path / "plan.mjs"), str(tmp_path / "state.json")],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        texts[name] = json.loads(out.stdout)["text"]
    assert "FORMULA — compiling in the background" in texts["compiling"]
    assert "formula → compiler: memory: 2 MiB -> 3 MiB (+50%)" in texts["compiled"]
    assert "FORMULA" not in texts["compiled"]


# -- cancelled, interrupted, killed ------------------------------------------------------------

def _compiling(mesh, progress=False):
    p = wb.plan(TINY, mesh=mesh, wait=False, **dict(PLAN, progress=progress))
    bg = p.__dict__["_background"]
    _until(lambda: bg.pid is not None or bg.done)
    assert bg.pid is not None and not bg.done
    return p, bg.pid


@pytest.mark.multiprocess
def test_cancel_kills_the_worker_and_keeps_the_formula(mesh):
    formula = wb.plan(TINY, mesh=mesh, compile=False, **PLAN)
    p, pid = _compiling(mesh)
    p.cancel()
    assert _gone(pid) and p.ready and p.compile_state == "cancelled"
    with pytest.raises(RuntimeError, match="cancelled"):
        p.wait()
    assert p.memory == formula.memory and p.source == "estimate"
    assert p.predicted.step_seconds == formula.predicted.step_seconds


@pytest.mark.multiprocess
def test_an_interrupt_while_waiting_cancels_the_compile(mesh):
    p, pid = _compiling(mesh)
    # what Ctrl-C in a terminal and a kernel interrupt send: SIGINT to this process
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        p.wait()
    assert _gone(pid) and p.compile_state == "cancelled"


@pytest.mark.multiprocess
def test_a_killed_worker_is_a_clear_error_and_the_formula_plan_works(mesh, capsys):
    formula = wb.plan(TINY, mesh=mesh, compile=False, **PLAN)
    p, pid = _compiling(mesh, progress=True)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"killed by signal 9 \(SIGKILL.*out-of-memory"
                                           r"(.|\n)*formula's numbers"):
        p.wait()
    said = capsys.readouterr().err.splitlines()      # progress: the line, then how it ended
    assert "wb.plan('fsdp_tp'): the formula's numbers now; the cpu compiler" in said[0]
    assert said[-1] == "wb.plan('fsdp_tp'): the background compile failed (plan.wait() " \
        "raises why)"
    assert p.compile_state == "failed" and p.ready
    assert p.memory == formula.memory and p.source == "estimate"
    assert p.predicted.step_seconds == formula.predicted.step_seconds
    assert p.materialize(seed=0) is not None    # the formula plan still builds the model


@pytest.mark.multiprocess
def test_a_worker_without_the_meshs_devices_says_how_to_start_it(mesh, monkeypatch):
    """The worker looks the mesh's devices up by id among its own: a worker started with
    fewer (another XLA_FLAGS) names the device it lacks and the fix."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    p = wb.plan(TINY, mesh=mesh, wait=False, **PLAN)
    with pytest.raises(RuntimeError, match=r"sees 4 cpu device\(s\).*not device [4-7] of the "
                                           r"plan's mesh(.|\n)*XLA_FLAGS"):
        p.wait()
    assert p.compile_state == "failed" and p.source == "estimate"


@pytest.mark.multiprocess
def test_compiles_wait_for_a_free_core(mesh, monkeypatch):
    """Beyond one compile per core, a plan is queued (no worker yet) until a slot frees."""
    monkeypatch.setattr(background, "_SLOTS", threading.BoundedSemaphore(1))
    first, pid = _compiling(mesh)
    second = wb.plan(TINY, mesh=mesh, wait=False, **PLAN)
    time.sleep(0.5)
    assert second.compile_state == "queued" and second.__dict__["_background"].pid is None
    second.cancel()                          # cancelled while queued: no worker ever started
    first.cancel()
    assert second.compile_state == "cancelled" and _gone(pid)
    assert background.slots() == (os.cpu_count() or 1)


# -- the plan cache: a background compile writes what a blocking plan reads -------------------

@tpu
@pytest.mark.slow
@pytest.mark.multiprocess
def test_background_compile_writes_the_record_a_blocking_plan_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))   # empty: nothing to read back
    pod = wb.abstract_mesh("v5e-8", data=4, model=2)
    p = wb.plan(TINY, mesh=pod, wait=False, **PLAN).wait()
    assert p.source == "tpu-compiler" and not p.report.compile_cached
    assert len(list((tmp_path / "plans").glob("*.json.gz"))) == 1
    blocking = wb.plan(TINY, mesh=pod, **PLAN)
    assert blocking.report.compile_cached                         # read from the worker's record
    assert blocking.memory == p.memory
    assert blocking.compiled.as_text() == p.compiled.as_text()
    assert blocking.predicted.step_seconds == p.predicted.step_seconds


# -- a search that re-ranks live ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
def test_live_search_reranks_as_compiles_land_and_ends_as_the_blocking_search():
    from workbench.widgets._search_view import SearchView

    # tp ranks first by formula and second compiled (dp's compiled step is faster):
    # compiled one at a time, the table's order changes when dp lands
    kw = dict(batch=16, seq=128, strategies=("dp", "tp"), remat=("none",), exact="all",
              workers=1, memory_limit=2 ** 30, progress=False)
    devices = wb.make_mesh(data=8)
    live = wb.search(TINY, devices, wait=False, **kw)
    orders = [[r["layout"] for r in live.rows]]
    live._watch(lambda: orders.append([r["layout"] for r in live.rows]))
    view = SearchView(live)
    assert live.compile_state in ("queued", "compiling")
    assert all(r["source"] == "estimate" and r["exact_rank"] is None for r in live.rows)
    assert view.table.payload["live"]["exact_best"] is False
    formula = orders[0]

    assert live.wait() is live and live.compile_state == "compiled"
    blocking = wb.search(TINY, devices, **kw)
    assert [dict(r) for r in live.rows] == [dict(r) for r in blocking.rows]
    assert live.rank_changes == blocking.rank_changes and live.notes == blocking.notes
    final = [r["layout"] for r in blocking.rows]
    assert formula != final and orders[-1] == final
    assert formula[0].startswith("tp") and final[0].startswith("dp")
    assert view.table.payload["rows"][0]["layout"] == final[0]
    assert view.table.payload["live"]["exact_best"] is True
    assert live.best.memory == blocking.best.memory


@pytest.mark.multiprocess
def test_cancelled_search_keeps_the_formula_ranking():
    kw = dict(batch=16, seq=128, strategies=("dp", "tp"), remat=("none",), exact="all",
              workers=1, memory_limit=2 ** 30, progress=False)
    live = wb.search(TINY, wb.make_mesh(data=8), wait=False, **kw)
    _until(lambda: live.__dict__["_background"].state == "compiling")
    live.cancel()
    live.__dict__["_background"].thread.join(60)   # the pass stops at once
    assert not live.__dict__["_background"].thread.is_alive()
    assert live.compile_state == "cancelled" and live.ready
    with pytest.raises(RuntimeError, match="cancelled"):
        live.wait()
    assert all(r["analytic_rank"] is not None for r in live.rows)


# -- what wait= and timeout= take ----------------------------------------------------------------

@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, [False]])
def test_wait_must_be_a_bool(value, mesh):
    with pytest.raises(TypeError, match="wait"):
        wb.plan(TINY, mesh=mesh, wait=value, **PLAN)
    with pytest.raises(TypeError, match="wait"):
        wb.search(TINY, "v5p-8", batch=8, seq=16, strategies=("dp",), remat=("none",),
                  exact=False, progress=False, wait=value)


def test_wait_false_with_nothing_to_compile_is_whole_at_once(mesh):
    p = wb.plan(TINY, mesh=mesh, compile=False, wait=False, **PLAN)
    assert p.compile_state is None and p.ready and p.wait() is p and p.formula is None
    res = wb.search(TINY, "v5p-8", batch=8, seq=16, strategies=("dp",), remat=("none",),
                    exact=False, progress=False, wait=False)
    assert res.compile_state is None and res.ready and res.wait() is res


@pytest.mark.parametrize("timeout, error", [("5", TypeError), (True, TypeError),
                                            (-1, ValueError), (float("nan"), ValueError)])
def test_wait_timeout_is_checked(timeout, error, mesh):
    p = wb.plan(TINY, mesh=mesh, compile=False, **PLAN)
    with pytest.raises(error, match="timeout"):
        p.wait(timeout)


@pytest.mark.multiprocess
def test_wait_timeout_leaves_the_compile_running(mesh):
    p, pid = _compiling(mesh)
    with pytest.raises(TimeoutError, match="still compiling"):
        p.wait(timeout=0.1)
    assert not p.ready and not _gone(pid)
    p.cancel()
