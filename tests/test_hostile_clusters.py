"""Hostile cluster requests (issue 44, item 5): every bad field refused at construction,
naming the field; every value that enters a SLURM batch script or a remote shell command
quoted (the script parsed back as sbatch and bash read it) or refused; an ssh launch to a
host that does not answer fails fast, names the host, and releases the run directory.

The references: sbatch's own reading of ``#SBATCH`` lines (a replica of ``_get_argument`` in
slurm's src/sbatch/opt.c: quotes and backslashes as the shell's, an unquoted ``#`` starts a
comment, the first line that is not a comment ends the options), bash running the script
with a stand-in ``srun`` that records the argv and environment it was given, and the real
ssh client against a closed port, a silent listener and TEST-NET-1 (RFC 5737).
"""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workbench as wb
from workbench.jobs._hosts import HostsError
from workbench.jobs._slurm import worker_argv
from workbench._run_lock import RunLock

CFG = {"model": "tiny", "mesh": {"data": 1}, "batch": 2, "seq": 16, "steps": 2, "data": "text"}
HOSTILE = "run 1 #x $(touch PWNED) `touch PWNED` 'q' \"d\" ;&|<>\\"

# ----------------------------------------------------------------------------- construction
BAD = [
    # (class, args, kwargs, exception, message)
    (wb.TPUSlice, ("s", "z"), dict(workers=0), ValueError, r"workers=0 .*positive.*v5p-32"),
    (wb.TPUSlice, ("s", "z"), dict(workers=-1), ValueError, r"workers=-1 .*positive"),
    (wb.TPUSlice, ("s", "z"), dict(workers=1.5), TypeError, r"workers=1.5 is a float"),
    (wb.TPUSlice, ("s", "z"), dict(workers="4"), TypeError, r"workers='4' is a string.*workers=4"),
    (wb.TPUSlice, ("s", "z"), dict(platform="quantum"), ValueError,
     r"platform='quantum'.*'cpu', 'gpu', 'tpu'"),
    (wb.TPUSlice, ("my v5p", "z"), {}, ValueError, r"name='my v5p'.*not ' '"),
    (wb.TPUSlice, ("--x", "z"), {}, ValueError, r"name='--x'.*not '-'"),
    (wb.TPUSlice, ("s", "z\n--worker=all"), {}, ValueError, r"zone=.*newline at index 1"),
    (wb.TPUSlice, ("s", "z", "p$(id)"), {}, ValueError, r"project=.*not '\$'"),
    (wb.TPUSlice, ("s", "z"), dict(setup=[5]), TypeError, r"setup\[0\]=5 is not a string"),
    (wb.TPUSlice, ("s", "z"), dict(ssh_flags="--internal-ip"), TypeError,
     r"ssh_flags=.*list of strings"),
    (wb.TPUSlice, ("s", "z"), dict(gcloud=None), TypeError, r"gcloud=None.*must be a string"),
    (wb.TPUSlice, ("s", "z"), dict(start_timeout=0), ValueError, r"start_timeout=0 .*> 0"),
    (wb.Hosts, ("node1",), {}, ValueError, r"non-empty list of hosts"),
    (wb.Hosts, ([],), {}, ValueError, r"non-empty list of hosts"),
    (wb.Hosts, (["-oProxyCommand=touch PWNED"],), {}, ValueError, r"hosts\[0\]=.*not '='"),
    (wb.Hosts, (["-node1"],), {}, ValueError, r"hosts\[0\]=.*not starting with -"),
    (wb.Hosts, (["node 1"],), {}, ValueError, r"hosts\[0\]=.*not ' '"),
    (wb.Hosts, (["node1", "a\nb"],), {}, ValueError, r"hosts\[1\]=.*newline at index 1"),
    (wb.Hosts, ([5],), {}, TypeError, r"hosts\[0\]=5.*must be a string"),
    (wb.Hosts, (["n"],), dict(port=0), ValueError, r"port=0 .*from 1 to 65535"),
    (wb.Hosts, (["n"],), dict(port=70000), ValueError, r"port=70000 .*from 1 to 65535"),
    (wb.Hosts, (["n"],), dict(port="22"), TypeError, r"port='22' is a string.*port=22"),
    (wb.Hosts, (["n"],), dict(coordinator_port=True), TypeError, r"coordinator_port=True.*bool"),
    (wb.Hosts, (["n"],), dict(identity=5), TypeError, r"identity=5.*must be a string"),
    (wb.Hosts, (["n"],), dict(ssh_options="-v"), TypeError, r"ssh_options='-v'.*list"),
    (wb.Hosts, (["n"],), dict(env={"1A": "x"}), ValueError, r"'1A' is not an environment"),
    (wb.Hosts, (["n"],), dict(env={"A": "x\ny"}), ValueError, r"env\['A'\].*newline"),
    (wb.Hosts, (["n"],), dict(env={"A": None}), TypeError, r"value of A must be a string"),
    (wb.Hosts, (["n"],), dict(env=["A=1"]), TypeError, r"env takes a dict"),
    (wb.Hosts, (["n"],), dict(setup=["a\nb"]), ValueError, r"setup\[0\].*newline.*own entry"),
    (wb.Hosts, (["n"],), dict(platform="quantum"), ValueError, r"platform='quantum'"),
    (wb.Hosts, (["n"],), dict(python="py\nthon"), ValueError, r"python=.*newline"),
    (wb.Hosts, (["n"],), dict(workdir=3), TypeError, r"workdir=3.*must be a string"),
    (wb.Hosts, (["n"],), dict(devices_per_task=0), ValueError, r"devices_per_task=0 .*positive"),
    (wb.Hosts, (["n"],), dict(connect_timeout=1.5), TypeError, r"connect_timeout=1.5.*float"),
    (wb.Hosts, (["n"],), dict(start_timeout=float("nan")), ValueError,
     r"start_timeout=nan is not finite"),
    (wb.Slurm, (), dict(requeue="no"), TypeError, r"requeue='no'.*True.*or False"),
    (wb.Slurm, (), dict(requeue=1), TypeError, r"requeue=1"),
    (wb.Slurm, (), dict(setup=[5]), TypeError, r"setup\[0\]=5 is not a string"),
    (wb.Slurm, (), dict(setup="module load cuda"), TypeError, r"setup=.*list of strings"),
    (wb.Slurm, (), dict(platform="quantum"), ValueError, r"platform='quantum'.*'cpu'"),
    (wb.Slurm, (), dict(nodes=0), ValueError, r"nodes=0 .*positive"),
    (wb.Slurm, (), dict(nodes=1.5), TypeError, r"nodes=1.5 is a float.*nodes=1 or nodes=2"),
    (wb.Slurm, (), dict(nodes="2"), TypeError, r"nodes='2' is a string.*nodes=2"),
    (wb.Slurm, (), dict(gpus_per_node=True), TypeError, r"gpus_per_node=True.*bool"),
    (wb.Slurm, (), dict(signal_before=-5), ValueError, r"signal_before=-5"),
    (wb.Slurm, (), dict(time="soon"), ValueError, r"time='soon'.*HH:MM:SS"),
    (wb.Slurm, (), dict(time=0), ValueError, r"time=0"),
    (wb.Slurm, (), dict(time="1:00\n#x"), ValueError, r"time=.*newline at index 4"),
    (wb.Slurm, (), dict(partition="a b"), ValueError, r"partition='a b'.*not ' '"),
    (wb.Slurm, (), dict(partition="gpu\n#SBATCH --x"), ValueError, r"partition=.*newline"),
    (wb.Slurm, (), dict(account="$(rm -rf ~)"), ValueError, r"account=.*not '\$'"),
    (wb.Slurm, (), dict(job_name="a\nb"), ValueError, r"job_name=.*newline at index 1"),
    (wb.Slurm, (), dict(job_name="`id`"), ValueError, r"job_name=.*not '`'"),
    (wb.Slurm, (), dict(job_name="x'y"), ValueError, r"job_name=.*not \"'\""),
    (wb.Slurm, (), dict(extra="--qos=high"), TypeError, r"extra=.*list of strings"),
    (wb.Slurm, (), dict(extra=["qos"]), ValueError, r"extra\[0\]='qos' is not an sbatch option"),
    (wb.Slurm, (), dict(extra=["--qos=high\nrm -rf ~"]), ValueError, r"extra\[0\].*newline"),
    (wb.Slurm, (), dict(env={"A B": "x"}), ValueError, r"'A B' is not an environment"),
    (wb.Slurm, (), dict(env={"A": "x\ny"}), ValueError, r"env\['A'\].*newline"),
    (wb.Slurm, (), dict(python="a\nb"), ValueError, r"python=.*newline"),
]


