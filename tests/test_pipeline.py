"""Pipeline parallelism over the ``stage`` axis: the same function and the same training as
the unpipelined scanned model, resumable, restorable across meshes, launchable; schedules
and bad input.

References: the scanned model without a pipeline (itself checked against the unrolled
model in test_scan_layers), a hand count of each schedule, and the compiled HLO.
"""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import workbench as wb
from workbench import _runs as runs
from workbench.models import GPT, GPTConfig
from workbench.models._pipeline import Pipeline, activate, active
from workbench.models._schedule import in_flight, schedule_bubble, timeline

from _tolerance import assert_close_at_scale

pytestmark = pytest.mark.usefixtures("wb_cache")

N = 16        # steps of the pipelined run
EXTRA = 3     # steps after it on another mesh, and again back
MODEL = {"n_layers": 8, "scan_layers": True}
COMMON = dict(model="tiny", model_overrides=MODEL, batch=8, seq=32, checkpoint_every=3,
              data=wb.data.TextData(max_bytes=100_000),
              optimizer=wb.train.AdamW(lr=1e-3, warmup_steps=3, decay_steps=100))
REF = wb.TrainConfig(**COMMON, mesh={"data": 8}, rules="fsdp", steps=N + 2 * EXTRA)
PIPE = wb.TrainConfig(**COMMON, mesh={"stage": 4, "data": 2}, rules="fsdp", steps=N,
                      pipeline={"microbatches": 4, "schedule": "gpipe"})


# ------------------------------------------------------------------ the function
def _logits_and_grads(graphdef, tokens, traced):
    """``params -> (logits, gradients of mean(logits**2))``, a new function each call:
    jax.jit keeps traces per function and the pipeline is read while tracing, so a
    function traced once without a pipeline would run unpipelined under ``activate`` too.
    Each trace appends the active pipeline to ``traced``."""
    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)

    def logits_and_grads(p):
        traced.append(active())
        return nnx.merge(graphdef, p)(tokens), jax.grad(loss)(p)
    return logits_and_grads


@pytest.fixture(scope="module")
def scanned():
    """The plain scan's (graphdef, params, tokens, logits, gradients) on one device: the
    reference of every pipeline below, computed once."""
    model = GPT(GPTConfig.preset("tiny", **MODEL), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (12, 16), 0, 256)
    traced = []
    logits, grads = jax.jit(_logits_and_grads(graphdef, tokens, traced))(params)
    assert traced == [None]
    return graphdef, params, tokens, logits, grads


