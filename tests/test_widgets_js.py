"""The widgets' ES modules under node: syntax, the inlined bundles, and render() against a
small fake DOM and model, checked against the payloads and the layouts they draw."""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import subprocess

import jax
import numpy as np
import pytest

from workbench._sharding.layouts import layout
from workbench._sharding.mesh import abstract_mesh, make_mesh
from workbench.widgets import _assets
from workbench.widgets._payload import devices_payload, layout_payload, mesh_payload
from workbench.widgets._tree_payload import tree_payload

HERE = pathlib.Path(__file__).parent / "widgets_js"
NODE = shutil.which("node")

if NODE is None:
    if os.environ.get("CI"):
        pytest.fail("node is required under CI to check the widget ES modules", pytrace=False)
    pytestmark = pytest.mark.skip(reason="node is not installed (needed to check the widget ESM)")


def render(tmp_path: pathlib.Path, view: str, state: dict, actions: list | None = None) -> dict:
    """Run ``static/<view>.js`` (as inlined for anywidget) in node; return the DOM report."""
    module = tmp_path / f"{view}.mjs"
    module.write_text(_assets.esm(view))
    (tmp_path / "state.json").write_text(json.dumps(state))
    args = [NODE, str(HERE / "render.mjs"), str(module), str(tmp_path / "state.json")]
    if actions is not None:
        (tmp_path / "actions.json").write_text(json.dumps(actions))
        args.append(str(tmp_path / "actions.json"))
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_node_check_every_static_module():
    files = sorted(_assets.STATIC.glob("*.js"))
    assert {"common", "mesh", "layout", "tree", "devices"} <= {f.stem for f in files}
    for f in files:
        out = subprocess.run([NODE, "--check", str(f)], capture_output=True, text=True, check=False)
        assert out.returncode == 0, f"{f.name}: {out.stderr}"


def _vertices(d: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"[ML](-?[\d.]+),(-?[\d.]+)", d)]


def check_chart(chart: dict, points: list[list[float]], scale: float = 1.0,
                unit: str = "") -> None:
    """The chart's path has one vertex per point, placed linearly in step (left to right)
    and value (larger is higher), inside the view box; its labels give the value range and
    the first and last step."""
    (d,) = chart["d"]
    verts = _vertices(d)
    assert len(verts) == len(points) and d.startswith("M") and d.count("M") == 1
    steps = [p[0] for p in points]
    values = [p[1] * scale for p in points]
    (xa, ya), (xb, _) = verts[0], verts[-1]
    top = min(y for _, y in verts)
    bottom = max(y for _, y in verts)
    assert ya == verts[0][1] and xb > xa and bottom > top
    for (x, y), s, v in zip(verts, steps, values):
        assert (x - xa) / (xb - xa) == pytest.approx(
            (s - steps[0]) / (steps[-1] - steps[0]), abs=0.01)
        assert (bottom - y) / (bottom - top) == pytest.approx(
            (v - min(values)) / (max(values) - min(values)), abs=0.01)
    _, _, width, height = (float(v) for v in chart["viewBox"].split())
    assert 0 < xa < xb < width and 0 < top < bottom < height
    assert f"step {steps[0]}" in chart["texts"] and f"step {steps[-1]}" in chart["texts"]
    for v in (max(values), min(values)):
        assert f"{to_precision(v, 3)}{unit}" in chart["texts"], (v, chart["texts"])


def to_precision(v: float, digits: int) -> str:
    """JavaScript's ``v.toPrecision(digits)`` (for 1e-6 <= |v| < 10**digits)."""
    exp = math.floor(math.log10(abs(float(f"{v:.{digits - 1}e}"))))
    return f"{v:.{max(0, digits - 1 - exp)}f}"


def _job_payload(steps: int, target: int) -> dict:
    """A payload in the shape ``job_view.job_payload`` sends."""
    procs = [{"index": i, "pid": 100 + i, "state": "running", "returncode": None,
              "log": f"/runs/j/process_{i}.log"} for i in range(2)]
    return {"run_dir": "/runs/j", "name": "j", "status": "running", "done": False,
            "platform": "cpu", "devices_per_process": 2, "processes": procs,
            "step": steps, "target_steps": target,
            "latest": {"loss": 5 / steps, "mfu": 0.01 * steps, "step_time": 0.5,
                       "tokens_per_s": 1e3, "peak_source": "measured"} if steps else {},
            "loss": [[s, 5 / s] for s in range(1, steps + 1)],
            "mfu": [[s, 0.01 * s] for s in range(1, steps + 1)],
            "failure": None, "tails": {"0": ["step 1", "step 2"], "1": []}}


