"""Launching on clusters from a cell, against real ones: a SLURM controller + node + munge, and
an OpenSSH server, both on loopback (tests/_clusters.py starts them).

Training jobs compare against the same config trained as one process with 4 devices (the
CLI, gloo collectives: bitwise equal to 2 x 2, as in test_text_train.py), and a requeued
job against that uninterrupted curve. Two devices per task, not four: gloo runs every
collective over loopback TCP between all devices of the job, and 2 x 4 spent ~60% more CPU
than 2 x 2 on the same 30 steps (2.8x the system time), while nothing here needs a device
count. Nothing is mocked: sbatch, srun, scontrol, squeue, scancel, ssh.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workbench as wb
from workbench.jobs import JobRunningError
from workbench.jobs._hosts import HostsError, _remote_pid
from workbench.jobs._local import free_port
from workbench.jobs._slurm import SlurmError, parse_time
from workbench.jobs._storage import warn_if_not_shared

from _clusters import LocalSshd, running_slurm

CFG = {"model": "tiny", "mesh": {"data": 4}, "rules": "fsdp", "batch": 8, "seq": 32,
       "steps": 30, "checkpoint_every": 4, "keep": 3, "seed": 0, "data": "text"}
TWO_TASKS = dict(nodes=1, tasks_per_node=2, cpus_per_task=1, devices_per_task=2,
                 platform="cpu")


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in wb.runs.read_metrics(run_dir)]


def _start_now(job) -> None:
    """Starts a requeued job now instead of at its BeginTime, as the cluster's admin can.

    SLURM holds a requeued job (BeginTime) because slurmd revokes the job's credentials at the
    requeue, stamped to the second: a credential made in that same second counts as revoked,
    and slurmctld then ends the job FAILED ("Killing non-startable batch JobId=N: Job credential
    revoked", in its log) instead of starting it. So the restart waits for the next second
    after the requeue was seen (the requeue happened before that).
    """
    seen = time.time()
    time.sleep(int(seen) + 1.05 - seen)
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True)


def _wait_for(pred, timeout: float, job=None) -> None:
    t_end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > t_end or (job is not None and job.done):
            detail = "" if job is None else f"; job {job.status}:\n{job.tail()}"
            raise AssertionError(f"condition not reached within {timeout} s{detail}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from running_slurm(tmp_path_factory.mktemp("slurm"))


@pytest.fixture(scope="module")
def one_by_four(tmp_path_factory):
    """The reference: CFG trained by one process with 4 devices (gloo), uninterrupted."""
    d = tmp_path_factory.mktemp("ref")
    (d / "config.json").write_text(wb.TrainConfig(**CFG).to_json())
    out = subprocess.run(
        [sys.executable, "-m", "workbench", "train", str(d / "config.json"), "--run-dir",
         str(d / "1x4"), "--platform", "cpu", "--devices-per-process", "4", "--coordinator",
         f"127.0.0.1:{free_port()}", "--num-processes", "1", "--process-id", "0"],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = _losses(d / "1x4")
    assert len(losses) == CFG["steps"]
    return losses


# ----------------------------------------------------------------------------- SLURM
@pytest.mark.slow
def test_slurm_job_past_its_time_limit_shows_timeout_and_the_fix(slurm, tmp_path, request):
    # the setup line holds the batch script before its tasks start (as a slow `module load`
    # would), so the job holds its CPUs without spending them; no requeue: the limit ends it
    job = wb.launch(wb.TrainConfig(**CFG), run_dir=tmp_path / "run", cluster=wb.Slurm(
        **TWO_TASKS, time="10", requeue=False, setup=["sleep 300"]))
    _wait_for(lambda: job.scheduler["state"] == "RUNNING", 60, job)
    # as the admin, bring its end to now: slurmctld checks time limits every 30 s
    # (PERIODIC_TIMEOUT), so it times out within 30 s instead of 10 minutes. Meanwhile this
    # machine trains the reference the later tests compare against (not through SLURM).
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "EndTime=now+1"], check=True)
    request.getfixturevalue("one_by_four")
    assert job.wait(120) == "failed", job.tail()
    assert job.scheduler["state"] == "TIMEOUT" and job.scheduler["reason"] == "TimeLimit"
    # RUNNING, then TIMEOUT; SLURM may show COMPLETING (reason TimeLimit) between them
    # while it kills the tasks (seen on a loaded clean-clone run: the poll fell in it)
    seen = [h["state"] for h in job.history]
    assert [s for s in seen if s != "COMPLETING"][-2:] == ["RUNNING", "TIMEOUT"], job.history
    assert set(seen[seen.index("RUNNING"):]) <= {"RUNNING", "COMPLETING", "TIMEOUT"}, seen
    msg = job.failure["message"]
    assert msg.startswith(f"SLURM job {job.job_id} TIMEOUT: no task recorded an exit "), msg
    assert "reason TimeLimit" in msg and "hit its time limit (00:01:00)" in msg, msg
    assert "raise wb.Slurm(time=), or pass requeue=True" in msg, msg
    assert f"SLURM job {job.job_id}: TIMEOUT" in repr(job) and "failed" in repr(job)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slurm_job_preempted_at_start_then_signalled_requeues_twice_and_trains_bitwise(
        slurm, one_by_four, tmp_path):
    """One job through both requeues: preempted by the higher-priority partition right after
    it starts, then SIGTERMed (the time-limit signal) once it logged 5 steps; it still trains
    like one process, bitwise, and shows every state (one training, not two)."""
    from workbench.widgets._job_view import job_payload

    run_dir = tmp_path / "run"
    job = wb.launch(wb.TrainConfig(**CFG), run_dir=run_dir,
                    cluster=wb.Slurm(**TWO_TASKS, extra=["--begin=now+2"]))
    assert isinstance(job, wb.Job) and job.job_id.isdigit()
    _wait_for(lambda: job.scheduler["state"] == "RUNNING", 60, job)
    # the batch script has begun start 1 (its header in the task log) before it is preempted
    log0 = run_dir / "logs" / "process-0.log"
    _wait_for(lambda: log0.exists() and "start 1, on" in log0.read_text(), 60, job)
    # a job in the higher-priority partition preempts it (PreemptMode=REQUEUE): back to
    # the queue, and it starts again once the CPUs are free
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-n", "2",
                             f"--output={tmp_path}/urgent.out", "--wrap", "sleep 2"],
                            capture_output=True, text=True, check=True).stdout.strip()
    _wait_for(lambda: job.scheduler["restarts"] == 1 and job.status == "queued"
              and job.scheduler["reason"] == "BeginTime", 120, job)
    preempted_at = len(_losses(run_dir))  # 0: preempted while its tasks still started
    _start_now(job)
    _wait_for(lambda: len(_losses(run_dir)) >= 5, 400, job)
    # What SLURM sends `signal_before` seconds before the time limit (--signal=TERM@120):
    # SIGTERM to every task. They checkpoint at one step and exit 75; the script requeues.
    out = subprocess.run(["scancel", "--signal=TERM", job.job_id], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr
    _wait_for(lambda: job.scheduler["restarts"] == 2 and job.scheduler["state"] == "PENDING"
              and job.scheduler["reason"] == "BeginTime", 120, job)
    assert job.status == "queued" and job.scheduler["reason"] == "BeginTime"
    # SLURM holds a requeued job for ~2 minutes (its BeginTime); as the admin, start it now
    _start_now(job)
    assert job.wait(600) == "finished", job.tail()
    assert _losses(run_dir) == one_by_four  # 2 SLURM tasks x 2 = 1 x 4, one curve, bitwise
    # (COMPLETING, SLURM's brief state while a job's processes end, shows or not by timing)
    states = [h["state"] for h in job.history if h["state"] != "COMPLETING"]
    states = [x for i, x in enumerate(states) if i == 0 or x != states[i - 1]]
    assert states == ["PENDING", "RUNNING", "REQUEUED", "PENDING", "RUNNING", "REQUEUED",
                      "PENDING", "RUNNING", "COMPLETED"], job.history
    assert job.history[0]["reason"] == "BeginTime" and job.history[1]["nodes"] == slurm.host
    assert job.scheduler["restarts"] == 2 and urgent.isdigit()
    assert [p.state for p in job.processes] == ["finished", "finished"]
    assert [p.returncode for p in job.processes] == [0, 0]
    # one resume, the signal's, at its checkpoint (>= 5): the preemption came before any
    # step (a preemption after some would have checkpointed there and resumed once more)
    events = wb.runs.read_events(run_dir)
    resumes = [e["step"] for e in events if e["event"] == "resume"]
    first = [preempted_at] if preempted_at else []
    assert len(resumes) == len(first) + 1 and resumes[:-1] == first, events
    assert resumes[-1] >= 5, events
    # both tasks joined through jax.distributed's SLURM detection
    for i in range(2):
        assert re.search(rf"process {i} of 2 joined \(SlurmCluster\): 2 local / 4 global",
                         (run_dir / "logs" / f"process-{i}.log").read_text())
    log = log0.read_text()
    assert "start 1, on" in log and "start 2, on" in log and "start 3, on" in log
    assert "requeueing job" in (run_dir / "logs" / f"slurm-{job.job_id}.out").read_text()
    assert (run_dir / "logs" / f"slurm-{job.job_id}.start").read_text() == "3\n"
    p = job_payload(job)
    assert p["scheduler"]["job_id"] == job.job_id and p["scheduler"]["state"] == "COMPLETED"
    assert [y for _, y in p["loss"]] == one_by_four
    assert "SLURM job" in repr(job) and "COMPLETED" in repr(job)
    # the repr's count and its states (COMPLETING included, as history holds them)
    assert "requeued 2x: " + " -> ".join(h["state"] for h in job.history) in repr(job)
    # a new kernel finds it again from the run directory
    again = wb.attach(run_dir)
    assert again.wait(60) == "finished" and again.job_id == job.job_id
    assert not (run_dir / "job.lock").exists()


@pytest.mark.multiprocess
def test_slurm_pending_job_is_cancelled_and_blocks_a_second_job(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job = wb.launch(wb.TrainConfig(**CFG), run_dir=run_dir,
                    cluster=wb.Slurm(**TWO_TASKS, extra=["--begin=now+600"]))
    _wait_for(lambda: job.scheduler["state"] == "PENDING", 30)
    assert job.status == "queued" and job.scheduler["reason"] == "BeginTime"
    assert "PENDING (BeginTime)" in repr(job)
    with pytest.raises(JobRunningError, match=rf"SLURM job {job.job_id}.*scancel"):
        wb.launch(wb.TrainConfig(**CFG), run_dir=run_dir, cluster=wb.Slurm(**TWO_TASKS))
    with pytest.raises(JobRunningError, match=rf"SLURM job {job.job_id}"):  # not locally either
        wb.launch(wb.TrainConfig(**CFG), processes=2, devices_per_process=2, run_dir=run_dir)
    # another kernel (a fresh interpreter) finds the queued job from the run directory
    code = ("import sys, time, workbench as wb; j = wb.attach(sys.argv[1]); t = time.time()\n"
            "while j.scheduler['state'] != 'PENDING' and time.time() - t < 30: time.sleep(0.2)\n"
            "print(repr(j))")
    root = str(Path(wb.__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True,
                         text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"SLURM job {job.job_id}: PENDING (BeginTime)" in out.stdout and "queued" in out.stdout
    assert job.stop(60) == "stopped"
    assert job.scheduler["state"] == "CANCELLED"
    assert [h["state"] for h in job.history][-1] == "CANCELLED"
    assert not (run_dir / "job.lock").exists()


@pytest.mark.multiprocess
def test_slurm_job_failing_at_start_shows_the_workers_error(slurm, tmp_path):
    from workbench.widgets._job_view import job_payload

    bad = wb.TrainConfig(**{**CFG, "batch": 6})  # 6 rows over data=4: the Trainer refuses
    job = wb.launch(bad, run_dir=tmp_path / "run", cluster=wb.Slurm(**TWO_TASKS))
    assert job.wait(300) == "failed", job.tail()
    assert job.scheduler["state"] == "FAILED"
    msg = job.failure["message"]
    assert f"SLURM job {job.job_id} FAILED" in msg and "batch" in msg and "6" in msg
    assert "task 0 exited with code 1" in msg and "batch=6 is not divisible by the 4" in msg
    assert job_payload(job)["failure"] == msg


def test_slurm_requeued_job_whose_restart_never_ran_shows_failed(tmp_path, monkeypatch):
    """A requeued job (2 tasks, each saved a checkpoint and exited 75) that slurmctld ended
    FAILED as it started it again, within the second of its requeue ("Killing non-startable
    batch JobId=5: Job credential revoked" in its log): it failed, it did not stop. The
    scheduler's answer is the one SLURM 22.05 gave for that job on the test cluster."""
    from workbench.jobs import _slurm_job as slurm_job

    shown = ("JobId=5 JobName=wb-run UserId=root(0) GroupId=root(0) MCS_label=N/A "
             "Priority=4294901755 Nice=0 Account=(null) QOS=(null) JobState=FAILED "
             "Reason=NonZeroExitCode Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 "
             "ExitCode=1:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A "
             "SubmitTime=2026-11-25T23:55:44 EligibleTime=2026-11-25T23:55:44 "
             "AccrueTime=2026-11-25T23:57:45 StartTime=2026-11-25T23:55:44 "
             "EndTime=2026-11-25T23:55:44 Deadline=N/A Partition=debug NodeList=vm BatchHost=vm "
             "NumNodes=1 NumCPUs=2 NumTasks=2 CPUs/Task=1 TRES=cpu=2,node=1,billing=2")
    monkeypatch.setattr(slurm_job, "run_command", lambda argv, **kw: subprocess.CompletedProcess(
        argv, 0, shown + "\n", ""))
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    for i in range(2):  # what start 1 left: the tasks' checkpointed stop
        (logs / f"process-{i}.log").write_text("===== launch: SLURM job 5, start 1, on vm\n"
                                               "[workbench] saved a checkpoint at step 9\n")
        (logs / f"process-{i}.exit").write_text("75\n")
    (logs / "slurm-5.start").write_text("1\n")
    (logs / "slurm-5.out").write_text(
        "[workbench] srun exited with 75 (start 1)\n[workbench] stopped with a checkpoint: "
        "requeueing job 5\nslurmstepd-vm: error: *** JOB 5 ON vm CANCELLED AT "
        "2026-11-25T23:55:44 DUE TO JOB REQUEUE ***\n")
    job = slurm_job.SlurmJob(tmp_path / "run", {"job_id": "5", "tasks": 2,
                                                "request": {"requeue": True}}, lock=None)
    assert job.wait(30) == "failed"  # was "stopped": start 1's exit codes taken for start 2's
    assert job.scheduler["state"] == "FAILED" and job.scheduler["restarts"] == 1
    assert [p.state for p in job.processes] == ["stopped", "stopped"]  # what start 1 did
    msg = job.failure["message"]
    assert "SLURM job 5 FAILED: its start 2 (after 1 requeue(s)) never ran its batch script" in msg
    assert "exit code 1:0, reason NonZeroExitCode" in msg and "credential revoked" in msg
    assert "requeueing job 5" in msg and "Launch again into" in msg


def test_bad_slurm_requests_are_refused_before_anything_is_written(slurm, tmp_path):
    cfg = wb.TrainConfig(**CFG)
    with pytest.raises(SlurmError, match=r"partition='gpu'.*no such partition.*debug.*urgent"):
        wb.launch(cfg, run_dir=tmp_path / "a", cluster=wb.Slurm(**{**TWO_TASKS,
                                                                    "partition": "gpu"}))
    with pytest.raises(SlurmError, match=r"nodes=3.*'debug' has only 1 node"):
        wb.launch(cfg, run_dir=tmp_path / "b", cluster=wb.Slurm(**{**TWO_TASKS, "nodes": 3}))
    with pytest.raises(ValueError, match=r"needs 4 devices.*processes=2 x "
                                         r"devices_per_process=1"):
        wb.launch(cfg, run_dir=tmp_path / "c",
                  cluster=wb.Slurm(**{**TWO_TASKS, "devices_per_task": 1}))
    assert not any((tmp_path / d).exists() for d in "abc")
    # a time limit shorter than one checkpoint interval measured in the run directory
    run = tmp_path / "d"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0,
                                                   "step_time": 30.0}) + "\n")
    with pytest.warns(UserWarning, match=r"time='1:00'.*shorter than one checkpoint "
                                         r"interval \(4 steps x 30 s/step"):
        job = wb.launch(cfg, run_dir=run, cluster=wb.Slurm(
            **TWO_TASKS, time="1:00", signal_before=10, extra=["--begin=now+600"]))
    script = (run / "slurm" / "job.sbatch").read_text()
    assert "--time=1:00" in script
    # the tasks keep the submitter's other XLA flags (conftest's); only the count is theirs
    flags = re.search(r"export XLA_FLAGS=(.*)", script).group(1)
    assert "--xla_backend_optimization_level=0" in flags, flags
    assert re.findall(r"device_count=(\d+)", flags) == ["2"], flags
    assert job.stop(60) == "stopped"


