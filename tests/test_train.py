"""The Trainer: steps from 1, run targets, metrics and run.json, errors, Ctrl-C, panel."""
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import time

import jax
import numpy as np
import pytest

import workbench as wb
import workbench.train._trainer  # noqa: F401 - wb.train._trainer below
from workbench import _runs as runs
from workbench.data import ShardedBatches
from workbench._flops import gpt_flops
from workbench._sharding.mesh import make_mesh
from workbench._sharding.rules import Rules
from workbench._step import init_state, jit_train_step, make_train_step
from workbench._train_state import batch_shardings, state_shardings
from workbench.train._setup import RunConfigMismatch

from _tolerance import assert_close_at_scale

CFG = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                     rules="fsdp", batch=8, seq=32, steps=6, checkpoint_every=2,
                     data="synthetic", optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=2))


pytestmark = pytest.mark.usefixtures("wb_cache")


def trainer(run_dir, cfg=CFG, **kw):
    kw.setdefault("progress", None)
    return wb.Trainer(cfg, run_dir=run_dir, **kw)   # compile cache under WORKBENCH_CACHE


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of CFG (6 steps) and its run directory."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    tr = trainer(run_dir)
    tr.run()
    return tr, run_dir


def bare_losses(cfg, n):
    """The same steps by hand: workbench._step + the same data, no Trainer."""
    mesh = make_mesh(dict(cfg.mesh))
    rules = Rules.preset(cfg.rules, mesh)
    tx = cfg.optimizer.build(cfg.steps)
    graphdef, state = init_state(cfg.model_config(), tx, rules, mesh, seed=cfg.seed)
    bsh = batch_shardings(rules, mesh)
    step = jit_train_step(make_train_step(graphdef, tx, rules=rules, mesh=mesh),
                          state_shardings(cfg.model_config(), tx, rules, mesh), bsh)
    data = ShardedBatches(cfg.data, seq=cfg.seq, batch=cfg.batch, seed=cfg.seed,
                          sharding=bsh["inputs"], vocab_size=cfg.model_config().vocab_size)
    out = []
    for _ in range(n):
        state, metrics = step(state, next(data))
        out.append(float(metrics["loss"]))
    return out


@pytest.mark.slow
def test_run_targets_steps_from_one_and_metrics(tmp_path, capsys):
    tr = trainer(tmp_path / "run", progress="line")
    first = tr.run(steps=2)
    assert first.status == "finished" and tr.step == 2
    assert [r["step"] for r in runs.read_metrics(tr.run_dir)] == [1, 2]
    tr.run()                                               # to config.steps = 6
    again = tr.run()
    assert again.status == "finished" and "already at step 6" in again.message
    printed = capsys.readouterr()
    assert "already at step 6 (target 6); nothing to do" in printed.out
    assert "step 6/6 | loss" in printed.err and "ETA" in printed.err   # the progress line
    recs = runs.read_metrics(tr.run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6] and int(tr.state.step) == 6
    assert tr.losses == bare_losses(CFG, 6)                # bitwise: the one train step
    sched = CFG.optimizer.schedule(CFG.steps)
    flops = gpt_flops(CFG.model_config(), batch=8, seq=32).total
    meta = runs.read_run(tr.run_dir)
    peak = meta["peak_flops"]
    for r in recs:
        assert r["lr"] == pytest.approx(float(sched(r["step"] - 1)), rel=1e-6)
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["step_time"])
        assert r["model_flops"] == flops
        assert r["mfu"] == pytest.approx(flops / (r["step_time"] * 8 * peak))
        assert r["hfu"] == pytest.approx(tr.compiled_flops / (r["step_time"] * peak))
        assert (r["ckpt_time"] > 0) == (r["step"] % 2 == 0)
        assert 0 <= r["data_time"] < r["step_time"] and r["grad_norm"] > 0
        assert r["peak_source"] == meta["peak_source"]
    events = runs.read_events(tr.run_dir)
    assert [e["event"] for e in events] == ["compile", "resume"] and events[1]["step"] == 2
    assert events[0]["seconds"] > 0
    assert meta["status"] == "finished" and meta["config"] == CFG.to_dict()
    assert meta["mesh"] == {"data": 8} and len(meta["devices"]) == 8
    assert meta["target_steps"] == 6 and meta["step"] == 6 and "jax" in meta["versions"]
    assert tr.checkpoints.all_steps() == [2, 4, 6]