def test_job_draws_its_curves_and_progress_and_stop_asks_python(tmp_path):
    p = _job_payload(30, 60)
    rep = render(tmp_path, "job", {"payload": p}, [{"op": "click", "cls": "wb-stop"}])
    loss, mfu = rep["charts"]
    assert (loss["label"], mfu["label"]) == ("loss", "MFU")
    check_chart(loss, p["loss"])
    check_chart(mfu, p["mfu"], scale=100, unit="%")
    assert rep["titles"] == ["50.0%"]  # step 30 of 60
    assert "step 30 of 60" in rep["text"] and "MFU 30.0% (measured)" in rep["text"]
    assert rep["sent"] == [{"type": "stop"}] and "stopping…" in rep["text"]
    assert rep["classes"]["wb-status"] == 3  # the job's and each process's state
    assert rep["handlers_left"] == 0


def test_train_panel_appends_live_rows_after_its_history(tmp_path):
    history = {"step": [1, 2, 3], "loss": [4.0, 3.0, 2.5], "mfu": [0.1, 0.2, 0.25],
               "step_time": [0.5] * 3, "data_time": [0.1] * 3, "ckpt_time": [0.0] * 3}
    state = {"info": {"name": "tiny", "run_dir": "/runs/tiny", "peak_source": "measured"},
             "status": {"step": 5, "target": 10, "eta": 62.4, "state": "running",
                        "last": {"loss": 2.0, "mfu": 0.3}},
             "history": history}
    rows = [[2, 9.0, 0.9, 0.5, 0.1, 0.0],   # already in the history: dropped
            [3, 9.0, 0.9, 0.5, 0.1, 0.0],
            [4, 2.2, 0.28, 0.5, 0.1, 0.0], [5, 2.0, 0.3, 0.5, 0.1, 0.0]]
    rep = render(tmp_path, "train_panel", state,
                 [{"op": "msg", "msg": {"type": "append", "rows": rows}}])
    loss, mfu = rep["charts"]
    points = [[s, v] for s, v in zip(history["step"], history["loss"])] + [[4, 2.2], [5, 2.0]]
    check_chart(loss, points)
    check_chart(mfu, [[s, m] for s, m in zip(range(1, 6), [0.1, 0.2, 0.25, 0.28, 0.3])],
                scale=100, unit="%")
    assert rep["titles"] == ["50.0%"]
    assert "step 5/10 · ETA 1:02 · loss 2.000 · MFU 30.0%" in rep["text"]
    assert "compute 400.0 ms · data 100.0 ms · checkpoint 0.0 ms" in rep["text"]
    assert rep["handlers_left"] == 0


def test_train_panel_draws_the_eval_loss_dashed_beside_the_training_loss(tmp_path):
    steps = list(range(1, 11))
    evals = [None, None, None, None, 3.5, None, None, None, None, 2.5]   # eval_every=5
    history = {"step": steps, "loss": [5.0 - 0.3 * s for s in steps], "mfu": [0.1] * 10,
               "step_time": [0.5] * 10, "data_time": [0.1] * 10, "ckpt_time": [0.0] * 10,
               "eval_loss": evals}
    state = {"info": {"name": "own-text", "run_dir": "/runs/t"},
             "status": {"step": 10, "target": 10, "state": "finished", "last": {"loss": 2.0}},
             "history": history}
    rep = render(tmp_path, "train_panel", state,
                 [{"op": "msg", "msg": {"type": "append",
                                        "rows": [[11, 1.6, 0.1, 0.5, 0.1, 0.0, None]]}}])
    loss = rep["charts"][0]
    train_d, eval_d = loss["d"]                   # two paths: training loss, eval loss
    train, held = _vertices(train_d), _vertices(eval_d)
    assert len(train) == 11 and len(held) == 2 and "loss · eval (dashed)" in loss["texts"]
    # the same axes: x by step (steps 1..11), y by value over both series (1.6 .. 4.7)
    x = lambda s: train[0][0] + (s - 1) / 10 * (train[-1][0] - train[0][0])
    assert held[0][0] == pytest.approx(x(5), abs=0.1) and held[1][0] == pytest.approx(x(10), abs=0.1)
    top, bottom = min(y for _, y in train), max(y for _, y in train)   # 4.7 and 1.6
    y = lambda v: bottom - (v - 1.6) / (4.7 - 1.6) * (bottom - top)
    assert held[0][1] == pytest.approx(y(3.5), abs=0.1) and held[1][1] == pytest.approx(y(2.5), abs=0.1)
    assert rep["handlers_left"] == 0


