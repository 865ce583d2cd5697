"""The ``wb.compare`` figure, drawn by plotly.js in headless Chromium, is readable: its panel
titles, strategy names, axis ticks and legend never overlap one another, at the widths of a
JupyterLab output area (a 1600 px window, and a narrow 900 px one), for notebook 10's
stages-vs-fsdp comparison and for many long names.

Reference: the bounding boxes of the drawn SVG text, measured by the browser (not by the
figure's own layout arithmetic). The old figure (four panels in a row, strategy names
rotated under each) fails: its titles ran together and its rotated names overlapped.
"""
from __future__ import annotations

import itertools

import pytest
from jupyterlab_harness import chromium, require_chromium, screenshot

import workbench as wb
from workbench.models import GPTConfig

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture(scope="module")
def comparisons():
    """Notebook 10's 70B comparison (fsdp over two slices vs stages across them), and
    eight plans with long names."""
    big = GPTConfig.preset("70b", remat="full", scan_layers=True)
    one_axis = wb.plan(big, mesh=wb.abstract_mesh("v5p-128", fsdp=-1, dcn={"fsdp": 2}),
                       batch=256, seq=4096, compile=False, name="fsdp over both slices",
                       progress=False)
    staged = wb.plan(big, mesh=wb.abstract_mesh("v5p-128", stage=2, fsdp=-1,
                                                dcn={"stage": 2}),
                     batch=256, seq=4096, compile=False, name="stages across slices",
                     pipeline={"microbatches": 4, "schedule": "circular", "repeats": 4},
                     progress=False)
    tiny = GPTConfig.preset("tiny")
    many = [wb.plan(tiny, mesh=wb.abstract_mesh("v5p-32", data=-1, model=m), rules=r,
                    batch=32, seq=128, compile=False, progress=False,
                    name=f"{r} data={16 // m} model={m} remat=none with a much longer label "
                         f"{i}")
            for i, (r, m) in enumerate(itertools.product(("fsdp", "fsdp_tp"), (1, 2, 4, 8)))]
    return {"notebook10": wb.compare([one_axis, staged]), "many": wb.compare(many)}


def _boxes(page, selector):
    return page.eval_on_selector_all(
        selector, "els => els.map(e => { const r = e.getBoundingClientRect();"
                  " return {text: e.textContent, x: r.x, y: r.y, w: r.width, h: r.height}; })"
                  ".filter(b => b.w > 0 && b.h > 0)")


def _overlap(a, b, slack=1.0):
    return (a["x"] + slack < b["x"] + b["w"] and b["x"] + slack < a["x"] + a["w"]
            and a["y"] + slack < b["y"] + b["h"] and b["y"] + slack < a["y"] + a["h"])


def _pairs_overlapping(boxes):
    return [(a["text"], b["text"]) for a, b in itertools.combinations(boxes, 2)
            if _overlap(a, b)]


@pytest.mark.parametrize("width", [1600, 900])
@pytest.mark.parametrize("which", ["notebook10", "many"])
def test_compare_figure_labels_do_not_overlap(comparisons, which, width):
    require_chromium()
    fig = comparisons[which].figure()
    html = fig.to_html(include_plotlyjs=True, full_html=True, default_width="100%")
    with chromium() as browser:
        # JupyterLab's output area in a window this wide: the page minus the side bars
        page = browser.new_page(viewport={"width": width - 120, "height": 1200})
        page.set_content(html)
        page.wait_for_selector(".main-svg .infolayer .annotation-text", timeout=60_000)
        page.wait_for_timeout(300)
        titles = _boxes(page, ".infolayer .annotation")
        names = _boxes(page, ".yaxislayer-above .ytick text, .yaxislayer .ytick text")
        xticks = _boxes(page, ".xaxislayer-above .xtick text, .xaxislayer .xtick text")
        legend = _boxes(page, ".legend .traces")
        svg = _boxes(page, ".main-svg")[0]
        screenshot(page, f"compare-figure-{which}-{width}")
    assert len(titles) == 4
    n = len(comparisons[which].rows)
    assert len({b["text"] for b in names}) == n       # every plan named once, on the left
    assert _pairs_overlapping(titles) == []
    assert _pairs_overlapping(names) == []
    assert _pairs_overlapping(legend) == []
    # ticks of one panel apart; ticks, names, titles and legend never on one another
    assert [p for p in _pairs_overlapping(xticks)] == []
    groups = {"titles": titles, "names": names, "xticks": xticks, "legend": legend}
    for (ga, a), (gb, b) in itertools.combinations(groups.items(), 2):
        hits = [(x["text"], y["text"]) for x in a for y in b if _overlap(x, y)]
        assert hits == [], (ga, gb, hits)
    # everything inside the figure (nothing cut off at the left edge or the bottom)
    for box in titles + names + xticks + legend:
        assert box["x"] >= svg["x"] - 1 and box["y"] >= svg["y"] - 1, box
        assert box["x"] + box["w"] <= svg["x"] + svg["w"] + 1, box
        assert box["y"] + box["h"] <= svg["y"] + svg["h"] + 1, box