@pytest.mark.parametrize("cls, args, kwargs, exc, message", BAD,
                         ids=[f"{c.__name__}-{i}" for i, (c, *_r) in enumerate(BAD)])
def test_bad_fields_are_refused_naming_the_field(cls, args, kwargs, exc, message):
    with pytest.raises(exc, match=message) as err:
        cls(*args, **kwargs)
    text = str(err.value)
    assert text.startswith(f"wb.{cls.__name__}"), text
    for field in kwargs:   # (positional rows name theirs in the message's pattern)
        assert f"{field}=" in text or f"{field}[" in text, text


def test_good_fields_are_accepted_and_normalized(tmp_path):
    s = wb.Slurm(setup=["module load cuda"], env={"N": 4, "X": "a b"}, extra=("--qos=high",),
                 time="1:00", partition="debug", account="lab-1", job_name="my.run-2")
    assert s.setup == ("module load cuda",) and s.env == {"N": "4", "X": "a b"}
    h = wb.Hosts(["node1", "user@10.0.0.2", "[::1]"], identity=tmp_path / "key",
                 workdir=tmp_path, port=22)
    assert h.identity == str(tmp_path / "key") and h.workdir == str(tmp_path)
    assert h.hosts == ("node1", "user@10.0.0.2", "[::1]")
    assert wb.TPUSlice("my-v5p", "us-east5-a", "example.com:proj", workers=4).tasks == 4