@pytest.mark.parametrize("pipe,stages", [
    (Pipeline(microbatches=4), 4),
    (Pipeline(microbatches=6, schedule="circular", repeats=2), 2),   # M > S: a delay buffer
])
@pytest.mark.slow
def test_pipelined_model_is_the_scanned_model(scanned, pipe, stages):
    """Logits and gradients of the pipelined blocks equal the plain scan (one device)."""
    graphdef, params, tokens, ref_logits, ref_grads = scanned
    traced = []
    with activate(pipe, stages):   # active while jit traces
        logits, grads = jax.jit(_logits_and_grads(graphdef, tokens, traced))(params)
    assert traced == [(pipe, stages)]   # traced here, through the pipeline
    # micro-batched matmuls sum in another order, the gradients over 4-6 micro-batches:
    # each tensor at its own scale, 80 eps of it (seen: bitwise equal on one device)
    assert_close_at_scale(logits, ref_logits, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close_at_scale(a, b, rtol=1e-5)


# ------------------------------------------------------------------ schedules
@pytest.mark.parametrize("schedule,m,r", [("gpipe", 4, 1), ("gpipe", 1, 1), ("1f1b", 8, 1),
                                          ("1f1b", 2, 1), ("circular", 4, 2), ("circular", 6, 3)])
def test_timeline_counts_and_bubble(schedule, m, r):
    """Hand count: every stage runs R M forward and R M backward chunks; the timeline's idle
    fraction is the formula (S-1)/(R M+S-1); activations held: R M chunks for GPipe and
    circular, min(S - s, M) for 1F1B."""
    s = 4
    pipe = Pipeline(microbatches=m, schedule=schedule, repeats=r)
    events = timeline(pipe, s)
    for stage in range(s):
        mine = [e for e in events if e.stage == stage]
        assert sorted((e.kind, e.micro, e.repeat) for e in mine) == sorted(
            (k, i, j) for k in "FB" for i in range(m) for j in range(r))
        assert all(a.end <= b.start + 1e-9 for a, b in zip(mine, mine[1:]))  # one at a time
    assert schedule_bubble(events, s) == pytest.approx((s - 1) / (r * m + s - 1))
    assert pipe.bubble_fraction(s) == pytest.approx((s - 1) / (r * m + s - 1))
    want = [min(s - i, m) for i in range(s)] if schedule == "1f1b" else [r * m] * s
    assert in_flight(events, s) == want
    # dependencies: a forward after the previous stage's, a backward after the next one's
    end = {(e.kind, e.stage, e.repeat * m + e.micro): e for e in events}
    for e in events:
        i = e.repeat * m + e.micro
        if e.kind == "F" and e.stage > 0:
            assert end[("F", e.stage - 1, i)].end <= e.start + 1e-9
        if e.kind == "B" and e.stage < s - 1:
            assert end[("B", e.stage + 1, i)].end <= e.start + 1e-9


# ------------------------------------------------------------------ bad input
def test_bad_pipelines_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"n_layers=6 is not divisible by stages x repeats"):
        PIPE.replace(model_overrides={"n_layers": 6, "scan_layers": True})
    with pytest.raises(ValueError, match=r"batch=6 is not divisible by microbatches=4"):
        PIPE.replace(batch=6)
    with pytest.raises(ValueError, match=r"scan_layers=False.*'scan_layers': True"):
        PIPE.replace(model_overrides={"n_layers": 8})
    with pytest.raises(ValueError, match=r"needs a 'stage' mesh axis"):
        PIPE.replace(mesh={"data": 8})
    with pytest.raises(ValueError, match=r"repeats=2 needs schedule='circular'"):
        PIPE.replace(pipeline={"microbatches": 4, "repeats": 2})
    with pytest.raises(ValueError, match=r"microbatches=2 < stages=4.*microbatches >= 4"):
        PIPE.replace(pipeline={"microbatches": 2, "schedule": "circular", "repeats": 2})
    with pytest.raises(ValueError, match=r"'1f1b' is planned and drawn but not trained"):
        PIPE.replace(pipeline={"microbatches": 4, "schedule": "1f1b"})
    with pytest.raises(ValueError, match=r"unknown pipeline keys \['stages'\]"):
        PIPE.replace(pipeline={"microbatches": 4, "stages": 4})
    cfg = GPTConfig.preset("tiny", **MODEL)
    mesh = wb.make_mesh(stage=4, data=2)
    pipe = {"microbatches": 4}
    with pytest.raises(ValueError, match=r"rules map 'layers' to None.*layers='stage'"):
        wb.plan(cfg, mesh=mesh, rules=wb.Rules.preset("fsdp", mesh).replace(layers=None),
                batch=8, seq=32, pipeline=pipe)
    with pytest.raises(ValueError, match=r"rules shard 'batch' over \('data', 'stage'\)"):
        wb.plan(cfg, mesh=mesh, batch=8, seq=32, pipeline=pipe,
                rules=wb.Rules.preset("fsdp", mesh).replace(batch=("data", "stage")))
    with pytest.raises(ValueError, match=r"micro-batch of batch/microbatches = 8/8 = 1 "
                                         r"sequences does not split over the 2 devices"):
        wb.plan(cfg, mesh=mesh, batch=8, seq=32, pipeline={"microbatches": 8})
    with pytest.raises(ValueError, match=r"scan_layers=True"):
        wb.plan(cfg.replace(scan_layers=False), mesh=mesh, batch=8, seq=32, pipeline=pipe)


# ------------------------------------------------------------------ the plan
def test_plan_reports_bubble_stage_memory_and_the_compiled_permutes():
    cfg = GPTConfig.preset("tiny", **MODEL)
    mesh = wb.make_mesh(stage=4, data=2)
    p = wb.plan(cfg, mesh=mesh, batch=8, seq=32, progress=False,
                pipeline={"microbatches": 4, "schedule": "circular", "repeats": 2})
    pp = p.pipeline
    assert (pp["stages"], pp["iterations"]) == (4, 2 * 4 + 4 - 1)
    assert pp["bubble_formula"] == pytest.approx(3 / 11)
    assert pp["bubble_schedule"] == pytest.approx(3 / 11)
    assert len(pp["stage_memory"]) == 4 and pp["in_flight"] == [8] * 4
    # the compiled program shifts micro-batches between stages: collective permutes whose
    # pairs follow the stage axis, in the pipeline loop, one micro-batch's activation each
    hlo = p.compiled.as_text()
    assert "collective-permute" in hlo
    shifts = [c for c in pp["permutes"] if c["axes"] == ["stage"]]
    assert any(c["in_loop"] for c in shifts)
    assert any(s == "f32[1,1,32,64]" for c in shifts for s in c["shapes"])   # (1, mb/2, T, D)
    assert "pipeline:" in p.summary() and p.report.to_dict()["pipeline"]["stages"] == 4
    # parameters of the blocks are split over the stages: a quarter of the layers each
    assert p.layouts["params.blocks.attn.q"].shard_shape[0] == 8 // 4
    # 1F1B: by formula, fewer activations held on the first stages than GPipe
    f1b = wb.plan(cfg, mesh=mesh, batch=8, seq=32, progress=False,
                  pipeline={"microbatches": 4, "schedule": "1f1b"})
    gp = wb.plan(cfg, mesh=mesh, batch=8, seq=32, progress=False, compile=False,
                 pipeline={"microbatches": 4, "schedule": "gpipe"})
    assert f1b.report.is_estimate and f1b.pipeline["in_flight"] == [4, 3, 2, 1]
    assert f1b.pipeline["stage_memory"][3] < gp.pipeline["stage_memory"][3]


