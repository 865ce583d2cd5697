"""One writer per run directory (API Trainer, CLI, launched job) and run directories that
cannot be used: a second writer is refused with who holds it and how to proceed, a stale
lock is taken over with a note, the lock goes with the writer however it ends, and a
damaged run.json or a read-only directory is a clear error naming the path and the fix."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import workbench as wb
from workbench import _runs as runs
from workbench.jobs import EXIT_STOPPED, JobRunningError, RunLock
from workbench._run_lock import LAUNCHED_ENV, RunDirNotWritable
from workbench.train._sinks import Sink

pytestmark = pytest.mark.usefixtures("wb_cache")

CFG = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                     rules="fsdp", batch=8, seq=32, steps=6, checkpoint_every=3,
                     data="synthetic")
LOCK = "job.lock"


def _trainer(run_dir, **kw):
    return wb.Trainer(CFG, run_dir=run_dir, progress=None, **kw)


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


class _Gate(Sink):
    """A sink that holds the run at ``step`` until released (the lock is held meanwhile)."""

    def __init__(self, step):
        self.step, self.reached, self.go = step, threading.Event(), threading.Event()

    def event(self, kind, **fields):
        pass

    def update(self, record):
        if record["step"] == self.step:
            self.reached.set()
            assert self.go.wait(120)

    def finish(self, status, message):
        pass


class _Interrupt(_Gate):
    def update(self, record):
        if record["step"] == self.step:
            raise KeyboardInterrupt


# ----------------------------------------------------------------------------- two writers
@pytest.mark.multiprocess
def test_a_cli_run_refuses_an_api_trainer_with_who_holds_it(tmp_path):
    """A running `python -m workbench train` holds the run directory: a notebook Trainer on
    it is refused (pid, host, since when, how to proceed); after SIGTERM it continues."""
    run_dir = tmp_path / "run"
    cfg = CFG.replace(steps=100_000, checkpoint_every=50)
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    env = dict(os.environ)   # 8 simulated devices (conftest's XLA_FLAGS)
    cli = subprocess.Popen([sys.executable, "-m", "workbench", "train", str(tmp_path / "cfg.json"),
                            "--run-dir", str(run_dir), "--platform", "cpu"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        t_end = time.monotonic() + 240
        while not ((run_dir / runs.METRICS).exists() and runs.read_metrics(run_dir)):
            assert cli.poll() is None and time.monotonic() < t_end, cli.stdout.read()[-3000:]
            time.sleep(0.05)
        holder = json.loads((run_dir / LOCK).read_text())
        assert holder["pid"] == cli.pid and holder["what"] == "trainer"
        with pytest.raises(JobRunningError) as err:
            wb.Trainer(cfg, run_dir=run_dir, progress=None)
        msg = str(err.value)
        assert f"pid {cli.pid}" in msg and socket.gethostname() in msg
        assert re.search(r"since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", msg)
        assert f"kill -TERM {cli.pid}" in msg and "continues from that checkpoint" in msg
        assert "StepAlreadyExists" not in msg and "disk space" not in msg
        cli.send_signal(signal.SIGTERM)                 # stops at a step, with a checkpoint
        assert cli.wait(120) == EXIT_STOPPED
    finally:
        if cli.poll() is None:
            cli.kill()
    assert not (run_dir / LOCK).exists()                 # released on the way out
    stopped = runs.read_metrics(run_dir)[-1]["step"]
    trainer = wb.Trainer(cfg, run_dir=run_dir, progress=None)   # free again: continues
    assert trainer.step == stopped
    trainer.run(steps=stopped + 2)
    assert [r["step"] for r in runs.read_metrics(run_dir)] == list(range(1, stopped + 3))


def test_a_second_trainer_is_refused_while_one_trains_in_another_thread(tmp_path):
    run_dir = tmp_path / "run"
    first = _trainer(run_dir)
    gate = _Gate(step=2)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=first.run(steps=4, sinks=[gate])))
    thread.start()
    try:
        assert gate.reached.wait(240)
        with pytest.raises(JobRunningError, match=r"a Trainer in this process \(another thread\)"):
            _trainer(run_dir)
    finally:
        gate.go.set()
        thread.join(120)
    assert result["r"].status == "finished" and first.step == 4
    second = _trainer(run_dir)                          # the first is done: free
    assert second.step == 4


def test_trainers_take_turns_and_each_continues_from_the_newest_checkpoint(tmp_path):
    """Two Trainers on one directory in one kernel, run one after the other: neither trips
    over the other's checkpoints (no StepAlreadyExistsError); a stale one catches up."""
    reference = _trainer(tmp_path / "ref")
    reference.run(steps=9)
    run_dir = tmp_path / "run"
    a = _trainer(run_dir)
    a.run(steps=3)
    b = _trainer(run_dir)
    b.run(steps=6)
    a.run(steps=9)                                       # a was at 3; the directory at 6
    assert a.step == 9 and a.losses == reference.losses  # bitwise: continued from 6
    assert [r["step"] for r in runs.read_metrics(run_dir)] == list(range(1, 10))
    assert not (run_dir / LOCK).exists()


