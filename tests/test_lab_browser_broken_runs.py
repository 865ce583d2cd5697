"""Real JupyterLab + headless Chromium: a run with unreadable files shows an error badge with
the reason, NaN losses are drawn as gaps, and the other runs stay whole (issue 12)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jupyterlab_harness import Lab, screenshot, show_runs_panel

from workbench import _runs as runs

pytestmark = [pytest.mark.slow, pytest.mark.browser]
NAN_STEPS = {7, 8, 20}  # steps whose loss the file holds as NaN / Infinity


@pytest.fixture(scope="module")
def lab_root(lab: Lab) -> Path:
    """The shared lab's root (conftest's ``lab``) with three runs: good, nan and broken."""
    root = lab.root_dir
    with runs.RunWriter(root / "runs" / "good", config={}) as w:
        for s in range(1, 31):
            w.log({"step": s, "loss": 4.0 / s})
    d = root / "runs" / "nan"
    with runs.RunWriter(d, config={}) as w:
        pass
    lines = []
    for s in range(1, 31):
        loss = {7: "NaN", 8: "Infinity", 20: "-Infinity"}.get(s, repr(4.0 / s))
        lines.append(f'{{"step": {s}, "time": 1.0, "loss": {loss}, "mfu": 0.3}}')
        if s == 10:
            lines.append("[" * 100_000)  # a malformed line between two steps
    (d / runs.METRICS).write_text("\n".join(lines) + "\n")
    broken = root / "runs" / "broken"
    broken.mkdir(parents=True)
    (broken / runs.RUN_JSON).write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    return root


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    p = browser.new_page(viewport={"width": 1400, "height": 900})
    yield p
    p.close()


def _attr(page: Any, selector: str, attr: str, value: str, timeout: float = 30) -> None:
    page.wait_for_function(
        "([sel, attr, v]) => document.querySelector(sel)?.getAttribute(attr) === v",
        arg=[selector, attr, value], timeout=timeout * 1000)


def test_broken_run_badge_and_nan_gaps(lab: Lab, page: Any, lab_root: Path) -> None:
    page.goto(f"{lab.url}/lab?token={lab.token}", timeout=60_000)
    page.wait_for_selector(".jp-LabShell", timeout=60_000)
    panel = show_runs_panel(page)
    row = ".jp-Workbench-run[data-id='{}']"
    for rid in ("runs/good", "runs/nan", "runs/broken"):
        panel.locator(row.format(rid)).wait_for(timeout=15_000)
    broken = panel.locator(row.format("runs/broken"))
    assert broken.locator(".jp-Workbench-status").inner_text() == "error"
    badge = broken.locator(".jp-Workbench-problemBadge")
    assert badge.is_visible()
    reason = badge.get_attribute("title")
    with pytest.raises(runs.RunFileError) as e:
        runs.read_run(lab_root / "runs" / "broken")
    assert reason == str(e.value)  # the reader's own words

    good = panel.locator(row.format("runs/good"))
    assert good.locator(".jp-Workbench-problemBadge").is_hidden()
    assert good.locator(".jp-Workbench-step").inner_text() == "step 30"
    nan = panel.locator(row.format("runs/nan"))
    assert "line 11: nested" in nan.locator(".jp-Workbench-problemBadge").get_attribute("title")
    spark = row.format("runs/nan") + " canvas.jp-Workbench-spark"
    _attr(page, spark, "data-gaps", str(len(NAN_STEPS)))
    assert page.locator(spark).get_attribute("data-points") == str(30 - len(NAN_STEPS))

    nan.click()
    chart = ".jp-Workbench-dashboard[data-run-id='runs/nan'] .jp-Workbench-lossChart"
    _attr(page, chart, "data-points", str(30 - len(NAN_STEPS)))
    assert page.locator(chart).get_attribute("data-gaps") == str(len(NAN_STEPS))
    assert page.locator(chart).get_attribute("data-last-step") == "30"
    problem = page.locator(".jp-Workbench-dashboard[data-run-id='runs/nan'] .jp-Workbench-problem")
    assert "skipped line 11" in problem.inner_text()
    broken.click()
    head = page.locator(".jp-Workbench-dashboard[data-run-id='runs/broken'] .jp-Workbench-problem")
    head.wait_for(timeout=15_000)
    assert "not UTF-8" in head.inner_text()
    screenshot(page, "workbench_panel_broken_runs")
