"""The widgets in a real JupyterLab in headless Chromium: a mesh, a rank-3 layout, an NNX model
(click a row, open treescope) and a 2048-device layout render; screenshots are saved."""
from __future__ import annotations

import json
import pathlib

import pytest
from jupyterlab_harness import chromium, require_chromium, run_notebook, screenshot, start_lab

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CELLS = [
    # 0: a real mesh of 8 simulated devices
    "import workbench as wb\nwb.simulate_devices(8)\nmesh = wb.make_mesh(data=4, model=2)\nwb.show(mesh)",
    # 1: a rank-3 tensor
    'wb.show(wb.layout((64, 2048, 12288), ("data", None, "model"), mesh, dtype="bfloat16"))',
    # 2: an NNX model, logical axes mapped by rules
    ("from flax import nnx\n"
     'cfg = wb.models.GPTConfig.preset("tiny")\n'
     "model = nnx.eval_shape(lambda: wb.models.GPT(cfg, rngs=nnx.Rngs(0)))\n"
     'wb.show(model, mesh=mesh, rules=wb.Rules.preset("fsdp_tp", mesh))'),
    # 3: a TPU pod you do not have, and a 2048-device layout
    'wb.show(wb.abstract_mesh("v5p-256", data=-1, model=4))',
    ('wb.show(wb.layout((8192, 28672), ("data", "model"), wb.abstract_mesh(data=256, model=8), '
     'dtype="bfloat16"))'),
]


def _notebook(path: pathlib.Path) -> None:
    cells = [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {},
              "outputs": [], "source": src} for i, src in enumerate(CELLS)]
    nb = {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                      "language": "python"}}}
    path.write_text(json.dumps(nb))


def test_widgets_render_in_jupyterlab(tmp_path):
    require_chromium()
    nb = tmp_path / "widgets.ipynb"
    _notebook(nb)
    with start_lab(tmp_path) as lab, chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 1600})
        try:
            run_notebook(page, lab, nb, timeout=150)
            _check_widgets(page)
        except Exception:
            screenshot(page, "widgets-failure")
            raise


def _check_widgets(page) -> None:
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")

    def output(i: int):
        out = cells.nth(i).locator(".jp-OutputArea")
        out.locator(".wb-widget").first.wait_for(timeout=30_000)
        return out

    mesh = output(0)
    assert mesh.locator(".wb-device").count() == 8
    assert mesh.locator(".wb-device-id").all_inner_texts() == [str(i) for i in range(8)]
    screenshot(mesh, "widgets-mesh")

    lay = output(1)
    assert lay.locator(".wb-block").count() == 8  # data x model blocks, dim 1 whole
    lay.locator(".wb-block").nth(3).hover()
    tip = lay.locator(".wb-tooltip")
    assert "shard shape (16, 2048, 6144)" in tip.inner_text()
    screenshot(lay, "widgets-layout-rank3")

    tree = output(2)
    assert tree.locator(".wb-row").count() == 21
    tree.locator(".wb-row", has_text="blocks.0.attn.q").click()  # kernel draws it on demand
    tree.locator(".wb-layout .wb-block").first.wait_for(timeout=30_000)
    assert tree.locator(".wb-layout .wb-block").count() == 8
    assert "blocks.0.attn.q" in tree.locator(".wb-layout .wb-title").inner_text()
    assert tree.locator(".wb-bar-row").count() == 8
    screenshot(tree, "widgets-tree")
    tree.locator(".wb-tab", has_text="Tree (treescope)").click()
    frame = tree.frame_locator("iframe.wb-treescope")
    container = frame.locator("treescope-container").first
    container.wait_for(state="attached", timeout=30_000)
    page.wait_for_timeout(500)  # treescope decompresses and renders asynchronously
    rendered = container.evaluate("e => e.shadowRoot.textContent")
    assert "GPT(" in rendered and "blocks" in rendered and "lm_head" in rendered
    screenshot(tree, "widgets-treescope")

    pod = output(3)
    assert pod.locator(".wb-device").count() == 128
    screenshot(pod, "widgets-mesh-v5p")
    big = output(4)
    assert big.locator(".wb-block").count() == 2048
    screenshot(big, "widgets-layout-2048")