class _Collect:
    """A plain sink of the test's own: every call the run loop makes, in order."""

    def __init__(self):
        self.calls = []

    def event(self, kind, **fields):
        self.calls.append(("event", kind, fields))

    def update(self, record):
        self.calls.append(("update", record))

    def finish(self, status, message=None):
        self.calls.append(("finish", status, message))

    def records(self):
        return [c[1] for c in self.calls if c[0] == "update"]

    def events(self):
        return [(c[1], c[2]) for c in self.calls if c[0] == "event"]


def _written(run_dir, steps=None):
    """The reference: step records as the run writer wrote them (less its time stamp)."""
    return [{k: v for k, v in r.items() if k != "time"} for r in runs.read_metrics(run_dir)
            if steps is None or r["step"] in steps]


@pytest.mark.slow
def test_a_custom_sink_gets_what_the_run_writer_wrote(tmp_path):
    tr = trainer(tmp_path / "run", CFG.replace(checkpoint_every=1))  # snapshot saves too
    first, second = _Collect(), _Collect()
    done = tr.run(steps=3, sinks=[first])
    again = tr.run(steps=5, sinks=[second])
    for sink, steps, result in ((first, [1, 2, 3], done), (second, [4, 5], again)):
        kinds = [c[0] for c in sink.calls]                     # events, steps, then finish
        n_events = len(sink.events())
        assert kinds == ["event"] * n_events + ["update"] * len(steps) + ["finish"]
        assert [r["step"] for r in sink.records()] == steps    # each step once, in order
        assert sink.records() == _written(tr.run_dir, steps)   # the very records written
        assert sink.calls[-1] == ("finish", "finished", result.message)
    written = [(e["event"], {k: v for k, v in e.items() if k not in ("event", "time")})
               for e in runs.read_events(tr.run_dir)]
    assert first.events() == [("compiling", {}), *written[:1]]  # compiling: before run.json
    assert written[0] == ("compile", {"seconds": tr.compile_seconds, "cache": tr.compile_cache,
                                      "attention": tr.parts.attention,
                                      "dtype": tr.parts.dtype, "compiler_options": {}})
    # on CPU, "auto" runs XLA attention and float32, and says so; CPU has no overlap flags
    assert tr.parts.attention.startswith("xla: auto: XLA attention on cpu")
    assert tr.parts.dtype == "float32: auto: float32 on cpu"
    assert second.events() == written[1:] == [("resume", {"step": 3})]
    assert tr.history == first.records() + second.records()


def test_batch_not_divisible_by_the_data_axes():
    with pytest.raises(ValueError, match=r"batch=12 is not divisible by the 8 devices .*'data'"):
        trainer("unused", CFG.replace(batch=12))
    with pytest.raises(ValueError, match=r"micro-batch batch/accumulate=16/4=4 is not divisible"):
        trainer("unused", CFG.replace(batch=16, optimizer=CFG.optimizer.replace(accumulate=4)))


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    bad = CFG.replace(steps=8, optimizer=wb.train.AdamW(lr=1e4, warmup_steps=0, clip_norm=None))
    tr = trainer(tmp_path / "run", bad)
    sink = _Collect()
    with pytest.raises(wb.train._trainer.NonFiniteLoss, match=r"is nan.* at step 4;.*"
                       r"checkpoint step 2"):
        tr.run(sinks=[sink])
    assert tr.checkpoints.all_steps() == [2]
    meta = runs.read_run(tr.run_dir)
    assert meta["status"] == "failed" and "at step 4" in meta["error"]
    assert [r["step"] for r in runs.read_metrics(tr.run_dir)] == [1, 2, 3]
    assert sink.records() == _written(tr.run_dir)             # step 4 is never reported
    assert sink.calls[-1] == ("finish", "failed", meta["error"])
    assert tr.step == 2 and int(tr.state.step) == 2         # back at the good checkpoint
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tr.state.params))


