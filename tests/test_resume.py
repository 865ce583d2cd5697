"""Deterministic resume across real process deaths: SIGKILL and SIGTERM of a training process.

Reference: one uninterrupted run of N steps. Test: a child process trains the same config,
is killed for real, and a new Trainer on the same run directory continues to N. The losses
must be bitwise equal to the reference (CPU, same binary). The killed writer's run-directory
lock is taken over with a note; a stopped one releases it.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import workbench as wb
import workbench.train._checkpoint  # noqa: F401 - wb.train._checkpoint below
from workbench import _runs as runs

pytestmark = pytest.mark.multiprocess   # each test kills a training child process

N = 40
CFG = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                     rules="fsdp", batch=8, seq=32, steps=N, checkpoint_every=3,
                     data=wb.data.TextData(max_bytes=100_000),
                     optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=3))

CHILD = """
import json, sys
import workbench as wb
cfg = wb.TrainConfig.from_json(sys.argv[1])
trainer = wb.Trainer(cfg, run_dir=sys.argv[2], progress=None)
print("READY", flush=True)
result = trainer.run()
print(json.dumps({"status": result.status, "step": result.step}), flush=True)
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tr = wb.Trainer(CFG, run_dir=tmp_path_factory.mktemp("ref") / "run", progress=None)
    tr.run()
    assert len(tr.losses) == N
    return tr.losses


def _start(run_dir):
    env = dict(os.environ)
    return subprocess.Popen([sys.executable, "-c", CHILD, CFG.to_json(), str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_until(proc, found, what, timeout):
    """Polls ``found()`` until it returns a value (the child keeps training meanwhile)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            pytest.fail(f"child exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        value = found()
        if value is not None:
            return value
        time.sleep(0.005)
    pytest.fail(f"no {what} within {timeout} s")


def _wait_for_step(proc, run_dir, step, timeout=300):
    """Waits until metrics.jsonl has ``step``; returns the newest step written."""
    def newest():
        if (run_dir / runs.METRICS).exists():
            seen = [r["step"] for r in runs.read_metrics(run_dir)]
            if seen and seen[-1] >= step:
                return seen[-1]
        return None

    return _wait_until(proc, newest, f"step {step}", timeout)


def _wait_for_checkpoint(proc, run_dir, timeout=120):
    """Waits until a committed checkpoint exists (Orbax renames a step's temporary
    directory to the bare step number when it commits)."""
    ckpts = run_dir / "checkpoints"
    _wait_until(proc, lambda: ckpts.exists() and any(p.name.isdigit() for p in ckpts.iterdir())
                or None, "committed checkpoint", timeout)


def _raw_steps(run_dir):
    """Every step line as written, duplicates included, and the resume markers."""
    lines = [json.loads(x) for x in (run_dir / runs.METRICS).read_text().splitlines() if x]
    return lines


def test_sigkill_then_resume_gives_bitwise_the_same_losses(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_checkpoint(proc, run_dir)                        # saves commit in the background
    seen = _wait_for_step(proc, run_dir, 7)
    proc.send_signal(signal.SIGKILL)                           # no handler, no final save
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed = [r["step"] for r in runs.read_metrics(run_dir)]
    assert seen <= killed[-1] < N                              # killed mid-run, for real
    assert runs.effective_status(runs.read_run(run_dir)) == "interrupted"
    assert json.loads((run_dir / "job.lock").read_text())["pid"] == proc.pid   # left behind
    with pytest.warns(UserWarning, match=rf"taking over the stale lock .*pid {proc.pid}"):
        trainer = wb.Trainer(CFG, run_dir=run_dir, progress=None)  # a new process's view
    k = trainer.step
    assert k % 3 == 0 and 3 <= k <= killed[-1]   # newest committed (a save may be in flight)
    trainer.run()
    assert trainer.losses == reference                         # bitwise, all N steps
    lines = _raw_steps(run_dir)
    marker = max(i for i, x in enumerate(lines) if x.get("event") == "resume")
    assert lines[marker]["step"] == k
    redone = [x for x in lines[marker:] if "event" not in x]
    assert [x["step"] for x in redone] == list(range(k + 1, N + 1))
    assert [x["loss"] for x in redone] == reference[k:]        # recomputed after the kill
    before = [x for x in lines[:marker] if "event" not in x]
    assert [x["loss"] for x in before] == reference[:len(before)]   # written by the child
    assert runs.read_run(run_dir)["status"] == "finished"


def test_sigterm_saves_then_stops_and_resumes_exactly(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_step(proc, run_dir, 4)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    k = result["step"]
    assert result["status"] == "interrupted" and 4 <= k < N
    assert "SIGTERM received: stopping after this step" in err
    assert "SIGTERM: stopped at step" in err and f"checkpoint step {k} saved" in err
    ck = wb.train._checkpoint.Checkpoints(run_dir / "checkpoints")
    assert ck.latest_step() == k                               # saved at the stop step
    assert [r["step"] for r in runs.read_metrics(run_dir)][-1] == k
    assert runs.read_run(run_dir)["status"] == "interrupted"
    assert not (run_dir / "job.lock").exists()                 # released on the way out
    trainer = wb.Trainer(CFG, run_dir=run_dir, progress=None)
    assert trainer.step == k
    trainer.run()
    assert trainer.losses == reference