# ----------------------------------------------------------------------------- the script
def sbatch_options(script: str) -> list[str]:
    """The options sbatch reads from ``script``'s ``#SBATCH`` lines (src/sbatch/opt.c)."""
    out = []
    for line in script.splitlines()[1:]:
        if not line.startswith("#"):
            if line.strip():
                break   # the first command ends the options
            continue
        if not line.startswith("#SBATCH"):
            continue
        ptr, arg, quote, escape = line[len("#SBATCH"):].lstrip(" \t"), [], None, False
        for ch in ptr:
            if escape:
                arg.append(ch)
                escape = False
            elif ch == "\\":   # an escape, inside quotes too (unlike the shell)
                escape = True
            elif quote:
                if ch == quote:
                    quote = None
                else:
                    arg.append(ch)
            elif ch in "\"'":
                quote = ch
            elif ch == "#" or ch.isspace():
                break   # a comment, or the end of the (one) argument
            else:
                arg.append(ch)
        out.append("".join(arg))
    return out


FAKE_SRUN = """#!{python}
import json, os, sys
json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}},
          open({out!r}, "w"))
"""

SCRIPTS = [
    # (run dir name, Slurm kwargs, options sbatch must read beyond the fixed ones)
    ("plain", {}, []),
    (HOSTILE, {}, []),
    ("r", dict(job_name="n1", partition="debug", account="lab", time="1:00",
               extra=["--comment=a b #c $(touch PWNED)", "--qos=high"]),
     ["--partition=debug", "--account=lab", "--time=1:00",
      "--comment=a b #c $(touch PWNED)", "--qos=high"]),
    ("r", dict(env={"A": "$(touch PWNED) `touch PWNED` 'q' \"d\" $HOME", "PYTHONPATH": "/x y"},
               requeue=False), []),
    ("r", dict(setup=['export FROM_SETUP="$HOME"'], python=sys.executable, cpus_per_task=2,
               devices_per_task=2, platform="cpu"), ["--cpus-per-task=2"]),
    ("r", dict(python="~/venv/bin/py thon"), []),   # ~/ is the home directory on the node
]