@pytest.mark.slow
def test_run_dir_with_another_config_is_refused_with_a_diff(reference, tmp_path):
    _, run_dir = reference
    other = CFG.replace(seq=16, optimizer=CFG.optimizer.replace(lr=1e-3))
    with pytest.raises(RunConfigMismatch) as err:
        trainer(run_dir, other)
    text = str(err.value)
    assert "optimizer.lr: 0.01" in text and "-> 0.001 (given)" in text and "seq: 32" in text
    assert "fork=True" in text and "force=True" in text
    new_data = CFG.replace(data=wb.data.SyntheticData(size=1000))   # fine-tune on other data
    fork = trainer(run_dir, new_data, fork=True)
    assert fork.run_dir.name.startswith("run-fork-") and fork.step == 6
    ref_tr, _ = reference
    assert fork.losses == ref_tr.losses                     # history of the source run
    assert trainer(run_dir, CFG.replace(checkpoint_every=3, keep=5)).step == 6  # run control
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    fork.run(steps=7)
    assert [r["step"] for r in runs.read_metrics(fork.run_dir)] == list(range(1, 8))
    assert runs.read_metrics(fork.run_dir)[:6] == runs.read_metrics(run_dir)  # inherited curve
    assert runs.read_run(run_dir)["step"] == 6                               # source untouched
    forced = trainer(copy, new_data, force=True)
    forced.run(steps=7)
    changed = [e for e in runs.read_events(copy) if e["event"] == "config_changed"]
    assert changed[0]["diff"] == {"data.size": [1 << 20, 1000]} and changed[0]["step"] == 6
    assert runs.read_run(copy)["config"]["data"]["size"] == 1000


class _InterruptAt:
    """A sink that presses Ctrl-C (a real SIGINT to this process) at one step."""

    def __init__(self, step):
        self.step, self.finished = step, None

    def update(self, rec):
        if rec["step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)

    def event(self, kind, **fields):
        pass

    def finish(self, status, message=None):
        self.finished = (status, message)


def test_ctrl_c_stops_at_a_step_boundary_saves_and_continues_exactly(reference, tmp_path):
    ref_tr, _ = reference
    sink = _InterruptAt(3)
    tr = trainer(tmp_path / "run")
    result = tr.run(sinks=[sink])
    assert result.status == "interrupted" and 3 <= tr.step < 6
    assert tr.checkpoints.all_steps()[-1] == tr.step        # saved at the stopping step
    assert sink.finished[0] == "interrupted"
    assert f"SIGINT: stopped at step {tr.step} of 6" in result.message
    assert "trainer.run(6)" in result.message
    assert runs.read_run(tr.run_dir)["status"] == "interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # restored
    again = trainer(tmp_path / "run")                       # as after a kernel restart
    again.run()
    assert again.losses == ref_tr.losses


def _tensorboard_scalars(folder):
    from tensorboardX.proto import event_pb2

    out = {}
    for path in folder.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_tensorboard_export_mirrors_the_metrics(tmp_path):
    tr = trainer(tmp_path / "run", CFG.replace(trackers=["tensorboard"]))
    tr.run(steps=2)
    tr.close()   # the trackers send after run() returns; close() delivers the rest
    scalars = _tensorboard_scalars(tmp_path / "run" / "tensorboard")
    recs = runs.read_metrics(tmp_path / "run")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2]
    for (_, v), r in zip(scalars["train/loss"], recs, strict=True):
        assert v == pytest.approx(r["loss"], rel=1e-6)
    assert {"train/mfu", "train/lr", "train/step_time"} <= set(scalars)


def test_run_result_and_repr(reference):
    tr, run_dir = reference
    assert "step=6/6" in repr(tr) and str(run_dir) in repr(tr)
    assert math.isfinite(tr.losses[-1]) and tr.losses[-1] < tr.losses[0]
    assert json.loads((run_dir / runs.RUN_JSON).read_text())["model_flops_per_step"] > 0


