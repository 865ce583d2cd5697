"""Launching multi-process jax.distributed jobs: the lock, joining, faults, stop, training.

Every job here is real: OS processes joined by ``jax.distributed`` over 127.0.0.1 with
gloo collectives, 4 simulated CPU devices each. Training tests compare against the same
config trained in one process with 8 devices, and a resumed job against the
uninterrupted one; nothing is mocked.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench import _display
from workbench.jobs import JobRunningError, RunLock, attach, _cluster as cluster, ping
from workbench.jobs._job import read_tail
from workbench.jobs._worker import EXIT_STOPPED

pytestmark = pytest.mark.multiprocess   # every test launches (or watches) a multi-process job


def _ping_report(log: Path) -> dict:
    line = next(x for x in reversed(log.read_text().splitlines()) if "PING " in x)
    return json.loads(line.split("PING ", 1)[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ----------------------------------------------------------------------------- the lock
def test_lock_refuses_a_live_holder_and_releases(tmp_path):
    first = RunLock(tmp_path)
    first.acquire(pids=[os.getpid()])
    with pytest.raises(JobRunningError, match=rf"pid {os.getpid()}.*job.stop\(\)"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / "job.lock").exists()
    second = RunLock(tmp_path)
    second.acquire()
    assert second.read()["pid"] == os.getpid()
    second.release()


def test_stale_lock_of_dead_processes_is_taken_over(tmp_path):
    dead = _dead_pid()
    (tmp_path / "job.lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": dead, "pids": [dead], "created": 0}))
    lock = RunLock(tmp_path)
    with pytest.warns(UserWarning, match=rf"stale lock.*pid {dead}"):
        lock.acquire(pids=[123])
    assert lock.read()["pid"] == os.getpid() and lock.read()["pids"] == [123]
    lock.release()


def test_lock_from_another_host_is_refused_with_the_fix(tmp_path):
    (tmp_path / "job.lock").write_text(json.dumps(
        {"host": "some-other-host", "pid": 1, "pids": [1], "created": time.time()}))
    with pytest.raises(JobRunningError, match=r"another host.*delete .*job\.lock"):
        RunLock(tmp_path).acquire()


def test_reused_pid_counts_as_dead(tmp_path):
    # our own pid, but with a different start time: a pid that was reused
    (tmp_path / "job.lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "pids": [],
         "starts": {str(os.getpid()): "1"}, "created": 0}))
    with pytest.warns(UserWarning, match="stale lock"):
        RunLock(tmp_path).acquire()


# ----------------------------------------------------------------------------- joining
def test_partial_distributed_arguments_are_named():
    spec = cluster.DistributedSpec(coordinator="127.0.0.1:1234", num_processes=2)
    with pytest.raises(ValueError, match=r"also pass \['process_id'\]"):
        cluster.initialize(spec)
    with pytest.raises(ValueError, match=r"process_id=2 must lie in \[0, num_processes=2\)"):
        cluster.initialize(cluster.DistributedSpec(coordinator="h:1", num_processes=2,
                                                   process_id=2))


@pytest.mark.parametrize("value", ["20", "-1", "low", ""])
def test_a_bad_gloo_nice_is_refused_before_joining(value, monkeypatch):
    monkeypatch.setenv(cluster.GLOO_NICE_ENV, value)
    spec = cluster.DistributedSpec(coordinator="127.0.0.1:1", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match=rf"WORKBENCH_GLOO_NICE={value!r}.* 0 .* 19"):
        cluster.initialize(spec)   # nothing joined: port 1 would never answer


def test_detect_cluster_uses_jax_detectors(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                "SLURM_LOCALID", "JAX_COORDINATOR_ADDRESS", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(var, raising=False)
    assert cluster.detect_cluster() is None
    env = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cluster.detect_cluster() == "SlurmCluster"
    from jax._src.clusters import SlurmCluster  # JAX itself reads the same environment

    assert SlurmCluster.get_process_count() == 2 and SlurmCluster.get_process_id() == 0


def test_read_tail_keeps_the_latest_launch_and_drops_gloo_chatter(tmp_path):
    log = tmp_path / "process-0.log"
    log.write_text("===== launch 1\nold\n===== launch 2\na\n"
                   "[Gloo] Rank 1 is connected to 7 peer ranks. Expected number ...\nb\nc\n")
    assert read_tail(log, 2) == ["b", "c"]
    assert read_tail(log, 10) == ["a", "b", "c"]
    assert len(read_tail(log, 10, raw=True)) == 4
    assert read_tail(tmp_path / "missing.log") == []


# ----------------------------------------------------------------------------- jobs
def test_ping_job_all_reduces_across_two_processes(tmp_path):
    job = ping(2, 4, run_dir=tmp_path / "p", platform="cpu")
    assert job.wait(120) == "finished", job.tail()
    for i in range(2):
        r = _ping_report(job.logs[i])
        # device d of process p contributes p: 4 * 0 + 4 * 1 (hand count)
        assert r == {**r, "processes": 2, "devices": 8, "local_devices": [4, 4],
                     "sum": 4.0, "expected": 4.0}
    assert [p.state for p in job.processes] == ["finished", "finished"]
    assert not (tmp_path / "p" / "job.lock").exists()


def _gloo_loops(pid: int) -> list[int]:
    """The nice value, as the kernel reports it (/proc/<pid>/task/<tid>/stat), of each
    thread of process ``pid`` waiting like gloo's network thread."""
    nice = []
    for tid in cluster._gloo_loop_threads(pid):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        nice.append(int(stat[16]))   # field 19 of stat(5), counted after "comm)"
    return nice