@pytest.mark.parametrize("name, kwargs, more", SCRIPTS,
                         ids=["plain", "hostile-run-dir", "options", "env", "setup", "home"])
def test_batch_script_reads_back_as_asked_and_runs_nothing_else(tmp_path, monkeypatch, name,
                                                                kwargs, more):
    slurm = wb.Slurm(**kwargs)
    run_dir = tmp_path / name
    script = slurm.script(run_dir, steps=3)
    logs = run_dir / "logs"
    job_name = kwargs.get("job_name") or "wb-" + re.sub(r"[^A-Za-z0-9_.+:@%=,-]", "_", name)
    want = [f"--job-name={job_name}", "--nodes=1", "--ntasks-per-node=1",
            f"--chdir={os.getcwd()}", f"--output={logs}/slurm-%j.out", "--open-mode=append",
            "--requeue" if slurm.requeue else "--no-requeue"]
    got = sbatch_options(script)
    assert got[:len(want)] == want, script
    assert [o for o in got[len(want):] if not o.startswith("--signal=")] == more, script
    assert ("--signal=TERM@120" in got) == slurm.requeue
    # bash runs it: srun gets the worker's argv as a list, the environment as given
    bin_dir, out = tmp_path / "bin", tmp_path / "srun.json"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable, out=str(out)))
    (bin_dir / "srun").chmod(0o755)
    logs.mkdir(parents=True)
    (tmp_path / "job.sbatch").write_text(script)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NTASKS": "2",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=work, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(out.read_text())
    task = seen["argv"][seen["argv"].index("bash") + 3:]
    want = worker_argv(slurm, run_dir.absolute(), ["--steps", "3"])
    want[0] = want[0].replace("~", str(tmp_path), want[0].startswith("~/"))
    assert task[0] == "wb" and task[1:] == want
    assert seen["argv"][1] == f"--output={logs}/process-%t.log"
    for k, v in slurm.env.items():
        assert seen["env"][k] == v
    if "PYTHONPATH" not in slurm.env:
        assert seen["env"]["PYTHONPATH"].split(":")[0] == str(Path(wb.__file__).parents[1])
    if kwargs.get("setup"):
        assert seen["env"]["FROM_SETUP"] == str(tmp_path)   # setup lines are shell, by design
    assert (logs / "slurm-7.start").read_text() == "1\n"
    assert not list(tmp_path.rglob("PWNED")) and not (work / "PWNED").exists()


PATHS = [
    # (case, run dir name, working directory name, error)
    ("newline-run-dir", "a\n#SBATCH --x", "w", r"the run directory .* newline at index"),
    ("return-run-dir", "a\rb", "w", r"the run directory .* carriage return at index"),
    ("newline-cwd", "r", "w\nrm", r"the working directory .* newline at index"),
    ("percent-run-dir", "a%jb", "w", r"the run directory .* holds '%'.*--output"),
]


@pytest.mark.parametrize("case, name, cwd, error", PATHS, ids=[p[0] for p in PATHS])
def test_a_path_that_would_break_the_script_is_refused_before_anything_is_written(
        tmp_path, monkeypatch, case, name, cwd, error):
    run_dir = tmp_path / name
    (tmp_path / cwd).mkdir()
    monkeypatch.chdir(tmp_path / cwd)
    with pytest.raises(ValueError, match=error):
        wb.Slurm().script(run_dir)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))   # no sinfo: the check comes first
    with pytest.raises(ValueError, match=error):
        wb.launch(wb.TrainConfig(**CFG), run_dir=run_dir, cluster=wb.Slurm())
    assert not run_dir.exists()