def test_train_panel_draws_each_earlier_attempt_faint_beside_the_current_one(tmp_path):
    """A restarted run (issue 56 item 4): attempt 1's curve faint, attempt 2's solid, both
    on the same axes, named in the chart's label."""
    history = {"step": [1, 2], "loss": [5.0, 4.0], "mfu": [0.1, 0.2], "step_time": [0.5] * 2,
               "data_time": [0.1] * 2, "ckpt_time": [0.0] * 2, "attempt": 2,
               "attempts": [{"attempt": 1, "step": [1, 2, 3, 4], "loss": [6.0, 5.0, 4.0, 3.0],
                             "mfu": [0.1, 0.1, 0.1, 0.1]}]}
    state = {"info": {"name": "r", "run_dir": "/runs/r"},
             "status": {"step": 2, "target": 4, "state": "running", "last": {"loss": 4.0}},
             "history": history}
    rep = render(tmp_path, "train_panel", state)
    loss = rep["charts"][0]
    main, earlier = (_vertices(d) for d in loss["d"])
    assert len(main) == 2 and len(earlier) == 4
    assert "loss · attempt 1 (faint) · attempt 2" in loss["texts"]
    assert "step 1" in loss["texts"] and "step 4" in loss["texts"]   # x spans both attempts
    assert main[0][0] == earlier[0][0] and main[1][0] == pytest.approx(earlier[1][0], abs=0.1)
    top = min(y for _, y in main + earlier)
    assert earlier[0][1] == top and "6.00" in loss["texts"] and "3.00" in loss["texts"]
    assert rep["handlers_left"] == 0


def test_charts_wait_for_the_first_step(tmp_path):
    rep = render(tmp_path, "job", {"payload": _job_payload(0, 60)})
    assert [c["d"] for c in rep["charts"]] == [[""], [""]]
    assert all("waiting for the first step…" in c["texts"] for c in rep["charts"])
    assert rep["titles"] == ["0.0%"] and "loss —" in rep["text"]


def test_mesh_cells_sit_at_their_mesh_coordinates(tmp_path):
    mesh = make_mesh(data=4, model=2)
    rep = render(tmp_path, "mesh", {"payload": mesh_payload(mesh), "color_by": "", "rows": ""},
                 [{"op": "change", "label": "colour by", "value": "axis:model"}])
    assert len(rep["devices"]) == 8 and rep["classes"]["wb-device-id"] == 8
    for cell in rep["devices"]:
        coord = tuple(int(c) for c in cell["data-coord"].split(","))
        assert mesh.devices[coord].id == int(cell["data-device"])
        assert (int(cell["style:grid-row"]), int(cell["style:grid-column"])) == (coord[0] + 1, coord[1] + 1)
    assert rep["state"]["color_by"] == "axis:model" and rep["saves"] == 1
    by_model = {}
    for cell in rep["devices"]:  # after the change: one colour per model coordinate
        by_model.setdefault(cell["data-coord"].split(",")[1], set()).add(cell["style:background"])
    assert all(len(c) == 1 for c in by_model.values()) and len(set.union(*by_model.values())) == 2
    assert rep["handlers_left"] == 0


def test_mesh_of_2048_devices_draws_colour_cells_without_labels(tmp_path):
    payload = mesh_payload(abstract_mesh(data=256, model=8))
    rep = render(tmp_path, "mesh", {"payload": payload, "color_by": "", "rows": ""})
    cells = rep["devices"]
    assert len(cells) == 2048 and "wb-device-id" not in rep["classes"]
    # a wide grid: model (8) on rows, data (256) on columns, one cell per device
    for cell in cells:
        d, m = (int(c) for c in cell["data-coord"].split(","))
        assert (int(cell["style:grid-row"]), int(cell["style:grid-column"])) == (m + 1, d + 1)
    assert len({c["style:background"] for c in cells}) == 256  # coloured by the data axis