def _gloo_loops_seen(pid: int, job) -> list[int]:
    """:func:`_gloo_loops` of ``pid`` from the first look that finds the thread: between
    two ticks of its loop the thread is not in the call, so one look can find none."""
    seen: list[int] = []

    def look() -> list[int]:
        seen[:] = _gloo_loops(pid)
        return seen

    _wait_for(look, 10, job)
    return seen


def test_stop_makes_every_process_stop_at_the_same_round(tmp_path):
    """...and while the job runs, each process's gloo network thread runs at nice 19
    (the kernel's view of the thread, /proc), under the threads that compute: a message
    that arrives early makes that thread spin (workbench.jobs._cluster.
    _lower_gloo_thread_priority)."""
    job = ping(2, 4, run_dir=tmp_path / "p", hold=120, platform="cpu")
    _wait_for(lambda: all("PING " in p.log.read_text() for p in job.processes), 90, job)
    for p in job.processes:
        assert _gloo_loops_seen(p.pid, job) == [cluster.GLOO_THREAD_NICE] == [19], p.pid
    assert job.stop(60) == "stopped", job.tail()
    assert [p.returncode for p in job.processes] == [EXIT_STOPPED, EXIT_STOPPED]
    rounds = [re.search(r"stopped at round (\d+)", p.log.read_text()).group(1)
              for p in job.processes]
    assert rounds[0] == rounds[1]  # JAX's preemption sync point: one agreed round


def test_killed_process_fails_the_job_fast_and_nothing_hangs(tmp_path, monkeypatch):
    """(With WORKBENCH_GLOO_NICE=0 in the workers' environment, gloo's network thread
    keeps the priority it started with.)"""
    run_dir = tmp_path / "p"
    monkeypatch.setenv(cluster.GLOO_NICE_ENV, "0")
    job = ping(2, 4, run_dir=run_dir, hold=120, platform="cpu")
    _wait_for(lambda: all("PING " in p.log.read_text() for p in job.processes), 90, job)
    for p in job.processes:
        assert _gloo_loops_seen(p.pid, job) == [0], p.pid
    with pytest.raises(JobRunningError, match="already has a running job"):
        ping(2, 4, run_dir=run_dir, platform="cpu")  # concurrent launch refused
    victim = job.processes[1].pid
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert job.wait(60) == "failed"
    assert time.monotonic() - t0 < 60
    f = job.failure
    assert f["process"] == 1 and f["returncode"] == -signal.SIGKILL
    assert "process 1" in f["message"] and "SIGKILL" in f["message"]
    assert any("PING" in line for line in f["last_lines"])
    assert [p.state for p in job.processes] == ["killed", "failed"]
    assert not any(_alive(p.pid) for p in job.processes)
    assert not (run_dir / "job.lock").exists()
    again = ping(2, 4, run_dir=run_dir, platform="cpu")  # the run dir is free again
    assert again.wait(120) == "finished", again.tail()