def test_slurm_commands_missing_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo, no sbatch
    with pytest.raises(SlurmError, match=r"`sinfo` is not on PATH.*login node.*SLURM_CONF"):
        wb.launch(wb.TrainConfig(**CFG), run_dir=tmp_path / "r", cluster=wb.Slurm(**TWO_TASKS))
    assert not (tmp_path / "r").exists()


def test_slurm_time_limits_and_requests_are_checked():
    assert parse_time("90") == 5400 and parse_time(30) == 1800
    assert parse_time("1:30:00") == 5400 and parse_time("2-00:00:00") == 172800
    assert parse_time("1-2") == 93600 and parse_time("10:30") == 630
    with pytest.raises(ValueError, match=r"time='soon'.*HH:MM:SS"):
        wb.Slurm(time="soon")
    with pytest.raises(ValueError, match=r"nodes=0.*positive"):
        wb.Slurm(nodes=0)
    with pytest.raises(TypeError, match=r"list of strings"):
        wb.Slurm(extra="--qos=high")


def test_run_dir_on_local_disk_warns_for_other_hosts(tmp_path):
    warn_if_not_shared(tmp_path, ["localhost", os.uname().nodename])  # this host: quiet
    with pytest.warns(UserWarning, match=r"local '.*' filesystem.*node7.*df -T"):
        warn_if_not_shared(tmp_path, ["node7", "node8"])