# ----------------------------------------------------------------------------- the panel
def test_panel_batches_updates_and_shows_the_whole_run_after_resume(reference, tmp_path):
    from workbench.widgets._train_panel import TrainPanel

    _, run_dir = reference
    panel = TrainPanel(run_dir, target=400, start=6, rate=10.0)
    assert panel.history["step"] == [1, 2, 3, 4, 5, 6]            # read from the run dir
    assert panel.history["loss"] == [r["loss"] for r in runs.read_metrics(run_dir)]
    sent = []
    panel.send = lambda content, buffers=None: sent.append(content)  # the comm, observed
    t0 = time.monotonic()
    rows = 0
    for step in range(7, 400):                                     # ~20k records/s
        panel.update({"step": step, "loss": 1.0, "mfu": 0.1, "step_time": 1e-3,
                      "data_time": 0.0, "ckpt_time": 0.0})
        rows += 1
        if step % 50 == 0:
            time.sleep(0.05)
    elapsed = time.monotonic() - t0
    panel.finish("finished", "done")
    assert len(sent) <= 10 * elapsed + 2                           # at most 10 per second
    got = [r[0] for m in sent for r in m["rows"]]
    assert got == list(range(7, 400)) and rows == len(got)         # nothing lost, in order
    assert panel.status["state"] == "finished" and panel.status["step"] == 399
    text = repr(panel)                                             # the text form
    assert text.startswith("TrainPanel") and "finished: step 399/400" in text
    assert "loss 1.0000" in text and "MFU 10.0%" in text and str(run_dir) in text


_HARNESS = r"""
import { readFileSync } from "node:fs";
class N {
  constructor(tag) { this.tag = tag; this.children = []; this.attrs = {}; this.text = "";
    this.className = ""; const p = {}; this.style = { setProperty: (k, v) => { p[k] = v; }, p }; }
  appendChild(c) { this.children.push(c); return c; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  getAttribute(k) { return this.attrs[k] ?? null; }
  set textContent(v) { this.text = String(v); this.children = []; }
  get textContent() { return this.text + this.children.map((c) => c.textContent).join(""); }
}
globalThis.document = { createElement: (t) => new N(t), createElementNS: (ns, t) => new N(t) };
const mod = await import(process.argv[2]);
const state = JSON.parse(readFileSync(process.argv[3], "utf8"));
const handlers = {};
const model = { get: (k) => state[k], on: (e, f) => { (handlers[e] ||= []).push(f); },
  off: (e, f) => { handlers[e] = handlers[e].filter((g) => g !== f); } };
const host = new N("div");
const cleanup = mod.default.render({ model, el: host });
const walk = (n, out = []) => { out.push(n); n.children.forEach((c) => walk(c, out)); return out; };
const paths = () => walk(host).filter((n) => n.tag === "path").map((n) => n.attrs.d);
const before = { text: host.textContent, paths: paths() };
const nodes = walk(host).length;
for (const f of handlers["msg:custom"]) f({ type: "append", rows: [[5, 2.5, 0.02, 0.1, 0.01, 0.0],
  [6, 2.0, 0.03, 0.1, 0.01, 0.05]] });
const after = { text: host.textContent, paths: paths(), same_nodes: walk(host).length === nodes };
cleanup();
const left = Object.values(handlers).reduce((a, h) => a + h.length, 0);
process.stdout.write(JSON.stringify({ before, after, left }));
"""