# ------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tr = wb.Trainer(REF, run_dir=tmp_path_factory.mktemp("ref") / "run", progress=None)
    tr.run()
    return tr.losses


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pipe") / "run"
    tr = wb.Trainer(PIPE, run_dir=run_dir, progress=None)
    tr.run()
    return run_dir, tr.losses


@pytest.mark.slow
def test_pipelined_training_has_the_unpipelined_losses(reference, pipelined):
    """stage=4 x data=2, GPipe with 4 micro-batches: the losses of data=8 to float32
    rounding (micro-batched matmuls sum in another order)."""
    _, losses = pipelined
    assert len(losses) == N and losses[-1] < losses[0]
    np.testing.assert_allclose(losses, reference[:N], rtol=1e-5)


@pytest.mark.slow
def test_stage_fsdp_tp_circular_training_has_the_unpipelined_losses(reference, tmp_path):
    """stage=2 x fsdp=2 x tp=2 with rules fsdp_tp, circular schedule with 2 repeats."""
    cfg = wb.TrainConfig(**COMMON, mesh={"stage": 2, "fsdp": 2, "tp": 2}, rules="fsdp_tp",
                         steps=4, pipeline={"microbatches": 2, "schedule": "circular",
                                            "repeats": 2})
    tr = wb.Trainer(cfg, run_dir=tmp_path / "run", progress=None)
    tr.run()
    assert tr.rules["layers"] == "stage" and tr.rules["embed"] == "fsdp"
    np.testing.assert_allclose(tr.losses, reference[:4], rtol=1e-5)


@pytest.mark.slow
def test_a_new_trainer_resumes_a_pipelined_run_bitwise(pipelined, tmp_path):
    """Stopped at step 6 and continued to N by a new Trainer: the stage-sharded state and
    the data position restore exactly, so the losses are the uninterrupted run's, bitwise.
    (A writer killed mid-step is test_resume's: checkpoints do not depend on the model.)"""
    _, want = pipelined
    run_dir = tmp_path / "run"
    first = wb.Trainer(PIPE, run_dir=run_dir, progress=None)
    first.run(steps=6)
    first.close()
    tr = wb.Trainer(PIPE, run_dir=run_dir, progress=None)
    assert tr.step == 6
    tr.run()
    assert tr.losses == want


