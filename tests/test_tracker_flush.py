"""When the trackers get the steps (issue 61 item 2: nothing in the train step waits on a
tracker): one thread sends every ``FLUSH_SECONDS``, after a checkpoint or an eval, and at the
end; ``update`` does no I/O, even while a tracker hangs; a run killed with SIGKILL loses at
most the steps of the last send window, and the resumed run continues the same tracker runs.
Read back with each library's own reader or format: TensorBoard's event records (their CRCs
checked, as TensorBoard reads them), ``MlflowClient``, ``wandb leet inspect``.
"""
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorboardX  # noqa: F401 - imported before a run times its tracker's start

import workbench as wb
from tests.test_trackers import (
    _assert_same_numbers,
    _first_per_step,
    _mlflow_numbers,
    _tiny,
    _wait,
    _wandb_files,
    _wandb_numbers,
    cfg,  # noqa: F401 - the fixture
    env,  # noqa: F401 - the fixture
    mlflow_db,  # noqa: F401 - the fixture
)
from workbench import _runs as runs
from workbench.train import _tracker_clients, _trackers

pytestmark = pytest.mark.usefixtures("wb_cache")
#: Seconds a send may take beyond its window on this shared 2-core machine (the thread
#: waits for the cores like everything else; a send of a window takes milliseconds).
SLACK = 2.0


def _tb_numbers(folder):
    """``{tag: {step: value}}`` of the complete records of the event files, oldest file first
    (each step's first value), read as TensorBoard reads them: a record whose length or data
    CRC does not check (cut short by a kill) ends its file."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    out = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):
            header, (n,) = data[i:i + 8], struct.unpack("Q", data[i:i + 8])
            if struct.unpack("I", data[i + 8:i + 12])[0] != masked_crc32c(header) \
                    or i + 16 + n > len(data):
                break
            body = data[i + 12:i + 12 + n]
            if struct.unpack("I", data[i + 12 + n:i + 16 + n])[0] != masked_crc32c(body):
                break
            event = event_pb2.Event.FromString(body)
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {}).setdefault(event.step, v.simple_value)
            i += 16 + n
    return out


def _assert_same_float32(got, recs):
    """``got[tag][step]`` is each number of the records as TensorBoard keeps it: float32."""
    for rec in recs:
        for key in _tracker_clients.KEYS:
            if isinstance(rec.get(key), float):
                assert got[_tracker_clients.tag(key)][rec["step"]] == np.float32(rec[key]), key


def _held(folder):
    return set(_tb_numbers(folder).get("train/loss", {}))


class Watch:
    """A sink after the trackers: steps of ``delay`` seconds, and at each what TensorBoard
    holds (``(time, step, steps held)``)."""

    def __init__(self, folder, delay):
        self.folder, self.delay, self.seen = folder, delay, []

    def event(self, kind, **fields):
        pass

    def update(self, record):
        time.sleep(self.delay)
        self.seen.append((time.time(), record["step"], _held(self.folder)))

    def finish(self, status, message=None):
        pass


def _assert_window(held, times, at, window):
    """``held`` (the steps a tracker has at time ``at``) is a prefix of the run's steps
    (what was sent is there) that lacks none older than ``window`` seconds."""
    assert held == set(range(1, len(held) + 1)), sorted(held)
    old = {s for s, t in times.items() if t < at - window}
    assert old <= held, (sorted(old - held), at)


@pytest.mark.slow
def test_the_steps_are_sent_every_flush_seconds(monkeypatch, tmp_path):
    monkeypatch.setattr(_trackers, "FLUSH_SECONDS", 0.5)
    watch = Watch(tmp_path / "run" / "tensorboard", delay=0.15)
    trainer = wb.Trainer(_tiny(trackers=["tensorboard"]).replace(steps=30, checkpoint_every=100),
                         tmp_path / "run", progress=None)
    trainer.run(sinks=[watch])
    trainer.close()
    recs = runs.read_metrics(tmp_path / "run")
    times = {r["step"]: r["time"] for r in recs}
    for at, _, held in watch.seen:
        _assert_window(held, times, at, _trackers.FLUSH_SECONDS + SLACK)
    assert any(held for at, step, held in watch.seen if step < 25)   # sent mid-run
    numbers = _tb_numbers(tmp_path / "run" / "tensorboard")
    assert sorted(numbers["train/loss"]) == list(range(1, 31))       # all at the end
    _assert_same_float32(numbers, recs)


def _until(found, timeout=60.0):
    t_end = time.monotonic() + timeout
    while not found() and time.monotonic() < t_end:
        time.sleep(0.05)


class WaitFor:
    """A sink that holds step 1 until the tracker's run started (and its first look at
    ``metrics.jsonl`` is done), and at step ``at`` waits for TensorBoard to hold ``step``
    and keeps what it holds then."""

    def __init__(self, folder, at, step):
        self.folder, self.at, self.step, self.held = folder, at, step, None

    def event(self, kind, **fields):
        pass

    def update(self, record):
        if record["step"] == 1:
            _until(lambda: any(p.stat().st_size for p in self.folder.glob("events.*")))
            time.sleep(0.5)
        if record["step"] == self.at:
            _until(lambda: self.step in _held(self.folder))
            self.held = _held(self.folder)

    def finish(self, status, message=None):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("trigger", ["checkpoint", "eval"])
def test_a_checkpoint_or_an_eval_sends_at_once(cfg, monkeypatch, tmp_path, trigger):  # noqa: F811
    monkeypatch.setattr(_trackers, "FLUSH_SECONDS", 1e6)    # never by the clock
    fields = {"checkpoint": {"checkpoint_every": 3, "eval_every": 0},
              "eval": {"checkpoint_every": 100, "eval_every": 3}}[trigger]
    run_cfg = cfg.replace(trackers=["tensorboard"], steps=6, **fields)
    wait = WaitFor(tmp_path / "run" / "tensorboard", at=5, step=3)
    trainer = wb.Trainer(run_cfg, tmp_path / "run", progress=None)
    trainer.run(sinks=[wait])
    trainer.close()
    assert wait.held == {1, 2, 3}                # sent after step 3; step 4 waits for a send
    assert sorted(_held(tmp_path / "run" / "tensorboard")) == list(range(1, 7))


def test_update_never_waits_while_a_tracker_hangs(env, monkeypatch, tmp_path):  # noqa: F811
    server = socket.socket()   # accepts connections (the backlog) and never answers
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.setattr(_trackers, "FINISH_SECONDS", 0.2)
    with runs.RunWriter(tmp_path / "run", config={}) as writer:
        sink = _trackers.open_trackers(["mlflow"], writer, 0)
        try:
            t0 = time.perf_counter()
            for step in range(1, 5001):      # each a step with an eval and a checkpoint
                sink.update({"step": step, "loss": 1.0, "eval_loss": 1.0, "ckpt_time": 0.1})
            took = time.perf_counter() - t0
            assert sink._thread.is_alive()   # still waiting for the server's answer
            assert took < 1.0, took          # microseconds each: no I/O, no queue to fill
            with pytest.warns(UserWarning, match="tracker 'mlflow' is still starting"):
                sink.finish("finished")       # the end of a run() call: waits for no send
            with pytest.warns(UserWarning, match="tracker 'mlflow' is still sending"):
                sink.close()
            with pytest.warns(UserWarning, match="tracker 'mlflow' could not start its run"):
                sink._thread.join(60)            # the client's timeout ends it
        finally:
            server.close()


CHILD = """
import sys, time
import workbench as wb
from workbench.train import _tracker_clients, _trackers