def test_the_lock_goes_with_an_interrupted_or_failed_run(tmp_path):
    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir)
    with pytest.raises(KeyboardInterrupt):
        trainer.run(sinks=[_Interrupt(step=2)])
    assert not (run_dir / LOCK).exists()

    class Broken(_Gate):
        def update(self, record):
            raise RuntimeError("a sink failed")

    with pytest.raises(RuntimeError, match="a sink failed"):
        trainer.run(sinks=[Broken(step=1)])
    assert not (run_dir / LOCK).exists()
    trainer.run()                                        # and the run goes on
    assert trainer.step == CFG.steps


def test_a_stale_lock_of_a_dead_writer_is_taken_over_with_a_note(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = _dead_pid()
    (run_dir / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": dead,
                                            "pids": [dead], "created": 0, "what": "trainer"}))
    with pytest.warns(UserWarning, match=rf"taking over the stale lock .*pid {dead}"):
        trainer = _trainer(run_dir)
    trainer.run()
    assert trainer.step == CFG.steps and not (run_dir / LOCK).exists()


def test_a_launched_worker_writes_under_its_launchers_lock(tmp_path, monkeypatch):
    """Process 0 of a wb.launch job finds the launcher's token in its environment and
    trains under the launcher's lock; any other process is refused."""
    lock = RunLock(tmp_path / "run")
    lock.acquire(what="train")
    try:
        with pytest.raises(JobRunningError, match="already has a running job"):
            _trainer(tmp_path / "run")
        monkeypatch.setenv(LAUNCHED_ENV, "not-this-job")
        with pytest.raises(JobRunningError, match="already has a running job"):
            _trainer(tmp_path / "run")
        monkeypatch.setenv(LAUNCHED_ENV, lock.token)
        trainer = _trainer(tmp_path / "run")
        trainer.run(steps=1)
        assert lock.read()["token"] == lock.token       # the launcher's lock, untouched
    finally:
        lock.release()
    assert not (tmp_path / "run" / LOCK).exists()


# ----------------------------------------------------------------------------- bad run dirs
def _deep(n):
    return "[" * n + "]" * n


BAD_RUN_JSON = {
    "binary": (lambda p: p.write_bytes(bytes(range(256)) * 4), r"not UTF-8 text|not valid JSON"),
    "empty": (lambda p: p.write_text(""), r"is empty"),
    "list": (lambda p: p.write_text("[1, 2]"), r"holds a JSON list"),
    "directory": (lambda p: p.mkdir(), r"is a directory"),
    "deeply_nested": (lambda p: p.write_text('{"config": ' + _deep(100_000) + "}"),
                      r"nested"),
    "step_text": (lambda p: p.write_text('{"step": "abc", "config": {}}'),
                  r"step='abc', not a whole number"),
    "step_negative": (lambda p: p.write_text('{"step": -3, "config": {}}'),
                      r"step=-3, not a whole number"),
}


@pytest.mark.parametrize("case", list(BAD_RUN_JSON))
def test_a_damaged_run_json_is_a_clear_error_naming_the_path_and_the_fix(tmp_path, case):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write, pattern = BAD_RUN_JSON[case]
    write(run_dir / runs.RUN_JSON)
    with pytest.raises(runs.RunFileError, match=pattern) as err:
        _trainer(run_dir)
    assert str(run_dir / runs.RUN_JSON) in str(err.value)
    assert "move it aside" in str(err.value).lower()
    assert sorted(os.listdir(run_dir)) == [runs.RUN_JSON]        # nothing else written


def test_a_nan_step_in_run_json_is_read_as_none_and_rewritten(tmp_path):
    run_dir = tmp_path / "run"
    _trainer(run_dir).run(steps=3)
    meta = json.loads((run_dir / runs.RUN_JSON).read_text())
    (run_dir / runs.RUN_JSON).write_text(json.dumps({**meta, "step": float("nan")}))
    trainer = _trainer(run_dir)
    trainer.run()
    assert json.loads((run_dir / runs.RUN_JSON).read_text())["step"] == CFG.steps


def _read_only(path):
    """Makes ``path`` read-only for this process: a read-only bind mount as root (root
    ignores file modes), else the directory's write bits; returns the undo."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return lambda: os.chmod(path, 0o755)
    ok = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode
    if ok != 0:
        pytest.skip("cannot bind-mount here to make a read-only directory")
    subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
    return lambda: subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("existing", [False, True], ids=["new-run", "resumed-run"])
def test_a_read_only_run_directory_is_a_clear_error(tmp_path, existing):
    run_dir = tmp_path / "run"
    if existing:
        _trainer(run_dir).run(steps=3)
    else:
        run_dir.mkdir()
    before = sorted(p.name for p in run_dir.iterdir())
    undo = _read_only(run_dir)
    try:
        with pytest.raises(RunDirNotWritable, match=r"cannot be written .*make it writable"):
            _trainer(run_dir)
    finally:
        undo()
    assert sorted(p.name for p in run_dir.iterdir()) == before
    if existing:
        shutil.rmtree(run_dir)


def test_train_takes_the_lock_from_the_runs_layer_not_from_jobs():
    """train/ and jobs/ do not import each other both ways: the lock is in run_lock.py
    (beside runs.py), so no module of train/ imports jobs/, not even lazily."""
    import ast
    import pathlib

    import workbench.train

    folder = pathlib.Path(workbench.train.__file__).parent
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [(path.name, n) for n in names if n.startswith("workbench.jobs")]
    assert not found, found
    from workbench._run_lock import RunLock
    from workbench.train import _trainer as trainer

    assert trainer.RunLock is RunLock