@pytest.mark.slow
def test_restore_onto_a_mesh_without_pipelining_and_back(reference, pipelined, tmp_path):
    """The pipelined checkpoint continues on data=8 without a pipeline, then pipelined again:
    the losses of the unpipelined run throughout (to float32 rounding)."""
    src, _ = pipelined
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    flat = PIPE.replace(mesh={"data": 8}, pipeline=None, steps=N + EXTRA)
    tr = wb.Trainer(flat, run_dir=run_dir, progress=None)
    assert tr.step == N
    tr.run()
    back = PIPE.replace(steps=N + 2 * EXTRA)
    tr = wb.Trainer(back, run_dir=run_dir, progress=None)
    assert tr.step == N + EXTRA
    tr.run()
    assert len(tr.losses) == N + 2 * EXTRA
    np.testing.assert_allclose(tr.losses, reference, rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_two_processes_by_four_devices(pipelined, tmp_path):
    """wb.launch: 2 processes x 4 devices, data=2 x stage=4 (each process holds the 4
    stages of its data shard: the data loader gives each process a disjoint block of
    rows): the in-process run's losses (gloo sums in another order: float32 rounding)."""
    from workbench.jobs import launch

    _, want = pipelined
    cfg = PIPE.replace(steps=6, mesh={"data": 2, "stage": 4})
    job = launch(cfg, processes=2, devices_per_process=4, run_dir=tmp_path / "job",
                 platform="cpu")
    assert job.wait(600) == "finished", job.tail()
    got = [r["loss"] for r in runs.read_metrics(tmp_path / "job")]
    np.testing.assert_allclose(got, want[:6], rtol=1e-5)


# ------------------------------------------------------------------ the schedule widget
def _drawn(report):
    """(kind, stage, micro, repeat, start, end) of every block the widget drew."""
    out = []
    for b in report["blocks"]:
        kind, stage, micro, repeat = b["data-block"].split(":")
        start, end = map(float, b["data-devices"].split("-"))
        out.append((kind, int(stage), int(micro), int(repeat), start, end))
    return sorted(out)


def _python(pipe, stages):
    return sorted((e.kind, e.stage, e.micro, e.repeat, e.start, e.end)
                  for e in timeline(pipe, stages))


def _close(a, b):
    assert [x[:4] for x in a] == [x[:4] for x in b]
    # the widget writes start and end with toFixed(6): each within 5e-7 of Python's
    np.testing.assert_allclose([x[4:] for x in a], [x[4:] for x in b], rtol=0, atol=1e-6)


def test_schedule_widget_draws_the_timeline_and_follows_its_controls(tmp_path):
    """The widget (node, fake DOM) draws Python's timeline; after changing micro-batches,
    the schedule and repeats it draws Python's timeline of the new pipeline, and the
    shaded bubble's share is the schedule's."""
    from test_widgets_js import NODE, render

    from workbench.widgets._schedule_view import schedule_payload, schedule_widget

    if NODE is None:
        pytest.skip("node is not installed")
    sched = Pipeline(microbatches=4).on(4)
    payload = schedule_payload(sched)
    assert schedule_widget(sched).payload == payload
    report = render(tmp_path, "schedule", {"payload": payload})
    _close(_drawn(report), _python(Pipeline(microbatches=4), 4))
    assert report["classes"]["wb-schedule-track"] == 4
    assert "(4-1)/(1·4+4-1) = 42.9%" in report["text"]

    steps = [{"op": "change", "label": "micro-batches", "value": 6},
             {"op": "change", "label": "schedule", "value": "circular"},
             {"op": "change", "label": "repeats", "value": 2}]
    for n in range(1, 4):
        report = render(tmp_path, "schedule", {"payload": payload}, steps[:n])
        pipe = [Pipeline(microbatches=6), Pipeline(microbatches=6, schedule="circular"),
                Pipeline(microbatches=6, schedule="circular", repeats=2)][n - 1]
        _close(_drawn(report), _python(pipe, 4))
        state = report["state"]["payload"]
        assert (state["microbatches"], state["schedule"], state["repeats"]) == (
            pipe.microbatches, pipe.schedule, pipe.repeats)
        assert f"{pipe.on(4).bubble:.1%}" in report["text"]
    report = render(tmp_path, "schedule", {"payload": payload},
                    [{"op": "change", "label": "schedule", "value": "1f1b"},
                     {"op": "change", "label": "stages", "value": 3}])
    _close(_drawn(report), _python(Pipeline(microbatches=4, schedule="1f1b"), 3))
    assert report["handlers_left"] == 0


def test_search_plans_pipelined_candidates_like_wb_plan():
    """wb.search(stages=(1, 4)) adds stage=4 layouts (scanned, GPipe with 8 micro-batches);
    each row is the plan wb.plan makes of that layout, bubble included."""
    cfg = GPTConfig.preset("1b", seq_len=512)
    res = wb.search(cfg, "v5p-64", batch=64, strategies=("fsdp",), remat=("full",),
                    stages=(1, 4), exact=False, progress=False)
    piped = [r for r in res.rows if "pp=gpipe/8" in r["layout"]]
    assert piped and all(r["mesh"]["stage"] == 4 for r in piped)
    row = piped[0]
    p = wb.plan(cfg.replace(remat="full", scan_layers=True), mesh=wb.abstract_mesh(
        "v5p-64", **row["mesh"]), rules="fsdp", batch=64, seq=512, compile=False,
        progress=False, pipeline={"microbatches": 8, "schedule": "gpipe"})
    assert row["memory_per_device"] == p.memory["total"]
    assert p.pipeline["bubble_formula"] == pytest.approx(3 / 11)
    assert p.flops_per_device == pytest.approx(
        (p.model_flops + p.report.flops.recompute) / p.report.compute_split / (1 - 3 / 11))


def test_the_schedule_lives_beside_the_pipeline():
    """``Pipeline`` and its timeline are one module (``models/_schedule``: no import circle
    with planning)."""
    from workbench.models import _schedule as schedule

    assert Pipeline is schedule.Pipeline and isinstance(Pipeline(microbatches=2).on(2),
                                                        schedule.Schedule)
    assert timeline is schedule.timeline