class Slow:   # the child's own sink: steps slow enough to be killed mid-run
    def event(self, kind, **fields): pass
    def update(self, record): time.sleep(0.25)
    def finish(self, status, message=None): pass

_trackers.FLUSH_SECONDS = float(sys.argv[3])
cfg = wb.TrainConfig.from_json(sys.argv[1])
wb.Trainer(cfg, run_dir=sys.argv[2], progress=None).run(sinks=[Slow()])
"""


def _started(run_dir):
    """The tracker runs started (their ids in run.json) and a checkpoint saved."""
    try:
        ids = runs.read_run(run_dir).get("trackers") or {}
    except (OSError, ValueError):
        return False
    ckpts = run_dir / "checkpoints"
    saved = ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())
    return {"wandb", "mlflow"} <= set(ids) and saved


def _stepped_past(run_dir, when):
    try:
        recs = runs.read_metrics(run_dir)
    except (OSError, ValueError):
        return False
    return bool(recs) and recs[-1]["time"] > when


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_sigkill_loses_at_most_the_last_window_and_the_resume_sends_it(
        cfg, env, tmp_path):  # noqa: F811
    flush = 1.0
    cfg = cfg.replace(trackers=["tensorboard", "wandb", "mlflow"], steps=120,
                      checkpoint_every=10, eval_every=0)
    run_dir, tb = tmp_path / "run", tmp_path / "run" / "tensorboard"
    # the child starts W&B's service of its own (WANDB_SERVICE would share this process's)
    child_env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, cfg.to_json(), str(run_dir),
                             str(flush)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env)
    try:
        _wait(proc, lambda: _started(run_dir), "tracker ids and a checkpoint")
        # the window holds once the trackers' runs have started (the thread starts them
        # one after the other, then sends): steps for a few windows after that
        later = time.time() + 3 * flush + 2 * SLACK
        _wait(proc, lambda: _stepped_past(run_dir, later), "steps a few windows later")
        killed = time.time()
        proc.send_signal(signal.SIGKILL)     # no finish: nothing more is sent
        proc.wait(timeout=60)
    finally:
        proc.kill()
    ids = runs.read_run(run_dir)["trackers"]
    recs = runs.read_metrics(run_dir)
    times = {r["step"]: r["time"] for r in recs}
    assert recs[-1]["step"] < 120
    # what each tracker holds: every step sent more than a window before the kill
    _assert_window(_held(tb), times, killed, flush + SLACK)
    _, numbers = _mlflow_numbers(env, ids["mlflow"]["run_id"])
    _assert_window(set(numbers["train/loss"]), times, killed, flush + SLACK)
    [(_, history)] = _wandb_files(run_dir, ids["wandb"]["id"])
    # W&B writes its file on a timer of its own, set to the same interval
    _assert_window(set(history), times, killed, 2 * flush + SLACK)
    tb_before = _held(tb)

    trainer = wb.Trainer(cfg, run_dir, progress=None)
    trainer.run()
    trainer.close()
    assert runs.read_run(run_dir)["trackers"] == ids                # the same tracker runs
    recs = runs.read_metrics(run_dir)
    steps = [r["step"] for r in recs]
    assert steps == list(range(1, 121))
    mlrun, numbers = _mlflow_numbers(env, ids["mlflow"]["run_id"])
    assert mlrun.info.status == "FINISHED" and sorted(numbers["train/loss"]) == steps
    _assert_same_numbers(numbers, recs)
    merged = _first_per_step(_wandb_files(run_dir, ids["wandb"]["id"]))
    assert sorted(merged) == steps
    _assert_same_numbers(_wandb_numbers(merged), recs)
    # TensorBoard, which cannot say what it holds, lacks the lost window only
    lost = set(range(max(tb_before) + 1, max(times) + 1))
    assert _held(tb) == set(steps) - lost


def test_calls_within_one_second_keep_every_event_file(tmp_path):
    """Each session (a Trainer's) writes a file of its own: two in the same second do not
    share (truncate) one; the second gets only the steps the first did not have."""
    with runs.RunWriter(tmp_path / "run", config={}) as writer:
        for steps in ((1, 2), (3, 4)):
            sink = _trackers.open_trackers(["tensorboard"], writer, 0)
            for step in steps:
                writer.log({"step": step, "loss": step / 8})
                sink.update({"step": step, "loss": step / 8})
            sink.finish("finished")
            sink.close()
    assert len(list((tmp_path / "run" / "tensorboard").glob("events.*"))) == 2
    assert _tb_numbers(tmp_path / "run" / "tensorboard")["train/loss"] == {
        1: 0.125, 2: 0.25, 3: 0.375, 4: 0.5}


def test_mlflow_batches_hold_whole_steps(env, tmp_path):  # noqa: F811
    """Each ``log_batch`` (one transaction) holds whole steps within MLflow's 1000 metrics:
    a run killed between two batches leaves no step half sent, which the resume (going on
    after the last step the store holds) would never complete."""
    sender = _tracker_clients.MlflowSender()
    sender.start({}, _tracker_clients.RunInfo(tmp_path, {}, {}))
    batches, log_batch = [], sender.client.log_batch

    def spy(run_id, metrics):   # the store's own call, watched
        batches.append([(m.step, m.key) for m in metrics])
        return log_batch(run_id, metrics=metrics)

    sender.client.log_batch = spy
    keys = [k for k in _tracker_clients.KEYS if not k.startswith("eval_")]
    recs = [{"step": s, "time": 1.0e9 + s, **{k: s / 7 for k in keys}} for s in range(1, 251)]
    sender.log(recs)
    sender.close("finished")
    assert len(batches) == 3 and all(len(b) <= 1000 for b in batches)
    for batch in batches:
        steps = {s for s, _ in batch}
        assert len(batch) == len(keys) * len(steps)               # no step split
    _, numbers = _mlflow_numbers(env, sender.run_id)
    assert sorted(numbers["train/loss"]) == list(range(1, 251))
    _assert_same_numbers(numbers, recs)
