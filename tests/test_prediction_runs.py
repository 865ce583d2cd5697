"""A run started from a plan records the plan's prediction (run.json "prediction"), keeps it
on resume, and serves it checked: to the lab's API and to the inline train panel."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from pytest_jupyter.jupyter_server import *  # noqa: F403 - its fixtures, for this module only
from server_async import run_async
from traitlets.config import Config

import workbench as wb
from workbench import _runs as runs
from workbench._sharding.mesh import make_mesh
from workbench.server._index import RunIndex
from workbench.widgets import _assets
from workbench.widgets._train_panel import TrainPanel

CFG = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                     rules="fsdp", batch=8, seq=32, steps=3, checkpoint_every=2,
                     data="synthetic", optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=2))
# What a hand-edited run.json may hold where numbers belong (NaN is what json.dumps writes).
MALFORMED = ('{"step_seconds": NaN, "mfu": "31%", "tokens_per_s": Infinity, "bound": 3, '
             '"compiler_seconds": true, "source": ["x"], "breakdown": "none"}')
PARTLY = ('{"step_seconds": 0.025, "mfu": -1, "bound": "memory", "source": "estimate", '
          '"breakdown": {"compute": 0.01, "memory": NaN, "communication": "a"}, '
          '"sources": {"flops": "formula", "bytes": 5}}')
JS_HERE = Path(__file__).parent / "widgets_js"


def _from_plan(plan: Any, run_dir: Path, **kw: Any) -> wb.Trainer:
    return wb.Trainer.from_plan(plan, run_dir, optimizer=CFG.optimizer, steps=CFG.steps,
                                data=CFG.data, checkpoint_every=CFG.checkpoint_every,
                                progress=None, **kw)


@pytest.fixture(scope="module")
def plan() -> Any:
    return wb.plan(CFG.model_config(), mesh=make_mesh(data=8), rules="fsdp", batch=8, seq=32,
                   progress=False)


def without_hardware_numbers(plan: Any) -> Any:
    """``plan`` predicted, when made, for a chip whose table has no HBM bandwidth: its
    report keeps no prediction and says why (``prediction_error``)."""
    from workbench.hardware import effective_spec, hardware_spec
    from workbench.planning._report import with_prediction

    chip = dataclasses.replace(hardware_spec("TPU v5p"), name="TPU v2", hbm_bandwidth=None)
    report = with_prediction(plan.report, effective_spec(plan.report.mesh, hardware=chip))
    assert report.predicted is None and "no HBM bandwidth" in report.prediction_error
    return dataclasses.replace(plan, report=report)


@pytest.mark.usefixtures("wb_cache")
@pytest.mark.slow
def test_from_plan_records_the_plan_prediction_and_resume_keeps_it(plan: Any,
                                                                   tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tr = _from_plan(plan, run_dir)
    tr.run(steps=2)
    want = json.loads(json.dumps(runs.json_safe(plan.predicted.to_dict())))  # as JSON reads it
    got = runs.read_run(run_dir)["prediction"]
    assert {k: got[k] for k in want} == want
    assert (got["source"], got["source_reason"], got["plan_name"]) == (
        plan.source, plan.source_reason, plan.name)
    assert got["hardware"] == plan.mesh.device_kind
    assert got["step_seconds"] == plan.predicted.step_seconds and got["mfu"] == plan.predicted.mfu
    events = [e for e in runs.read_events(run_dir) if e["event"] == "prediction"]
    assert len(events) == 1 and events[0]["recorded"] is True
    assert events[0]["step_seconds"] == plan.predicted.step_seconds
    # the measured side: the metrics carry step time and MFU to compare with
    last = runs.read_metrics(run_dir)[-1]
    assert last["step_time"] > 0 and last["mfu"] > 0

    # resume with a plain Trainer: run.json is rewritten, the prediction stays
    again = wb.Trainer(tr.config, run_dir, progress=None)
    assert again.prediction == runs.clean_prediction(got)
    again.run(steps=3)
    meta = runs.read_run(run_dir)
    assert meta["step"] == 3 and meta["prediction"] == got
    assert len([e for e in runs.read_events(run_dir) if e["event"] == "prediction"]) == 1
    # ... and its inline panel shows it beside the measured numbers
    panel = again.widget()
    assert panel.info["prediction"] == runs.clean_prediction(got)
    assert f"predicted {plan.predicted.step_seconds:.3f} s/step" in repr(panel)


@pytest.mark.usefixtures("wb_cache")
@pytest.mark.slow
def test_a_plan_without_a_prediction_never_fails_the_run(plan: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tr = _from_plan(without_hardware_numbers(plan), run_dir)
    assert tr.prediction is None
    result = tr.run(steps=1)
    assert result.status == "finished"
    assert runs.read_run(run_dir).get("prediction") is None
    (event,) = [e for e in runs.read_events(run_dir) if e["event"] == "prediction"]
    assert event["recorded"] is False and "no HBM bandwidth" in event["reason"]
    with pytest.raises(TypeError, match="wb.plan"):
        wb.Trainer(CFG, tmp_path / "other", prediction={"step_seconds": 1.0}, progress=None)


def test_run_writer_keeps_a_prediction_and_reads_older_runs(tmp_path: Path) -> None:
    pred = {"step_seconds": 0.02, "mfu": 0.3, "bound": "compute", "source": "estimate",
            "breakdown": {"compute": 0.02, "collectives": [{"kind": "all-reduce"}]}}
    with runs.RunWriter(tmp_path / "a", config={"m": 1}, meta={"prediction": pred}) as w:
        w.log({"step": 1, "loss": 1.0})
    with runs.RunWriter(tmp_path / "a", config={"m": 1}, meta={"target_steps": 5}) as w:
        w.log({"step": 2, "loss": 0.5})
    assert runs.read_run(tmp_path / "a")["prediction"] == pred     # kept whole on resume
    with runs.RunWriter(tmp_path / "old", config={"m": 1}) as w:   # no prediction at all
        w.log({"step": 1, "loss": 1.0})
    meta = runs.read_run(tmp_path / "old")
    assert meta.get("prediction") is None and runs.clean_prediction(meta.get("prediction")) is None


def test_clean_prediction_keeps_numbers_and_texts_only() -> None:
    assert runs.clean_prediction(json.loads(MALFORMED)) is None  # no step time, no MFU
    assert runs.clean_prediction(json.loads(PARTLY)) == {
        "step_seconds": 0.025, "bound": "memory", "source": "estimate",
        "breakdown": {"compute": 0.01}, "sources": {"flops": "formula"}}
    for bad in (None, "0.02", 0.02, [0.02], {"step_seconds": True}, {"mfu": math.inf}):
        assert runs.clean_prediction(bad) is None
    assert runs.clean_prediction({"step_seconds": 2}) == {"step_seconds": 2.0}


def _hand_edited(root: Path, name: str, prediction: str) -> Path:
    """A run whose run.json a person edited: ``prediction`` is spliced in as raw text."""
    d = root / name
    with runs.RunWriter(d, config={"model": "tiny"}) as w:
        w.log({"step": 1, "loss": 2.0, "mfu": 0.1, "step_time": 0.05})
    text = (d / runs.RUN_JSON).read_text()
    (d / runs.RUN_JSON).write_text(text.rstrip()[:-1] + f', "prediction": {prediction}}}')
    return d


def test_index_serves_malformed_predictions_checked(tmp_path: Path) -> None:
    _hand_edited(tmp_path, "bad", MALFORMED)
    _hand_edited(tmp_path, "partly", PARTLY)
    _hand_edited(tmp_path, "nan-elsewhere", '{"step_seconds": 0.5}')
    raw = (tmp_path / "nan-elsewhere" / runs.RUN_JSON).read_text()
    (tmp_path / "nan-elsewhere" / runs.RUN_JSON).write_text(
        raw.replace('"peak_flops": null', '"peak_flops": NaN'))
    index = RunIndex([tmp_path])
    index.poll(force_scan=True)
    for rid in ("bad", "partly", "nan-elsewhere"):
        detail = index.watch(rid).detail()
        json.dumps(detail, allow_nan=False)   # what the handlers send: strict JSON
        want = runs.clean_prediction(json.loads(
            (tmp_path / rid / runs.RUN_JSON).read_text())["prediction"])
        assert detail["prediction"] == want
    summaries = {s["id"]: s for s in index.summaries()}
    json.dumps(summaries, allow_nan=False)
    assert summaries["bad"]["prediction"] is None
    assert summaries["partly"]["prediction"] == {"step_seconds": 0.025, "bound": "memory",
                                                 "source": "estimate"}
    assert index.watch("nan-elsewhere").detail()["peak_flops"] is None


def test_a_written_profile_report_changes_the_run_detail(tmp_path: Path) -> None:
    """The index polls profiles/*/report.json: a report written, replaced or removed is a
    change of the run's detail (pushed to its dashboards, which then fetch the profiles)."""
    _hand_edited(tmp_path, "run", '{"step_seconds": 0.5}')
    index = RunIndex([tmp_path])
    index.poll(force_scan=True)
    assert index.poll()[0] == [] and index.watch("run").detail()["profiles"] == []
    (tmp_path / "run" / "profiles" / "7").mkdir(parents=True)   # a trace being taken
    assert index.poll()[0] == []
    report = tmp_path / "run" / "profiles" / "7" / "report.json"
    report.write_text('{"rows": []}')
    changes, _ = index.poll()
    assert [(c.watch.id, c.meta_changed) for c in changes] == [("run", True)]
    assert [(p["name"], p["step"]) for p in index.watch("run").detail()["profiles"]] == [
        ("7", 7)]
    assert index.poll()[0] == []
    report.unlink()
    assert [c.meta_changed for c in index.poll()[0]] == [True]
    assert index.watch("run").detail()["profiles"] == []


# ---------------------------------------------------------------------------- the server


@pytest.fixture
def jp_server_config() -> Config:
    return Config({"ServerApp": {"jpserver_extensions": {"workbench.server": True}},
                   "WorkbenchExtension": {"poll_interval": 0.1, "scan_interval": 0.2}})


@run_async
async def test_runs_api_passes_the_prediction_through(jp_root_dir: Path, jp_base_url: str,
                                                      jp_serverapp: Any, http_server_client: Any,
                                                      jp_auth_header: dict[str, str]) -> None:
    pred = {"step_seconds": 0.02, "mfu": 0.3, "tokens_per_s": 12800.0, "bound": "compute",
            "source": "cpu-compiler", "plan_name": "tiny"}
    with runs.RunWriter(jp_root_dir / "good", config={"m": 1}, meta={"prediction": pred}) as w:
        w.log({"step": 1, "loss": 1.0})
    _hand_edited(jp_root_dir, "bad", MALFORMED)
    _hand_edited(jp_root_dir, "partly", PARTLY)

    get = functools.partial(_api_get, http_server_client, jp_base_url, jp_auth_header)

    good = await get("runs", "good")
    assert good["prediction"] == runs.clean_prediction(pred) == pred
    assert (await get("runs", "bad"))["prediction"] is None
    partly = await get("runs", "partly")
    assert partly["prediction"] == runs.clean_prediction(json.loads(PARTLY))
    listed = {r["id"]: r for r in (await get("runs"))["runs"]}
    assert listed["good"]["prediction"] == {k: pred[k] for k in ("step_seconds", "mfu",
                                                                 "bound", "source")}
    assert listed["bad"]["prediction"] is None and listed["bad"]["step"] == 1


async def _api_get(client: Any, base_url: str, headers: dict[str, str], *parts: str) -> Any:
    """GET ``workbench/api/<parts...>`` (each part URL-quoted); asserts 200, returns JSON."""
    path = "/".join(urllib.parse.quote(p, safe="") for p in parts)
    resp = await client.fetch(f"{base_url}workbench/api/{path}", headers=headers,
                              raise_error=False)
    assert resp.code == 200, (parts, resp.code)
    return json.loads(resp.body)


@pytest.fixture(scope="module")
def profiled_run(plan: Any, tmp_path_factory: Any) -> tuple[Path, Any]:
    """A run started from the plan, 1 warm-up step then 2 profiled ones
    (``trainer.profile``): its directory and the ProfileReport the trainer returned."""
    run_dir = tmp_path_factory.mktemp("profiled") / "run"
    trainer = _from_plan(plan, run_dir)
    try:
        report = trainer.profile(steps=2, warmup=1)
    finally:
        trainer.close()
    return run_dir, report


@run_async
async def test_profiles_api_serves_the_profile_of_a_real_run(
        profiled_run: tuple[Path, Any], jp_root_dir: Path, jp_base_url: str, jp_serverapp: Any,
        http_server_client: Any, jp_auth_header: dict[str, str]) -> None:
    """GET .../profiles answers the trainer's own comparison, term by term; the run's detail
    lists it (the dashboard fetches on that); a hand-edited report is served checked."""
    src, report = profiled_run
    shutil.copytree(src, jp_root_dir / "profiled", ignore=shutil.ignore_patterns("checkpoints"))
    bad = jp_root_dir / "profiled" / "profiles" / "99"
    bad.mkdir()
    (bad / "report.json").write_text('{"rows": [{"name": "compute", "predicted": NaN, '
                                     '"measured": 1}], "verdict": 3}')

    get = functools.partial(_api_get, http_server_client, jp_base_url, jp_auth_header)

    name = Path(report.directory).name           # profiles/<first traced step>
    detail = await get("runs", "profiled")
    assert [(p["name"], p["step"]) for p in detail["profiles"]] == [(name, int(name)),
                                                                     ("99", 99)]
    served = (await get("runs", "profiled", "profiles"))["profiles"]
    assert [p["name"] for p in served] == [name, "99"]
    got, hand = served
    keys = ("name", "predicted", "measured", "kind", "axes", "count", "wait")
    assert [{k: r[k] for k in keys} for r in got["rows"]] == [
        {k: r[k] for k in keys} for r in report.rows()]
    assert [r["name"] for r in got["rows"]] == [t.name for t in report.terms]
    collectives = [r for r in got["rows"] if r["kind"]]
    assert collectives and all(r["axes"] for r in collectives)
    assert got["verdict"] == report.verdict() and report.largest_disagreement.name in got["verdict"]
    assert got["tokens_per_s"] == report.tokens_per_s and set(got["tokens_per_s"]) == {
        "outside", "during"}
    assert got["overhead"] == pytest.approx(report.overhead)
    assert (got["steps"], got["plan_name"], got["problem"]) == (2, report.plan_name, None)
    assert hand["rows"] == [] and hand["verdict"] == ""
    assert "profiles/99/report.json" in hand["problem"] and "1 of 1 rows" in hand["problem"]
    assert (await get("runs", "profiled", "metrics"))["last_step"] == 3


# ---------------------------------------------------------------------------- the panel
def _render_panel(tmp_path: Path, panel: TrainPanel) -> dict[str, Any]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (needed to render the panel's ES module)")
    module = tmp_path / "train_panel.mjs"
    module.write_text(_assets.esm("train_panel"))
    state = {"info": panel.info, "status": panel.status, "history": panel.history}
    (tmp_path / "state.json").write_text(json.dumps(state, allow_nan=False))
    out = subprocess.run([node, str(JS_HERE / "render.mjs"), str(module),
                          str(tmp_path / "state.json")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_train_panel_shows_predicted_beside_measured(tmp_path: Path) -> None:
    pred = {"step_seconds": 0.02, "mfu": 0.3, "bound": "compute", "source": "estimate"}
    with runs.RunWriter(tmp_path / "run", config={"m": 1}, meta={"prediction": pred}) as w:
        for s in (1, 2):
            w.log({"step": s, "loss": 2.0 / s, "mfu": 0.15, "step_time": 0.03,
                   "data_time": 0.0, "ckpt_time": 0.0})
    panel = TrainPanel(tmp_path / "run", target=4, start=2)   # read from run.json
    assert panel.info["prediction"] == runs.clean_prediction(pred)
    panel.status = dict(panel.status, last={"mfu": 0.15, "loss": 1.0})
    text = _render_panel(tmp_path, panel)["text"]
    assert f"MFU 15.0% (pred. {100 * pred['mfu']:.1f}%)" in text, text
    ms, ratio = 1000 * pred["step_seconds"], 0.03 / pred["step_seconds"]
    want = (f"step time 30.0 ms (mean of last 20; predicted {ms:.1f} ms, "
            f"measured {ratio:.3g}× that)")
    assert want in text, text

    _hand_edited(tmp_path, "bad", MALFORMED)
    bad = TrainPanel(tmp_path / "bad", target=4, start=1)
    assert bad.info["prediction"] is None
    text = _render_panel(tmp_path, bad)["text"]
    assert "pred." not in text and "predicted" not in text, text
    assert "step time 50.0 ms (mean of last 20)" in text, text
    # a prediction handed over directly is checked the same way
    given = TrainPanel(tmp_path / "bad", target=4, start=1, prediction=json.loads(PARTLY))
    assert given.info["prediction"] == runs.clean_prediction(json.loads(PARTLY))