def test_remote_command_runs_the_worker_with_its_arguments_and_nothing_else(tmp_path):
    out = tmp_path / "worker.json"
    fake = tmp_path / "py thon $(touch PWNED)"
    fake.write_text(FAKE_SRUN.format(python=sys.executable, out=str(out)))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    work = tmp_path / HOSTILE
    work.mkdir()
    env = {"A": "$(touch PWNED) `touch PWNED` 'q' \"d\"", "B": ""}
    hosts = wb.Hosts(["n1", "n2"], python=str(fake), workdir=work, env=env, platform="cpu",
                     devices_per_task=2, setup=["export FROM_SETUP=$((1 + 2))"])
    run_dir = tmp_path / ("run " + HOSTILE)
    cmd = hosts.remote_command(1, run_dir, "TOK'", extra=["--steps", "5"])
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60,
                          check=False, env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 0 and done.stdout.startswith("[workbench] worker pid"), done
    seen = json.loads(out.read_text())
    assert seen["argv"] == ["-m", "workbench", "train", "--config", str(run_dir / "config.json"),
                            "--run-dir", str(run_dir), *hosts.worker_args(1), "--steps", "5",
                            "--platform", "cpu", "--devices-per-process", "2"]
    assert {k: seen["env"][k] for k in env} == env and seen["env"]["WORKBENCH_JOB"] == "TOK'"
    assert seen["env"]["FROM_SETUP"] == "3"
    assert not list(tmp_path.rglob("PWNED"))


def test_a_home_relative_python_and_workdir_stay_home_relative(tmp_path):
    out = tmp_path / "worker.json"
    (tmp_path / "venv bin").mkdir()
    (tmp_path / "w d").mkdir()
    fake = tmp_path / "venv bin" / "py"
    fake.write_text(FAKE_SRUN.format(python=sys.executable, out=str(out)))
    fake.chmod(0o755)
    hosts = wb.Hosts(["n"], python="~/venv bin/py", workdir="~/w d")
    cmd = hosts.remote_command(0, tmp_path / "r", "T")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60,
                          check=False, env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 0, done
    seen = json.loads(out.read_text())
    assert seen["cwd"] == str(tmp_path / "w d") and seen["argv"][:3] == ["-m", "workbench",
                                                                          "train"]


def test_ssh_gets_a_connect_timeout_and_keeps_the_users_options_first():
    argv = wb.Hosts(["n"], connect_timeout=7, port=2222,
                    ssh_options=["-o", "ConnectTimeout=3"]).remote_argv(0, "true")
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert opts[0] == "ConnectTimeout=3"   # ssh keeps an option's first value: the user's
    assert {"BatchMode=yes", "ConnectTimeout=7", "ServerAliveInterval=15",
            "ServerAliveCountMax=3"} <= set(opts)
    assert argv[-2:] == ["n", "true"]
    tpu = wb.TPUSlice("s", "z", connect_timeout=9, ssh_flags=["--internal-ip"],
                      gcloud=sys.executable)
    t = tpu.remote_argv(0, "true")
    assert t.index("--internal-ip") < t.index("--ssh-flag=-oConnectTimeout=9")
    assert "--ssh-flag=-oServerAliveInterval=15" in t