# ----------------------------------------------------------------------------- ssh
@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = LocalSshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


def _hosts(sshd, n: int = 2, **kw) -> wb.Hosts:
    root = str(Path(wb.__file__).resolve().parent.parent)
    return wb.Hosts(["root@127.0.0.1"] * n, port=sshd.port, identity=str(sshd.key),
                    ssh_options=sshd.options, python=sys.executable, devices_per_task=2,
                    platform="cpu", env={"PYTHONPATH": root,   # sshd's environment is not ours:
                                         "XLA_FLAGS": os.environ["XLA_FLAGS"]},  # conftest's
                    **kw)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hosts_over_ssh_train_like_one_process_and_stop_together(sshd, one_by_four, tmp_path):
    run_dir = tmp_path / "run"
    job = wb.launch(wb.TrainConfig(**CFG), run_dir=run_dir, cluster=_hosts(sshd))
    _wait_for(lambda: len(_losses(run_dir)) >= 2, 400, job)
    # stop: `ssh host kill -TERM <pid>` to each worker; they checkpoint at one step and exit
    assert job.stop(120) == "stopped", job.tail()
    assert [p.returncode for p in job.processes] == [75, 75]
    got = _losses(run_dir)
    assert 2 <= len(got) < CFG["steps"]
    assert got == one_by_four[:len(got)]  # 2 hosts x 2 devices = 1 x 4, bitwise
    assert max(int(p.name) for p in (run_dir / "checkpoints").iterdir()
               if p.name.isdigit()) == len(got)  # the stop step's checkpoint
    for i in range(2):  # each worker's output streamed into its own log here
        log = (run_dir / "logs" / f"process-{i}.log").read_text()
        assert "[workbench] worker pid" in log and f"process {i} of 2 joined" in log


