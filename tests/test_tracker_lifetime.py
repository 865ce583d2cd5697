"""The trackers live for the Trainer (issue 61 item 2: nothing in the train step waits on a
tracker): their runs start once and stay open across ``run()`` calls, which never wait for
a send; ``Trainer.close()``, the interpreter's exit and a newer Trainer of the same run
directory send the last steps and finish the runs, losing none. The slow tracker is the
real TensorBoard client slowed through the code's own seam (``SENDERS``); everything is
read back with each library's own reader and compared with ``metrics.jsonl``.
"""
import os
import subprocess
import sys
import time

import pytest

import workbench as wb
from tests.test_tracker_flush import _held, _tb_numbers
from tests.test_trackers import (
    _assert_same_numbers,
    _first_per_step,
    _mlflow_numbers,
    _tiny,
    _wandb_files,
    _wandb_numbers,
    env,  # noqa: F401 - the fixture
    mlflow_db,  # noqa: F401 - the fixture
)
from workbench import _runs as runs
from workbench.train import _tracker_clients

pytestmark = pytest.mark.usefixtures("wb_cache")
#: Seconds each send of the slowed TensorBoard client takes.
DELAY = 8.0
ALL = ["tensorboard", "wandb", "mlflow"]


class SlowTensorBoard(_tracker_clients.TensorBoardSender):
    """TensorBoard's own client, each send :data:`DELAY` seconds late."""

    def log(self, records):
        time.sleep(DELAY)
        super().log(records)


@pytest.mark.slow
def test_run_returns_without_waiting_for_a_slow_tracker(monkeypatch, tmp_path):
    monkeypatch.setitem(_tracker_clients.SENDERS, "tensorboard", SlowTensorBoard)
    trainer = wb.Trainer(_tiny(trackers=["tensorboard"]).replace(steps=6, checkpoint_every=100),
                         tmp_path / "run", progress=None)
    trainer.run(steps=2)   # compiles; its end starts a send that takes DELAY
    t0 = time.monotonic()
    trainer.run(steps=4)
    took = time.monotonic() - t0
    assert took < DELAY / 2, took                  # the call did not wait for the send
    t0 = time.monotonic()
    trainer.close()
    assert time.monotonic() - t0 > 1.0             # close waited for the sends in flight
    recs = runs.read_metrics(tmp_path / "run")
    assert sorted(_held(tmp_path / "run" / "tensorboard")) == [1, 2, 3, 4]
    numbers = _tb_numbers(tmp_path / "run" / "tensorboard")
    assert {s: numbers["train/loss"][s] for s in range(1, 5)} == pytest.approx(
        {r["step"]: r["loss"] for r in recs}, rel=1e-6)


def _assert_all_sent(run_dir, uri, steps, sessions=1):
    """Every tracker holds ``steps`` as ``metrics.jsonl`` has them, in one W&B run (a file
    per session, each the same run id) and one finished MLflow run."""
    from mlflow import MlflowClient

    recs = runs.read_metrics(run_dir)
    assert [r["step"] for r in recs] == steps
    ids = runs.read_run(run_dir)["trackers"]
    [mlrun] = MlflowClient(tracking_uri=uri).search_runs(["0"])     # one MLflow run
    assert mlrun.info.run_id == ids["mlflow"]["run_id"]
    mlrun, numbers = _mlflow_numbers(uri, ids["mlflow"]["run_id"])
    assert mlrun.info.status == "FINISHED" and sorted(numbers["train/loss"]) == steps
    _assert_same_numbers(numbers, recs)
    files = _wandb_files(run_dir, ids["wandb"]["id"])
    assert len(files) == len(list((run_dir / "wandb").glob("offline-run-*"))) == sessions
    merged = _first_per_step(files)
    assert sorted(merged) == steps
    _assert_same_numbers(_wandb_numbers(merged), recs)
    assert sorted(_held(run_dir / "tensorboard")) == steps


@pytest.mark.slow
def test_the_tracker_runs_stay_open_across_calls_and_close_finishes_them(env, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    trainer = wb.Trainer(_tiny(trackers=ALL).replace(steps=6), run_dir, progress=None)
    trainer.run(steps=3)
    trainer.run(steps=6)
    trainer.close()
    _assert_all_sent(run_dir, env, [1, 2, 3, 4, 5, 6])
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == 1   # one session


@pytest.mark.slow
def test_a_newer_trainer_of_the_run_directory_takes_the_runs_over(env, tmp_path):  # noqa: F811
    """A notebook cell run again: the first Trainer is neither closed nor collected."""
    run_dir, cfg = tmp_path / "run", _tiny(trackers=ALL).replace(steps=6)
    first = wb.Trainer(cfg, run_dir, progress=None)
    first.run(steps=3)
    second = wb.Trainer(cfg, run_dir, progress=None)
    second.run(steps=6)
    second.close()
    # the same W&B and MLflow runs, continued after the first Trainer's finished
    _assert_all_sent(run_dir, env, [1, 2, 3, 4, 5, 6], sessions=2)
    assert first.step == 3



@pytest.mark.slow
def test_the_first_trainer_continues_the_runs_after_a_newer_one_trained(env, tmp_path):  # noqa: F811
    """The earlier cell's Trainer used again after a newer one trained the run directory: it
    continues from the newest checkpoint and its trackers continue the same runs."""
    run_dir, cfg = tmp_path / "run", _tiny(trackers=ALL).replace(steps=9, checkpoint_every=1)
    first = wb.Trainer(cfg, run_dir, progress=None)
    first.run(steps=3)
    second = wb.Trainer(cfg, run_dir, progress=None)
    second.run(steps=6)
    second.close()
    first.run(steps=9)   # noticed: continues from step 6 with new tracker sessions
    first.close()
    assert first.step == 9
    _assert_all_sent(run_dir, env, list(range(1, 10)), sessions=3)

CHILD = """
import sys, time
import workbench as wb
from workbench.train import _tracker_clients, _trackers

class SlowTensorBoard(_tracker_clients.TensorBoardSender):
    def log(self, records):
        time.sleep(3.0)
        super().log(records)

_tracker_clients.SENDERS["tensorboard"] = SlowTensorBoard
_trackers.FLUSH_SECONDS = 1e6   # nothing sent by the clock: what exit sends is all of it
trainer = wb.Trainer(wb.TrainConfig.from_json(sys.argv[1]), run_dir=sys.argv[2], progress=None)
trainer.run()
print("returned", flush=True)   # no close(): the interpreter's exit finishes the runs
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_interpreters_exit_sends_every_step_and_finishes_the_runs(env, tmp_path):  # noqa: F811
    run_dir, cfg = tmp_path / "run", _tiny(trackers=ALL).replace(steps=4, checkpoint_every=100)
    child_env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    done = subprocess.run([sys.executable, "-c", CHILD, cfg.to_json(), str(run_dir)],
                          capture_output=True, text=True, env=child_env, timeout=600)
    assert done.returncode == 0 and "returned" in done.stdout, done.stderr[-3000:]
    assert "still sending" not in done.stderr
    _assert_all_sent(run_dir, env, [1, 2, 3, 4])