def test_attach_watches_and_stops_a_job_started_elsewhere(tmp_path):
    job = ping(2, 2, run_dir=tmp_path / "p", hold=120, platform="cpu")
    _wait_for(lambda: all("PING " in p.log.read_text() for p in job.processes), 90, job)
    watcher = attach(tmp_path / "p")  # e.g. from a restarted kernel: no Popen handles
    assert watcher.status == "running"
    assert [p.pid for p in watcher.processes] == [p.pid for p in job.processes]
    assert watcher.stop(60) == "stopped"
    assert [p.returncode for p in watcher.processes] == [EXIT_STOPPED, EXIT_STOPPED]
    assert job.wait(30) == "stopped"
    with pytest.raises(FileNotFoundError, match="no job is running"):
        attach(tmp_path / "p")


# ----------------------------------------------------------------------------- the protocol
def test_every_cluster_kind_is_a_cluster_and_launch_takes_nothing_else(tmp_path):
    """Local, Slurm, Hosts and TPUSlice satisfy the runtime-checkable Cluster protocol (a
    slice whose worker count gcloud would give is checked without running gcloud), and
    ``attach`` asks exactly these kinds, Local last."""
    import workbench as wb
    from workbench.jobs import Cluster, Local
    from workbench.jobs._dispatch import KINDS

    kinds = [Local(processes=2, devices_per_process=4), wb.Slurm(nodes=2, gpus_per_node=8),
             wb.Hosts(["node1", "node2"]), wb.TPUSlice("my-v5p", "us-east5-a", workers=4)]
    assert all(isinstance(k, Cluster) for k in kinds)
    assert [k.tasks for k in kinds] == [2, 2, 2, 4]
    assert {type(k) for k in kinds} == set(KINDS) and KINDS[-1] is Local is wb.Local
    unasked = wb.TPUSlice("my-v5p", "us-east5-a", gcloud=str(tmp_path / "no-gcloud"))
    assert isinstance(unasked, Cluster) and unasked.workers is None
    for other in (object(), "slurm", {"nodes": 2}, wb.TrainConfig):
        assert not isinstance(other, Cluster)
        with pytest.raises(TypeError, match=r"wb.launch: cluster=.* pass a wb.Local, wb.Slurm, "
                                            r"wb.Hosts or wb.TPUSlice"):
            wb.launch(wb.TrainConfig(), run_dir=tmp_path / "r", cluster=other)
    with pytest.raises(ValueError, match=r"needs 8 devices.*processes=1 x "
                                         r"devices_per_process=4 = 4"):
        wb.launch(wb.TrainConfig(mesh={"data": 8}), run_dir=tmp_path / "r",
                  cluster=Local(devices_per_process=4))
    with pytest.raises(FileNotFoundError, match=r"no files match .*nothing\*\.jsonl"):
        wb.launch(wb.TrainConfig(data=wb.data.Dataset(files=str(tmp_path / "nothing*.jsonl"))),
                  run_dir=tmp_path / "r")   # TrainConfig.check, before anything is written
    assert not (tmp_path / "r").exists()