def test_panel_js_draws_history_and_live_rows(tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    from workbench.widgets._train_panel import STATIC

    (tmp_path / "h.mjs").write_text(_HARNESS)
    state = {"info": {"name": "tiny", "run_dir": "runs/tiny", "peak_source": "measured"},
             "status": {"step": 4, "target": 10, "eta": 65, "state": "running",
                        "last": {"loss": 3.0, "mfu": 0.012}},
             "history": {"step": [1, 2, 3, 4], "loss": [5.0, 4.0, 3.5, 3.0],
                         "mfu": [0.01, 0.011, 0.012, 0.012], "step_time": [0.1] * 4,
                         "data_time": [0.02] * 4, "ckpt_time": [0.0, 0.04, 0.0, 0.04]}}
    (tmp_path / "s.json").write_text(json.dumps(state))
    out = subprocess.run([node, str(tmp_path / "h.mjs"), (STATIC / "train_panel.js").as_uri(),
                          str(tmp_path / "s.json")], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    text = rep["before"]["text"]
    assert "step 4/10" in text and "ETA 1:05" in text and "MFU 1.20%" in text
    assert "step time 100.0 ms (mean of last 20): compute 60.0 ms · data 20.0 ms · " \
           "checkpoint 20.0 ms" in text
    loss_path = rep["before"]["paths"][0]
    assert loss_path.count("L") == 3 and loss_path.startswith("M48.0,")     # 4 points
    assert rep["after"]["paths"][0].count("L") == 5 and rep["after"]["same_nodes"]
    assert rep["left"] == 0                                                 # handlers removed


@pytest.mark.notebook
def test_notebook_cell_shows_one_live_panel(reference, tmp_path):
    """A real kernel runs the cell: one widget output, no flood of text."""
    import nbformat
    from nbclient import NotebookClient

    _, run_dir = reference
    shutil.copytree(run_dir, tmp_path / "run")
    code = ("import os\nos.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'\n"
            "os.environ['JAX_PLATFORMS'] = 'cpu'\n"
            f"os.environ['WORKBENCH_CACHE'] = {os.environ['WORKBENCH_CACHE']!r}\n"
            "import workbench as wb\n"
            f"cfg = wb.TrainConfig.from_json({CFG.to_json()!r})\n"
            f"trainer = wb.Trainer(cfg, run_dir={str(tmp_path / 'run')!r})\n"
            "result = trainer.run(steps=8)")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code),
                                         nbformat.v4.new_code_cell("result.status, trainer.step")])
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    views = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1 and len(outputs) <= 3, outputs
    assert not any(o.output_type == "error" for o in outputs)
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "('finished', 8)"
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    panel = next(w["state"] for w in state.values() if "history" in w["state"])
    assert panel["status"]["step"] == 8 and panel["history"]["step"] == [1, 2, 3, 4, 5, 6]


def test_trainer_from_a_plan_and_its_materialized_model(reference, tmp_path):
    """plan.materialize(seed) gives the same start as TrainConfig(seed): same losses."""
    ref_tr, _ = reference
    mesh = make_mesh(data=8)
    plan = wb.plan(CFG.model_config(), mesh=mesh, rules="fsdp", batch=8, seq=32)
    model = plan.materialize(seed=0)
    tr = wb.Trainer.from_plan(plan, tmp_path / "run", model=model, optimizer=CFG.optimizer,
                              steps=6, data="synthetic", checkpoint_every=2, progress=None)
    assert tr.config.model == CFG.model_config() and tr.config.rules == plan.rules
    assert wb.TrainConfig.from_json(tr.config.to_json()) == tr.config
    np.testing.assert_array_equal(np.asarray(tr.state.params["embed"]),
                                  np.asarray(nnx_params(model)["embed"]))
    tr.run()
    assert tr.losses == ref_tr.losses


def nnx_params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """2 micro-batches of 8 (optax.MultiSteps) == one batch of 16 from the same stream."""
    big = CFG.replace(batch=16)
    acc = big.replace(optimizer=CFG.optimizer.replace(accumulate=2))
    a, b = trainer(tmp_path / "acc", acc), trainer(tmp_path / "big", big)
    a.run(steps=2)
    b.run(steps=2)
    assert int(a.state.step) == 4 and int(b.state.step) == 2     # micro-steps vs updates
    # two micro-batch means vs one mean of 16 rows, 2 steps: 80 eps (see _tolerance)
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params),
                    strict=True):
        assert_close_at_scale(x, y, rtol=1e-4)   # after Adam: at each tensor's scale
    assert runs.read_metrics(a.run_dir)[0]["tokens_per_s"] == pytest.approx(
        16 * 32 / runs.read_metrics(a.run_dir)[0]["step_time"])