# ----------------------------------------------------------------------------- ssh start-up
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fake_ssh(tmp_path: Path, body: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ssh").write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / "ssh").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


STARTS = [
    # (case, hosts, kwargs, error, at most seconds)
    ("closed-port", ["127.0.0.1"], lambda _s: dict(port=_closed_port()),
     r"worker 0 did not start on 127.0.0.1: ssh exited with 255 .*Connection refused", 15),
    ("silent-listener", ["127.0.0.1"], lambda s: dict(port=s.getsockname()[1],
                                                      connect_timeout=1),
     r"worker 0 did not start on 127.0.0.1: ssh exited with 255 .*(timed out|banner)", 15),
    ("test-net-1", ["192.0.2.1"], lambda _s: dict(connect_timeout=1),
     r"worker 0 did not start on 192.0.2.1: ssh exited with 255 .*connect_timeout=1 s", 15),
    ("second-host", ["127.0.0.1", "user@127.0.0.1"], lambda _s: dict(port=_closed_port()),
     r"worker 0 did not start on 127.0.0.1", 15),
    ("hangs", ["node1"], lambda _s: dict(start_timeout=1), r"worker\(s\) 0 \(node1\) did not "
     r"start within start_timeout=1 s.*'\[workbench\] worker pid' line.*raise start_timeout",
     15),
    # both die alike: the message starts with worker 0 whichever ended first, and names 1
    ("dies", ["node1", "node2"], lambda _s: dict(), r"worker 0 did not start on node1: ssh "
     r"exited with 255 .*ssh: Could not resolve hostname.*; worker 1 did not start on node2 "
     r"either: ssh exited with 255 .*Could not resolve hostname", 15),
]


@pytest.mark.filterwarnings("ignore:run directory .* is on a local")
@pytest.mark.parametrize("case, hosts, kwargs, error, seconds", STARTS,
                         ids=[c[0] for c in STARTS])
def test_ssh_that_cannot_start_fails_fast_and_releases_the_run_dir(tmp_path, monkeypatch, case,
                                                                   hosts, kwargs, error, seconds):
    if case == "hangs":
        monkeypatch.setenv("PATH", _fake_ssh(tmp_path, "exec sleep 600")["PATH"])
    if case == "dies":
        monkeypatch.setenv("PATH", _fake_ssh(
            tmp_path, 'echo "ssh: Could not resolve hostname: Name or service not known" >&2; '
                      "exit 255")["PATH"])
    run_dir = tmp_path / "run"
    with socket.socket() as silent:   # accepts, never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        cluster = wb.Hosts(hosts, **kwargs(silent))
        t0 = time.monotonic()
        with pytest.raises(HostsError, match=error):
            wb.launch(wb.TrainConfig(**CFG), run_dir=run_dir, cluster=cluster)
        took = time.monotonic() - t0
    assert took < seconds, took
    assert RunLock(run_dir).read() is None   # the lock is released: a new launch may start
    record = json.loads((run_dir / "hosts.json").read_text())
    for pid in record["ssh_pids"]:   # no ssh left behind
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert not (run_dir / "metrics.jsonl").exists()   # nothing trained


# ----------------------------------------------------------------------------- real sbatch
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    from _clusters import running_slurm

    yield from running_slurm(tmp_path_factory.mktemp("slurm"))


SUBMITS = [
    # (case, run dir name, comment)
    ("hostile-run-dir", HOSTILE, "plain"),
    ("hostile-comment", "r", "a b #c \\ $(touch PWNED) `touch PWNED` \"q\" 'q'"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, name, comment", SUBMITS, ids=[s[0] for s in SUBMITS])
def test_sbatch_reads_every_option_of_a_hostile_request(slurm, tmp_path, case, name, comment):
    run_dir = tmp_path / name
    job = wb.launch(wb.TrainConfig(**CFG), run_dir=run_dir, cluster=wb.Slurm(
        platform="cpu", time="10", partition="debug",
        extra=["--begin=now+600", f"--comment={comment}"]))   # queued, never started
    try:
        shown = subprocess.run(["scontrol", "show", "job", job.job_id], capture_output=True,
                               text=True, timeout=30, check=True).stdout
        fields = dict(re.findall(r"^\s*(StdOut|Comment|WorkDir)=(.*?) *$", shown, re.M))
        assert fields == {"StdOut": f"{run_dir}/logs/slurm-{job.job_id}.out",
                          "Comment": comment, "WorkDir": os.getcwd()}, shown
        assert re.search(r"JobName=wb-\S+\n", shown) and "TimeLimit=00:10:00" in shown
        assert "Partition=debug" in shown and "Reason=BeginTime" in shown
    finally:
        assert job.stop(60) == "stopped"
    assert RunLock(run_dir).read() is None
    assert not list(tmp_path.rglob("PWNED")) and not Path("PWNED").exists()