def test_local_submits_and_attaches_through_the_protocol(tmp_path):
    """A real two-process job (jax.distributed over loopback) submitted to ``Local`` through
    the protocol: each worker runs the command ``remote_command`` previews, the one
    ``attach`` finds it as ``Local.attach`` does, and stops it."""
    import shlex

    import workbench as wb
    from workbench.jobs import Local, NoJobError, Submission
    from workbench.jobs._worker import ping_command

    local, run_dir = Local(processes=2, devices_per_process=2, platform="cpu"), tmp_path / "p"
    job = local.submit(Submission(run_dir=run_dir, command=ping_command(120), what="ping"))
    _wait_for(lambda: all("PING " in p.log.read_text() for p in job.processes), 90, job)
    assert [Local.recorded(run_dir), wb.Slurm.recorded(run_dir), wb.Hosts.recorded(run_dir),
            wb.TPUSlice.recorded(run_dir)] == [True, False, False, False]
    token = RunLock(run_dir).read()["token"]
    for i, argv in enumerate(job.commands):
        port = argv[argv.index("--coordinator") + 1].rpartition(":")[2]
        preview = shlex.split(local.remote_command(i, run_dir, token,
                                                    command=ping_command(120)))
        assert preview == [f"WORKBENCH_JOB={token}", "JAX_PLATFORMS=cpu",
                           *(a.replace(f":{port}", ":<port>") for a in argv)]
    found, again = Local.attach(run_dir), wb.attach(run_dir)
    for watcher in (found, again):
        assert type(watcher) is wb.Job and watcher.status == "running"
        assert [p.pid for p in watcher.processes] == [p.pid for p in job.processes]
    assert again.stop(60) == "stopped"
    assert job.wait(30) == "stopped" and found.wait(30) == "stopped"
    assert not Local.recorded(run_dir)
    with pytest.raises(NoJobError, match="no job is running"):
        wb.attach(run_dir)


@pytest.fixture(scope="module")
def finished_ping(tmp_path_factory):
    job = ping(2, 1, run_dir=tmp_path_factory.mktemp("ping") / "p", platform="cpu")
    assert job.wait(120) == "finished", job.tail()
    return job


def test_job_widget_follows_the_job_live(tmp_path):
    from workbench.widgets._job_view import JobView, job_payload

    job = ping(2, 1, run_dir=tmp_path / "p", hold=2, platform="cpu")
    view = JobView(job, interval=0.2)
    assert view.payload["status"] == "running" and not view.payload["done"]
    job.wait(120)
    _wait_for(lambda: view.payload["done"], 10, None)
    p = view.payload
    assert p == job_payload(job) and p["status"] == "finished" and p["failure"] is None
    assert [q["state"] for q in p["processes"]] == ["finished", "finished"]
    assert any("ping ok" in line for line in p["tails"]["0"])
    with pytest.MonkeyPatch.context() as mp:   # in a notebook; elsewhere its text only
        mp.setattr(_display, "in_notebook", lambda: True)
        data, _ = job._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"].startswith("Job(")
    view.close()


def _wait_for(pred, timeout: float, job) -> None:
    t_end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > t_end or (job is not None and job.done):
            detail = "" if job is None else f"; job {job.status}:\n{job.tail()}"
            raise AssertionError(f"condition not reached within {timeout} s{detail}")
        time.sleep(0.2)


# ----------------------------------------------------------------------------- training
# "tiny" with a short sequence and batch keeps each multi-process job to seconds of steps.
CFG = {"model": "tiny", "mesh": {"data": 8}, "rules": "fsdp", "batch": 8, "seq": 32,
       "steps": 20, "checkpoint_every": 5, "keep": 3, "seed": 0, "data": "text"}


def _losses(run_dir: Path) -> list[float]:
    from workbench import _runs as runs

    return [r["loss"] for r in runs.read_metrics(run_dir)]


def _committed_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) \
        if folder.exists() else []


