"""Real JupyterLab + headless Debian Chromium: the Workbench panel, dashboard, comparison,
status bar, escaping and layout restoration, with runs written by the Trainer and RunWriter."""
from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jupyterlab_harness import Lab, run_notebook, screenshot, show_runs_panel

from workbench import _runs as runs

pytestmark = [pytest.mark.slow, pytest.mark.browser]

REPO = Path(__file__).resolve().parent.parent
EVIL = "<img src=x onerror=alert(1)>"
TRAIN_CELLS = [
    "import workbench as wb",
    ("config = wb.TrainConfig(model='tiny', mesh={'data': 8}, data='synthetic', batch=8, seq=32,\n"
     "                        steps=30, checkpoint_every=30)\n"
     "trainer = wb.Trainer(config, run_dir='runs/tiny')"),
    "trainer.run(steps=30)\nassert trainer.step == 30, trainer.step",
]


def _notebook(path: Path, cells: list[str]) -> None:
    path.write_text(json.dumps({
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None,
                   "outputs": [], "source": src} for i, src in enumerate(cells)],
    }))


class LiveRun:
    """A run written by RunWriter from a thread, one step every `period` seconds."""

    def __init__(self, run_dir: Path, name: str | None = None, period: float = 0.1,
                 scale: float = 4.0) -> None:
        self.scale = scale
        self.writer = runs.RunWriter(run_dir, config={"model": "tiny", "note": EVIL}, name=name,
                                     meta={"target_steps": 10_000,
                                           "memory_per_device": {"argument": 2**20, "temp": 3 * 2**20}})
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period,), daemon=True)
        self._thread.start()

    def _loop(self, period: float) -> None:
        while not self._stop.wait(period):
            self.step += 1
            s = self.step
            self.writer.log({"step": s, "loss": self.scale / (1 + 0.05 * s), "mfu": 0.2 + 0.001 * (s % 50),
                             "hfu": 0.25, "step_time": 0.1, "data_time": 0.01, "ckpt_time": 0.0,
                             "tokens_per_s": 1000.0 + s})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.writer.close("finished")


@pytest.fixture(scope="module")
def lab_root(lab: Lab) -> Path:
    """The shared lab's root: this module's runs are runs/<name> there, its notebooks
    <name>.ipynb (conftest's ``lab``: one JupyterLab for every browser test)."""
    return lab.root_dir


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    p = browser.new_page(viewport={"width": 1400, "height": 900})
    p.dialogs = []  # type: ignore[attr-defined]

    def on_dialog(d: Any) -> None:
        if d.type == "beforeunload":  # leaving a page with a notebook open: go on
            d.accept()
        else:  # alert/confirm/prompt: what an injected script would open
            p.dialogs.append(f"{d.type}: {d.message}")
            d.dismiss()

    p.on("dialog", on_dialog)
    yield p
    p.close()


def _open_lab(page: Any, lab: Lab) -> None:
    page.goto(f"{lab.url}/lab?token={lab.token}", timeout=60_000)
    page.wait_for_selector(".jp-LabShell", timeout=60_000)