def test_pod_mesh_transposes_to_a_wide_grid_and_rows_can_be_chosen(tmp_path):
    payload = mesh_payload(abstract_mesh("v5p-256", data=-1, model=4))
    rep = render(tmp_path, "mesh", {"payload": payload, "color_by": "", "rows": ""})
    assert "rows: model · columns: data" in rep["text"]
    assert rep["classes"]["wb-device-id"] == 128 and "wb-device-sub" not in rep["classes"]
    assert len({c["style:background"] for c in rep["devices"]}) == 32  # by host: 4 chips each
    rep = render(tmp_path, "mesh", {"payload": payload, "color_by": "", "rows": ""},
                 [{"op": "change", "label": "rows", "value": "data"}])
    assert rep["state"]["rows"] == "data" and "rows: data · columns: model" in rep["text"]


def test_layout_small_multiples_match_the_blocks(tmp_path):
    mesh = make_mesh(data=4, model=2)
    lay = layout((8, 12, 4), (None, "data", "model"), mesh)
    p = layout_payload(lay)
    rep = render(tmp_path, "layout", {"payload": p, "dims": [0, 1], "color_by": "device",
                                      "panel": 0, "placeholder": ""})
    assert rep["classes"]["wb-panel"] == 2  # dim 2 split in two: two panels
    assert len(rep["blocks"]) == lay.num_shards == 8
    groups = {g[0]: g for g in lay.replica_groups}
    for b in rep["blocks"]:
        ids = [int(i) for i in b["data-devices"].split(",")]
        assert tuple(ids) == groups[ids[0]]
        (r0, _), (c0, c1), _ = lay.indices[ids[0]]
        assert float(b["style:top"][:-1]) == pytest.approx(100 * r0 / 8)
        assert float(b["style:left"][:-1]) == pytest.approx(100 * c0 / 12)
        assert float(b["style:width"][:-1]) == pytest.approx(100 * (c1 - c0) / 12)
    assert len({b["style:background"] for b in rep["blocks"]}) == 8  # one colour per device


def test_layout_uneven_dim_names_the_padding_only_devices(tmp_path):
    lay = layout((6, 4), ("data", "model"), make_mesh(data=4, model=2))  # rows 0:2 2:4 4:6 6:6
    rep = render(tmp_path, "layout", {"payload": layout_payload(lay), "dims": [0, 1],
                                      "color_by": "", "panel": 0, "placeholder": ""})
    empty = [d for d, b in lay.bytes_per_device.items() if b == 0]
    assert len(rep["blocks"]) == 8 - len(empty) == 6
    assert f"only padding: devices {', '.join(map(str, empty))}" in rep["text"]


def test_layout_slider_over_many_panels(tmp_path):
    lay = layout((4, 64, 2), (None, "a", "b"), abstract_mesh(a=32, b=2))
    rep = render(tmp_path, "layout", {"payload": layout_payload(lay), "dims": [0, 2],
                                      "color_by": "", "panel": 0, "placeholder": ""},
                 [{"op": "input", "label": "panel", "value": 5}])
    assert rep["state"]["panel"] == 5 and rep["classes"]["wb-slider"] == 1
    assert rep["classes"]["wb-panel"] == 1 and len(rep["blocks"]) == 2
    assert "dim 1 ∈ [10:12]" in rep["text"]  # the sixth slice of dim 1 (32 blocks of 2)


def test_layout_rank0_and_rank1(tmp_path):
    mesh = make_mesh(data=8)
    for shape, spec, n in (((), (), 1), ((16,), ("data",), 8)):
        p = layout_payload(layout(shape, spec, mesh))
        rep = render(tmp_path, "layout", {"payload": p, "dims": [], "color_by": "",
                                          "panel": 0, "placeholder": ""})
        assert len(rep["blocks"]) == n


def _gpt():
    from flax import nnx

    from workbench.models import GPT, GPTConfig

    return nnx.eval_shape(lambda: GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0)))


def test_tree_table_sorts_selects_and_draws_memory_bars(tmp_path):
    from workbench._sharding.rules import Rules

    mesh = make_mesh(data=4, model=2)
    p = tree_payload(_gpt(), mesh=mesh, rules=Rules.preset("fsdp_tp", mesh))
    state = {"payload": p, "selected": "", "tab": "table", "group_axis": "",
             "want_treescope": False, "treescope_html": ""}
    rep = render(tmp_path, "tree", state, [
        {"op": "click", "cls": "wb-sortable", "index": 5},  # bytes / device: largest first
        {"op": "click", "cls": "wb-row", "index": 0},
    ])
    assert len(rep["rows"]) == len(p["rows"]) == 21
    biggest = max(p["rows"], key=lambda r: r["bytes"])
    assert rep["state"]["selected"] == rep["rows"][0][0]
    assert next(r for r in p["rows"] if r["path"] == rep["rows"][0][0])["bytes"] == biggest["bytes"]
    assert [int(b["data-device"]) for b in rep["bars"]] == p["mesh"]["device_ids"]
    assert rep["classes"].get("wb-selected") == 1
    assert "logical axes" in rep["text"] and len(rep["rows"][0]) == 8  # no notes: no note column