@pytest.mark.multiprocess
def test_hosts_dead_worker_fails_the_job_and_stops_the_others(sshd, tmp_path):
    long = wb.TrainConfig(**{**CFG, "steps": 500})
    job = wb.launch(long, run_dir=tmp_path / "run", cluster=_hosts(sshd))
    logs = [tmp_path / "run" / "logs" / f"process-{i}.log" for i in range(2)]
    _wait_for(lambda: all(_remote_pid(p) for p in logs), 120, job)
    pids = [_remote_pid(p) for p in logs]
    os.kill(pids[1], signal.SIGKILL)  # the remote worker itself, not its ssh
    assert job.wait(120) == "failed", job.tail()
    assert job.failure["process"] == 1
    assert "SIGKILL" in job.failure["reason"] or "255" in job.failure["reason"]
    # the other worker was stopped on its host (ssh kill), not left in its collective
    _wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 60)
    assert job.processes[0].state in ("killed", "failed", "stopped")


def test_tpu_slice_commands_and_missing_gcloud(tmp_path, monkeypatch):
    tpu = wb.TPUSlice("my-v5p", "us-east5-a", "my-project", workers=4)
    cmd = tpu.remote_command(2, tmp_path / "run", "TOKEN")
    argv = tpu.remote_argv(2, cmd)
    assert argv[1:9] == ["compute", "tpus", "tpu-vm", "ssh", "my-v5p", "--zone=us-east5-a",
                         "--project=my-project", "--worker=2"]
    assert argv[9] == f"--command={cmd}"
    assert "--distributed on" in cmd and "--platform tpu" in cmd and "--coordinator" not in cmd
    assert tpu.all_workers_argv("hostname")[6:9] == ["--zone=us-east5-a",
                                                     "--project=my-project", "--worker=all"]
    assert tpu.describe_argv()[1:] == ["compute", "tpus", "tpu-vm", "describe", "my-v5p",
                                      "--zone=us-east5-a", "--project=my-project",
                                      "--format=json"]
    assert tpu.host_names() == [f"my-v5p-worker-{i}" for i in range(4)]
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(HostsError, match=r"`gcloud` is not on PATH.*Google Cloud CLI"):
        wb.launch(wb.TrainConfig(**CFG), run_dir=tmp_path / "r",
                  cluster=wb.TPUSlice("my-v5p", "us-east5-a", "p"))
    assert not (tmp_path / "r").exists()
    with pytest.raises(HostsError, match=r"`ssh` is not on PATH.*openssh-client"):
        wb.launch(wb.TrainConfig(**CFG), run_dir=tmp_path / "s",
                  cluster=wb.Hosts(["a", "b"], devices_per_task=4))
    assert not (tmp_path / "s").exists()