def _wait_saved(lab: Lab, text: str, timeout: float = 20) -> None:
    """Waits until JupyterLab saved its layout holding `text` (the restorer's state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{lab.url}/lab/api/workspaces/default",
                                     headers={"Authorization": f"token {lab.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            if text in resp.read().decode():
                return
        time.sleep(0.25)
    raise TimeoutError(f"the workspace never saved {text!r}")


def _wait_attr(page: Any, selector: str, attr: str, minimum: float, timeout: float = 30) -> float:
    """Waits until a numeric data attribute of `selector` reaches `minimum`; returns it."""
    page.wait_for_function(
        "([sel, attr, min]) => { const e = document.querySelector(sel);"
        " return e && Number(e.getAttribute(attr)) >= min; }",
        arg=[selector, attr, minimum], timeout=timeout * 1000)
    return float(page.locator(selector).first.get_attribute(attr))


def test_jest_models() -> None:
    """The TypeScript models' jest tests (series, smoothing, decimation, list/run models)."""
    ext = REPO / "labextension"
    if not (ext / "node_modules").is_dir():
        pytest.skip("labextension/node_modules is missing: `make install` runs npm install")
    out = subprocess.run([shutil.which("npx") or "npx", "jest", "--ci"], cwd=ext,
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_trained_run_shows_in_panel_and_dashboard(lab: Lab, page: Any, lab_root: Path) -> None:
    """A notebook trains 'tiny' for 30 steps; the panel lists it and its charts hold 30 points."""
    _notebook(lab_root / "train.ipynb", TRAIN_CELLS)
    run_notebook(page, lab, lab_root / "train.ipynb", timeout=150)
    assert runs.read_run(lab_root / "runs" / "tiny")["status"] == "finished"
    panel = show_runs_panel(page)
    row = panel.locator(".jp-Workbench-run[data-id='runs/tiny']")
    row.wait_for(timeout=15_000)
    page.wait_for_function(
        "() => document.querySelector(\".jp-Workbench-run[data-id='runs/tiny'] "
        ".jp-Workbench-step\")?.textContent === 'step 30 / 30'", timeout=15_000)
    spark = _wait_attr(page, ".jp-Workbench-run[data-id='runs/tiny'] canvas.jp-Workbench-spark",
                       "data-points", 30)
    assert spark == 30
    page.wait_for_function(  # the run's closing run.json reaches the panel too
        "() => document.querySelector(\".jp-Workbench-run[data-id='runs/tiny'] "
        ".jp-Workbench-status\")?.textContent === 'finished'", timeout=15_000)
    row.click()
    chart = ".jp-Workbench-dashboard[data-run-id='runs/tiny'] .jp-Workbench-lossChart"
    assert _wait_attr(page, chart, "data-points", 30) == 30
    last = runs.read_metrics(lab_root / "runs" / "tiny")[-1]
    dash = page.locator(".jp-Workbench-dashboard[data-run-id='runs/tiny']")
    kpis = dash.locator(".jp-Workbench-kpis").inner_text()
    assert f"{last['mfu'] * 100:.1f}%" in kpis, kpis  # MFU of the last step, as the file says
    assert "argument" in dash.locator(".jp-Workbench-memory").inner_text()
    assert "synthetic" in dash.locator(".jp-Workbench-config").inner_text()
    page.wait_for_function(  # the status bar follows the current dashboard's run
        "(mfu) => document.querySelector('.jp-Workbench-statusItem')?.textContent"
        " === 'tiny · step 30 / 30 · MFU ' + mfu", arg=f"{last['mfu'] * 100:.1f}%",
        timeout=15_000)
    shot = screenshot(page, "workbench_panel_trained_run")
    assert shot.stat().st_size > 10_000


# The plan's prediction as Trainer.from_plan records it (plan.predicted.to_dict() + where from)
PREDICTION = {"step_seconds": 0.08, "mfu": 0.3, "tokens_per_s": 3200.0, "bound": "compute",
              "compiler_seconds": None, "source": "cpu-compiler", "plan_name": "tiny",
              "source_reason": "compiled for the real mesh", "hardware": "cpu",
              "breakdown": {"compute": 0.08, "memory": 0.02, "communication": 0.0,
                            "collectives": []}, "sources": {"flops": "cost analysis"},
              # how sure: measured steps were 0.9-1.2x the predicted (Prediction.band)
              "band": {"low": 0.9, "high": 1.2, "basis": "calibration",
                       "summary": "from 2 calibration layouts, measured/predicted 0.90-1.20x",
                       "source": "the calibration's residuals"}}


# trainer.profile()'s report.json (ProfileReport.to_dict()) against PREDICTION's terms
PROFILE_ROWS = [("compute", 0.08, 0.05, "", []), ("memory", 0.02, 0.061, "", []),
                ("all-reduce over data", 0.0, 0.004, "all-reduce", ["data"]),
                ("overlap (hidden)", 0.0, 0.002, "", []), ("idle + host", 0.0, 0.003, "", []),
                ("step", 0.08, 0.116, "", [])]
PROFILE = {"plan_name": "tiny", "mesh": {"data": 8}, "steps": 3, "calibrated": False,
           "tokens_per_s": {"outside": 2800.0, "during": 2600.0},
           "verdict": "largest disagreement: memory took 61 ms per step, 3x the predicted "
                      "20 ms (41 ms longer, 35% of the measured 116 ms step)",
           "rows": [{"name": n, "predicted": p, "measured": m, "kind": k, "axes": a,
                     "count": 2 if k else 0, "note": "", "wait": 0.0}
                    for n, p, m, k, a in PROFILE_ROWS],
           "top_ops": [{"name": "dot.3", "category": "compute", "seconds": 0.01,
                        "source": "gpt.py:40"}]}


def _planned_run(run_dir: Path, prediction: dict[str, Any] | str) -> list[dict[str, Any]]:
    """A finished 30-step run with a prediction (a dict as recorded, or raw JSON text as a
    person might edit it into run.json); returns its step records."""
    meta = {"prediction": prediction} if isinstance(prediction, dict) else {}
    recs = [{"step": s, "loss": 4.0 / (1 + 0.05 * s), "mfu": 0.2 + 0.01 * (s % 5),
             "hfu": 0.25, "step_time": 0.09 + 0.005 * (s % 7), "data_time": 0.01,
             "ckpt_time": 0.0, "tokens_per_s": 3000.0} for s in range(1, 31)]
    with runs.RunWriter(run_dir, config={"model": "tiny"}, meta=meta) as w:
        for rec in recs:
            w.log(rec)
    if isinstance(prediction, str):
        text = (run_dir / runs.RUN_JSON).read_text().rstrip()
        (run_dir / runs.RUN_JSON).write_text(text[:-1] + f', "prediction": {prediction}}}')
    return recs


def test_dashboard_shows_the_plan_prediction_beside_measured(lab: Lab, page: Any,
                                                             lab_root: Path) -> None:
    """A run with the plan's prediction: the list hints at it; the dashboard's step-time and
    MFU cards show predicted and measured ÷ predicted, and both charts a dashed predicted line;
    its profile (profiles/27/report.json) one predicted and one measured bar per term, the
    largest disagreement marked and named. A hand-edited, malformed prediction (NaN,
    strings) shows as none and breaks nothing."""
    recs = _planned_run(lab_root / "runs" / "planned", PREDICTION)
    (lab_root / "runs" / "planned" / "profiles" / "27").mkdir(parents=True)
    (lab_root / "runs" / "planned" / "profiles" / "27" / "report.json").write_text(
        json.dumps(PROFILE))
    _planned_run(lab_root / "runs" / "hand-edited",
                 '{"step_seconds": NaN, "mfu": "31%", "bound": 3, "breakdown": "x"}')
    _open_lab(page, lab)
    panel = show_runs_panel(page)
    hint = panel.locator(".jp-Workbench-run[data-id='runs/planned'] .jp-Workbench-pred")
    hint.wait_for(timeout=15_000)
    assert "pred. 80 ms/step (72 ms–96 ms) · MFU 30.0% (cpu-compiler)" in \
        hint.get_attribute("title")
    bad_row = panel.locator(".jp-Workbench-run[data-id='runs/hand-edited']")
    bad_row.wait_for(timeout=15_000)
    assert bad_row.locator(".jp-Workbench-pred").is_hidden()
    assert bad_row.locator(".jp-Workbench-step").inner_text() == "step 30"

    panel.locator(".jp-Workbench-run[data-id='runs/planned']").click()
    dash = ".jp-Workbench-dashboard[data-run-id='runs/planned']"
    assert _wait_attr(page, f"{dash} .jp-Workbench-lossChart", "data-points", 30) == 30
    recent = lambda key: statistics.median(r[key] for r in recs[-20:])  # noqa: E731
    step_card = page.locator(f"{dash} .jp-Workbench-kpi", has_text="step time")
    step_card.locator(".jp-Workbench-kpiPred").wait_for(timeout=15_000)
    ratio = recent("step_time") / PREDICTION["step_seconds"]
    assert step_card.locator(".jp-Workbench-kpiPred").inner_text() == \
        f"pred. {PREDICTION['step_seconds'] * 1e3:.0f} ms (72 ms–96 ms) · measured {ratio:.3g}×"
    assert "compute-bound" in step_card.get_attribute("title")
    assert "band 72 ms–96 ms, from 2 calibration layouts" in step_card.get_attribute("title")
    mfu_card = page.locator(f"{dash} .jp-Workbench-kpi", has_text="MFU").first
    ratio = recent("mfu") / PREDICTION["mfu"]
    assert mfu_card.locator(".jp-Workbench-kpiPred").inner_text() == \
        f"pred. {PREDICTION['mfu'] * 100:.1f}% (25.0%–33.3%) · measured {ratio:.3g}×"
    charts = page.locator(f"{dash} .jp-Workbench-chart")
    time_chart = charts.filter(has_text="Step time breakdown")
    util_chart = charts.filter(has_text="Utilization")
    assert float(time_chart.get_attribute("data-predicted")) == PREDICTION["step_seconds"]
    assert float(util_chart.get_attribute("data-predicted")) == PREDICTION["mfu"]
    for chart, label in ((time_chart, "predicted"), (util_chart, "predicted MFU")):
        entry = chart.locator(".u-legend .jp-Workbench-predicted")
        assert entry.is_visible() and label in entry.inner_text()
    assert "predicted by plan tiny · cpu-compiler on cpu" in page.locator(
        f"{dash} .jp-Workbench-facts").inner_text()
    prof = page.locator(f"{dash} .jp-Workbench-profile[data-profile='27']")
    prof.wait_for(timeout=15_000)
    rows = prof.locator(".jp-Workbench-profileRow")
    assert rows.count() == len(PROFILE_ROWS)
    for i, (name, pred, meas, _, _) in enumerate(PROFILE_ROWS):
        row = rows.nth(i)
        assert row.get_attribute("data-term") == name == row.locator(
            ".jp-Workbench-profileName").inner_text()
        assert (float(row.get_attribute("data-predicted")),
                float(row.get_attribute("data-measured"))) == (pred, meas)
        widths = [b.evaluate("e => e.getBoundingClientRect().width")
                  for b in row.locator(".jp-Workbench-profileBar").all()]
        if pred:   # both bars on one scale
            assert widths[1] == pytest.approx(widths[0] * meas / pred, rel=0.02, abs=1.5)
    worst = max(PROFILE_ROWS[:-1], key=lambda r: abs(r[2] - r[1]))[0]
    assert prof.locator(".jp-Workbench-profileRow.jp-mod-worst").get_attribute(
        "data-term") == worst == "memory"
    assert prof.locator(".jp-Workbench-profileVerdict").inner_text() == PROFILE["verdict"]
    assert "profiler overhead +8%" in prof.inner_text()    # 2800 / 2600 tokens/s
    screenshot(prof, "workbench_dashboard_profile")
    screenshot(page, "workbench_dashboard_predicted")

    panel.locator(".jp-Workbench-run[data-id='runs/hand-edited']").click()
    bad = ".jp-Workbench-dashboard[data-run-id='runs/hand-edited']"
    assert _wait_attr(page, f"{bad} .jp-Workbench-lossChart", "data-points", 30) == 30
    assert page.locator(f"{bad} .jp-Workbench-kpiPred").count() == 0
    bad_time = page.locator(f"{bad} .jp-Workbench-chart").filter(has_text="Step time breakdown")
    assert "jp-mod-noPrediction" in bad_time.get_attribute("class")
    assert bad_time.get_attribute("data-predicted") is None
    assert bad_time.locator(".u-legend .jp-Workbench-predicted").is_hidden()
    assert page.dialogs == []


INLINE_CELLS = [
    "import workbench as wb",
    ("config = wb.TrainConfig(model='tiny', mesh={'data': 8}, data='synthetic', batch=8, seq=32,\n"
     "                        steps=24, checkpoint_every=12)\n"
     "run_dir = 'runs/inline-{frontend}'\n"
     "wb.Trainer(config, run_dir=run_dir).run(steps=12)"),
    "wb.Trainer(config, run_dir=run_dir).run()  # a new Trainer: resumes at step 12",
]


def _path_points(path: Any) -> int:
    """Points of a chart's SVG path ("M x,y L x,y ...")."""
    return len(re.findall(r"[ML]", path.get_attribute("d") or ""))


@pytest.mark.parametrize("frontend", ["lab", "notebook"])
def test_inline_panel_live_then_whole_curve_after_resume(lab: Lab, page: Any, lab_root: Path,
                                                         frontend: str) -> None:
    """trainer.run's inline panel, in JupyterLab and in Notebook 7: steps, status and curves;
    after a resume (a new Trainer on the run directory) it draws the whole run from step 1."""
    cells = [c.replace("{frontend}", frontend) for c in INLINE_CELLS]
    nb = lab_root / f"inline-{frontend}.ipynb"
    _notebook(nb, cells)
    run_notebook(page, lab, nb, timeout=180, frontend=frontend)
    if frontend == "notebook":  # Notebook 7's own shell, not JupyterLab's
        assert "/notebooks/" in page.url and page.locator(".jp-LabShell").count() == 0
    metrics = runs.read_metrics(lab_root / "runs" / f"inline-{frontend}")
    assert [r["step"] for r in metrics] == list(range(1, 25))
    panels = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .wb-train")
    panels.nth(1).wait_for(timeout=30_000)
    assert panels.count() == 2
    first, resumed = panels.nth(0), panels.nth(1)
    for panel, step in ((first, 12), (resumed, 24)):   # each run's target is its last step
        page.wait_for_function(  # the last batched update has arrived
            "([el, want]) => el.querySelector('.wb-facts').textContent.startsWith(want)",
            arg=[panel.element_handle(), f"step {step}/{step}"], timeout=15_000)
        assert panel.locator(".wb-status").inner_text() == "finished"
        loss = panel.locator("svg.wb-chart").first
        assert _path_points(loss.locator("path.wb-chart-path")) == step   # every step drawn
        labels = loss.locator("text").all_text_contents()
        assert "step 1" in labels and f"step {step}" in labels, labels   # from step 1
    facts, last = resumed.locator(".wb-facts").inner_text(), metrics[-1]["loss"]
    # the file's last loss as the panel prints it (JS toPrecision(4): 3 decimals in [1, 10))
    assert 1 <= last < 10 and f"loss {last:.3f}" in facts, facts
    screenshot(resumed, f"inline_panel_{frontend}")


def test_live_run_escaping_compare_and_restore(lab: Lab, page: Any, lab_root: Path) -> None:
    """A run written live by RunWriter streams into the panel and dashboard; a hostile run
    name shows as text; two runs compare on one chart; a reload restores the dashboard."""
    live = LiveRun(lab_root / "runs" / "live", period=0.1)
    evil = LiveRun(lab_root / "runs" / "evil", name=EVIL, period=0.2, scale=6.0)
    try:
        _open_lab(page, lab)
        panel = show_runs_panel(page)
        name = panel.locator(".jp-Workbench-run[data-id='runs/evil'] .jp-Workbench-runName")
        name.wait_for(timeout=15_000)
        assert name.inner_text() == EVIL  # shown literally ...
        assert panel.locator("img").count() == 0  # ... and never parsed as markup
        panel.locator(".jp-Workbench-run[data-id='runs/live']").click()
        chart = ".jp-Workbench-dashboard[data-run-id='runs/live'] .jp-Workbench-lossChart"
        target = live.step + 20  # two more seconds of training must arrive while we watch
        assert _wait_attr(page, chart, "data-last-step", target) >= target
        dash = page.locator(".jp-Workbench-dashboard[data-run-id='runs/live']")
        assert EVIL in dash.locator(".jp-Workbench-config").inner_text()
        for run_id in ("runs/live", "runs/evil"):
            panel.locator(f".jp-Workbench-run[data-id='{run_id}'] input[type=checkbox]").check()
        panel.locator("button", has_text="Compare").click()
        lines = ".jp-Workbench-compare .jp-Workbench-compareLines"
        page.wait_for_function(  # one line per run, each with its own points
            "(sel) => { const p = document.querySelector(sel)?.dataset.seriesPoints;"
            " return p && p.split(',').length === 2 && p.split(',').every(n => Number(n) >= 10); }",
            arg=lines, timeout=15_000)
        legend = page.locator(f"{lines} .u-legend").inner_text()
        assert EVIL in legend and page.locator(f"{lines} img").count() == 0
        screenshot(page, "workbench_compare_live")
        _wait_saved(lab, "\"workbench-compare:")
        page.reload()
        page.wait_for_selector(".jp-LabShell", timeout=60_000)
        # layout restoration: comparison and dashboard come back, refilled from history
        _wait_attr(page, lines, "data-points", 10)
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab").filter(
            has_text=re.compile(r"^live$")).click()
        assert _wait_attr(page, chart, "data-points", 30) >= 30
        assert page.dialogs == []  # no alert(1) fired anywhere
    finally:
        live.stop()
        evil.stop()
    steps = [r["step"] for r in runs.read_metrics(lab_root / "runs" / "live")]
    assert steps == list(range(1, live.step + 1))
    try:  # every step written, each drawn once: nothing lost or doubled across the reload
        page.wait_for_function(f"(n) => Number(document.querySelector(\"{chart}\")"
                               "?.dataset.points) === n", arg=len(steps), timeout=15_000)
    except PlaywrightTimeout:
        got = page.locator(chart).get_attribute("data-points")
        raise AssertionError(f"chart shows {got} points, the run has {len(steps)}") from None
    screenshot(page, "workbench_dashboard_live")


def test_extension_is_installed_and_enabled() -> None:
    jupyter = str(Path(sys.executable).parent / "jupyter")
    labext = subprocess.run([jupyter, "labextension", "list"], capture_output=True, text=True,
                            check=True)
    line = next((ln for ln in (labext.stdout + labext.stderr).splitlines()
                 if "workbench-lab" in ln), "")
    assert "enabled" in line and "OK" in line, labext.stdout + labext.stderr