def test_tree_groups_memory_by_mesh_axis_at_2048_devices(tmp_path):
    from jax.sharding import PartitionSpec as P

    tree = {"w": jax.ShapeDtypeStruct((8192, 1024), np.float32)}
    p = tree_payload(tree, mesh=abstract_mesh(data=256, model=8), specs={"w": P("data", "model")})
    state = {"payload": p, "selected": "", "tab": "table", "group_axis": "model",
             "want_treescope": False, "treescope_html": ""}
    rep = render(tmp_path, "tree", state)
    assert len(rep["cols"]) == 8 and not rep["bars"]
    assert "logical axes" not in rep["text"] and "all 2048 devices hold 16 KiB" in rep["text"]


def test_tree_treescope_tab(tmp_path):
    p = tree_payload({"w": np.zeros((4, 4), np.float32)}, mesh=make_mesh(data=8))
    state = {"payload": p, "selected": "", "tab": "table", "group_axis": "",
             "want_treescope": False, "treescope_html": ""}
    rep = render(tmp_path, "tree", state, [{"op": "click", "cls": "wb-tab", "index": 1}])
    assert rep["state"]["tab"] == "tree" and rep["state"]["want_treescope"] is True
    table = render(tmp_path, "tree", {**state, "tab": "table"})
    assert table["rows"][0][-1] == "no sharding given: drawn replicated"  # the note column
    state.update(tab="tree", treescope_html="<html><body>tree</body></html>")
    assert render(tmp_path, "tree", state)["iframes"] == [len(state["treescope_html"])]


def test_devices_table(tmp_path):
    p = devices_payload(jax.devices())
    rep = render(tmp_path, "devices", {"payload": p})
    assert [int(r[0]) for r in rep["rows"]] == [d.id for d in jax.devices()]


def test_profile_widget_draws_one_pair_of_bars_per_term(tmp_path):
    from workbench.perf._profile import profile_report
    from workbench.perf._trace import StepProfile
    from workbench.widgets._profile_view import profile_payload

    pred = {"step_seconds": 0.03, "sources": {}, "breakdown": {
        "compute": 0.01, "memory": 0.012, "communication": 0.008,
        "communication_total": 0.008,
        "collectives": [{"kind": "all-gather", "axes": ["data"], "seconds": 0.008, "count": 4}]}}
    measured = StepProfile(directory="runs/r/profiles/3", files=(), module="jit_train_step",
                           steps=3, devices=8, step_seconds=0.04, execution_seconds=0.035,
                           categories={"compute": 0.011, "memory": 0.01, "collectives": 0.0,
                                       "other": 0.0, "concurrent": 0.0, "idle": 0.004,
                                       "host": 0.005}, collectives=(), ops=())
    report = profile_report(pred, measured, plan_name="fsdp",
                            tokens_per_s={"outside": 1000.0, "during": 900.0})
    out = render(tmp_path, "profile", {"payload": profile_payload(report)})
    bars = out["profile_bars"]
    assert len(bars) == 2 * len(report.terms)       # predicted and measured per term
    top = max(max(t.predicted, t.measured) for t in report.terms)
    for i, t in enumerate(report.terms):
        for bar, value in ((bars[2 * i], t.predicted), (bars[2 * i + 1], t.measured)):
            assert float(bar["style:width"].rstrip("%")) == pytest.approx(100 * value / top)
    assert report.verdict() in out["text"]
    assert "idle + host" in report.verdict()        # 9 ms of the 40 ms step, not predicted
    assert out["handlers_left"] == 0


def test_generation_view_shows_prompt_then_the_new_text(tmp_path):
    state = {"prompts": ["Once upon"], "texts": ["Once upon a time"], "tokens": 3,
             "state": "generating", "tokens_per_s": 12.5}
    out = render(tmp_path, "generation", state)
    assert out["classes"]["wb-generation-row"] == 1
    assert "Once upon a time▍" in out["text"] and "3 new tokens" in out["text"]
    assert "12.5 tokens/s" in out["text"] and out["handlers_left"] == 0
    done = render(tmp_path, "generation", {**state, "state": "done"})
    assert "▍" not in done["text"] and done["classes"]["wb-generation-new"] == 1
