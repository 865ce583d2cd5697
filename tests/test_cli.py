"""The ``python -m workbench`` command: train / launch / ping / runs, run as real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import _runs as runs
from workbench.jobs._local import free_port

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, timeout: float = 300, env: dict | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True,
                          text=True, timeout=timeout, env={**base, **(env or {})},
                          cwd=cwd or ROOT, check=False)


def _ping(text: str) -> dict:
    line = next(x for x in text.splitlines() if "PING " in x)
    return json.loads(line.split("PING ", 1)[1])


def test_help_names_every_command():
    out = _cli("--help")
    assert out.returncode == 0
    for cmd in ("train", "launch", "export", "ping", "runs"):
        assert cmd in out.stdout
    train_help = _cli("train", "--help").stdout
    for flag in ("--run-dir", "--coordinator", "--num-processes", "--process-id",
                 "--distributed", "--devices-per-process"):
        assert flag in train_help


def test_runs_lists_run_directories_without_importing_jax(tmp_path):
    with runs.RunWriter(tmp_path / "runs" / "a", config={"model": "tiny"}) as w:
        w.update(target_steps=10)
        for step in (1, 2, 3):
            w.log({"step": step, "loss": 1.0 / step})
    code = ("import sys; from workbench.__main__ import main; "
            f"rc = main(['runs', {str(tmp_path / 'runs')!r}]); "
            "assert 'jax' not in sys.modules, 'runs imported jax'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=False)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("a "))
    assert row.split()[1:3] == ["finished", "3/10"]


def test_runs_lists_a_run_whose_times_and_steps_are_not_numbers(tmp_path, capsys):
    from workbench.__main__ import main

    for name, meta in {"huge": {"updated": 1e300, "step": 10**30},
                       "words": {"updated": "yesterday", "step": "abc"}}.items():
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"status": "finished", **meta}))
        (d / "metrics.jsonl").write_text("")
    assert main(["runs", str(tmp_path / "runs")]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"huge", "words"}
    assert "?" in rows["huge"].split()


@pytest.mark.multiprocess
def test_ping_in_one_process():
    out = _cli("ping", "--distributed", "off", "--platform", "cpu", "--devices-per-process", "3")
    assert out.returncode == 0, out.stderr + out.stdout
    r = _ping(out.stdout)
    assert (r["processes"], r["devices"], r["sum"], r["expected"]) == (1, 3, 0.0, 0.0)


@pytest.mark.multiprocess
def test_two_workers_started_by_hand_join_like_on_a_cluster():
    """What srun / a pod ssh does: the same command on every worker, each with its id."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "workbench", "ping", "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i), "--platform", "cpu",
         "--devices-per-process", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))) for i in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        r = _ping(out)  # process 1's two devices each add 1: hand count 2
        assert (r["processes"], r["devices"], r["sum"], r["expected"]) == (2, 4, 2.0, 2.0)


def test_partial_distributed_flags_are_refused_with_the_fix(tmp_path):
    out = _cli("ping", "--coordinator", "127.0.0.1:1", "--num-processes", "2")
    assert out.returncode != 0
    assert "also pass ['process_id']" in out.stderr


def test_train_without_config_says_what_to_pass():
    out = _cli("train")
    assert out.returncode != 0 and "give CONFIG.json or CONFIG.py" in out.stderr


def test_load_config_from_python_and_json(tmp_path):
    from workbench.jobs._worker import load_config
    from workbench.train import TrainConfig

    want = TrainConfig(model="tiny", batch=8, seq=32, steps=7, data="synthetic")
    (tmp_path / "cfg.py").write_text(
        "import workbench as wb\n"
        "config = wb.TrainConfig(model='tiny', batch=8, seq=32, steps=7, data='synthetic')\n")
    (tmp_path / "fn.py").write_text(f"def config():\n    return {want.to_dict()!r}\n")
    (tmp_path / "cfg.json").write_text(want.to_json())
    for name in ("cfg.py", "fn.py", "cfg.json"):
        assert load_config(tmp_path / name) == want, name
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"none\.py defines no `config`"):
        load_config(tmp_path / "none.py")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.json")


TINY = ("import workbench as wb\n"
        "config = wb.TrainConfig(model='tiny', mesh={'data': 8}, rules='dp', batch=8, seq=32,\n"
        "                        steps=6, checkpoint_every=3, data='synthetic')\n")


def test_train_refused_by_the_trainer_is_a_usage_error_without_traceback(tmp_path):
    # passes load_config, but the Trainer refuses it: 12 rows do not split over 8 devices
    (tmp_path / "bad.py").write_text(TINY.replace("batch=8", "batch=12"))
    run_dir = tmp_path / "new" / "run"
    out = _cli("train", str(tmp_path / "bad.py"), "--run-dir", str(run_dir))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"workbench train: error: the Trainer refused config "
                                 f"{tmp_path / 'bad.py'} for run directory {run_dir}: ")
    assert "batch=12 is not divisible by the 8 devices" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()  # no run directory (nor lock) left behind


@pytest.mark.multiprocess
@pytest.mark.slow
def test_train_runs_a_config_py_and_a_second_call_continues(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    run_dir = tmp_path / "run"
    first = _cli("train", str(tmp_path / "tiny.py"), "--run-dir", str(run_dir), "--steps", "3")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "process 0 of 1 joined (single)" in first.stdout
    assert runs.read_run(run_dir)["status"] == "finished"
    assert [r["step"] for r in runs.read_metrics(run_dir)] == [1, 2, 3]
    second = _cli("train", "--config", str(tmp_path / "tiny.py"), "--run-dir", str(run_dir))
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert [e["step"] for e in runs.read_events(run_dir) if e["event"] == "resume"] == [3]
    assert [r["step"] for r in runs.read_metrics(run_dir)] == list(range(1, 7))
    assert not (run_dir / "job.lock").exists()  # the worker's own lock is released


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_command_follows_the_job_to_the_end(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    out = _cli("launch", str(tmp_path / "tiny.py"), "--processes", "1",
               "--devices-per-process", "8", "--run-dir", str(tmp_path / "run"), "--steps", "2")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "launched 1 processes" in out.stdout and "finished" in out.stdout
    assert [r["step"] for r in runs.read_metrics(tmp_path / "run")] == [1, 2]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["steps"] == 6