def test_job_widget_shows_the_slurm_state_and_its_history(tmp_path):
    import shutil

    from test_jobs import NODE_RUNNER

    from workbench.widgets import _assets

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (needed to run the widget's ES module)")
    history = [{"state": s, "reason": r, "nodes": n, "restarts": k, "time": 0}
               for s, r, n, k in [("PENDING", "Priority", "", 0), ("RUNNING", "None", "vm", 0),
                                  ("REQUEUED", "None", "vm", 1), ("PENDING", "BeginTime", "", 1)]]
    payload = {"run_dir": "/runs/x", "name": "x", "status": "queued", "done": False,
               "platform": "cpu", "devices_per_process": 4, "step": 6, "target_steps": 10,
               "latest": {"loss": 4.5}, "loss": [[1, 5.0], [6, 4.5]], "mfu": [], "failure": None,
               "processes": [{"index": i, "pid": None, "state": "queued", "returncode": None,
                              "log": f"/runs/x/logs/process-{i}.log"} for i in range(2)],
               "tails": {"0": ["===== start 2"], "1": []},
               "scheduler": {"name": "slurm", "job_id": "42", "state": "PENDING",
                             "reason": "BeginTime", "nodes": "", "restarts": 1,
                             "history": history}}
    (tmp_path / "state.json").write_text(json.dumps({"payload": payload}))
    (tmp_path / "job.mjs").write_text(_assets.esm("job"))
    runner = tmp_path / "run.mjs"
    runner.write_text(NODE_RUNNER % {
        "harness": Path(__file__).parent / "widgets_js" / "fake_dom.mjs",
        "module": tmp_path / "job.mjs", "state": tmp_path / "state.json"})
    out = subprocess.run([node, str(runner)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert "SLURM job 42: PENDING (BeginTime) · requeued 1×" in rep["text"]
    assert "PENDING → RUNNING → REQUEUED → PENDING" in rep["text"]
    assert rep["badges"] == ["queued", "PENDING", "queued", "queued"]
    assert "null" not in rep["text"] and "step 6 of 10" in rep["text"]