@pytest.mark.slow
def test_stop_leaves_a_checkpoint_at_the_stop_step(tmp_path):
    from workbench import _runs as runs
    from workbench.jobs import launch
    from workbench.train import TrainConfig

    cfg = TrainConfig(**{**CFG, "mesh": {"data": 4}, "rules": "dp", "steps": 500,
                          "checkpoint_every": 400})   # 2 x 2: gloo costs CPU per device
    run_dir = tmp_path / "job"
    job = launch(cfg, processes=2, devices_per_process=2, run_dir=run_dir, platform="cpu")
    _wait_for(lambda: len(_losses(run_dir)) >= 3, 300, job)
    with pytest.raises(JobRunningError):
        launch(cfg, processes=2, devices_per_process=2, run_dir=run_dir, platform="cpu")
    assert job.stop(120) == "stopped", job.tail()
    assert [p.returncode for p in job.processes] == [EXIT_STOPPED, EXIT_STOPPED]
    last = runs.read_metrics(run_dir)[-1]["step"]
    assert 3 <= last < 500
    assert _committed_steps(run_dir) == [last]  # no periodic save before 400: this is the stop
    assert runs.read_run(run_dir)["status"] == "interrupted"


def test_a_mesh_larger_than_the_launch_is_refused_before_starting(tmp_path):
    from workbench.jobs import launch
    from workbench.train import TrainConfig

    with pytest.raises(ValueError, match=r"needs 8 devices.*processes=2 x "
                                         r"devices_per_process=2 = 4"):
        launch(TrainConfig(**CFG), processes=2, devices_per_process=2, run_dir=tmp_path / "r")
    assert not (tmp_path / "r" / "logs").exists()


NODE_RUNNER = """
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import { Node, byClass, fakeModel, installDom, walk } from "%(harness)s";
installDom();
document.createElementNS = (ns, tag) => new Node(tag);
const mod = await import(pathToFileURL("%(module)s").href);
const model = fakeModel(JSON.parse(readFileSync("%(state)s", "utf8")));
const sent = [];
model.send = (msg) => sent.push(msg);
const host = document.createElement("div");
const cleanup = mod.default.render({ model, el: host });
const stop = byClass(host, "wb-stop")[0];
const disabled = stop.getAttribute("disabled");
stop.dispatch("click");
const report = {
  text: host.textContent,
  badges: byClass(host, "wb-status").map((n) => n.textContent),
  paths: walk(host).filter((n) => String(n.tagName).toLowerCase() === "path")
    .map((n) => n.getAttribute("d")),
  disabled, sent,
};
cleanup();
report.handlers_left = Object.values(model.handlers).reduce((a, h) => a + h.length, 0);
process.stdout.write(JSON.stringify(report));
"""


@pytest.mark.parametrize("done", [True, False])
def test_job_widget_renders_status_curve_and_stop(finished_ping, tmp_path, done):
    import shutil

    from workbench.widgets import _assets
    from workbench.widgets._job_view import job_payload

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (needed to run the widget's ES module)")
    payload = job_payload(finished_ping)
    payload.update(loss=[[1, 5.0], [2, 4.0], [3, 3.0]], step=3, target_steps=6, done=done,
                   latest={"loss": 3.0, "mfu": 0.25, "step_time": 0.5, "peak_source": "table"})
    (tmp_path / "state.json").write_text(json.dumps({"payload": payload}))
    (tmp_path / "job.mjs").write_text(_assets.esm("job"))  # with common.js inlined
    runner = tmp_path / "run.mjs"
    runner.write_text(NODE_RUNNER % {
        "harness": Path(__file__).parent / "widgets_js" / "fake_dom.mjs",
        "module": tmp_path / "job.mjs", "state": tmp_path / "state.json"})
    out = subprocess.run([node, str(runner)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["badges"] == ["finished", "finished", "finished"]  # job, process 0, process 1
    assert "step 3 of 6" in rep["text"] and "loss 3.000" in rep["text"]
    assert "MFU 25.0% (table)" in rep["text"] and "ping ok" in rep["text"]
    # the loss curve: 3 points left to right, falling (SVG y grows downwards)
    path = rep["paths"][0]  # the loss chart comes first (then MFU, empty here)
    pts = [tuple(map(float, p.split(","))) for p in path.replace("M", "").split("L")]
    assert len(pts) == 3 and pts[0][0] < pts[1][0] < pts[2][0] and pts[0][1] < pts[2][1]
    assert (rep["disabled"] is not None) == done
    assert rep["sent"] == ([] if done else [{"type": "stop"}])
    assert rep["handlers_left"] == 0
