"""Hostile multi-process start-up (issue 56, item 6): a worker whose coordinator never
answers says within seconds what it waits for, repeats it, and gives up at its stated
bound (``--initialization-timeout``) with what to check and exit status 69, not JAX's C++
abort; malformed coordinator addresses, a ``--hold`` that never ends and a mesh that does
not match processes x devices are refused before anything starts.

The references: the real ``python -m workbench`` CLI as a subprocess, real workers against a
closed loopback port, a listener that never answers, and a coordinator (process 0) whose
peers never come; JAX's own C++ abort is recognised by its ``Check failure stack trace``.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from workbench.jobs._joining import EXIT_JOIN_TIMEOUT
from workbench.jobs._local import free_port

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
JOIN = ("--num-processes", "2", "--process-id", "1", "--platform", "cpu")
CFG = dict(model="tiny", batch=8, seq=16, steps=2, data="synthetic")


def _cli(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd or ROOT, check=False)


def _config(tmp_path: Path, mesh: dict) -> str:
    from workbench.train import TrainConfig

    path = tmp_path / "config.json"
    path.write_text(TrainConfig(**CFG, mesh=mesh).to_json())
    return str(path)


# ------------------------------------------------------------ refused before anything starts
REFUSED = [
    # (id, argv (CONFIG: a config file of mesh `mesh`), mesh, message on stderr)
    ("no-port", ["ping", "--coordinator", "127.0.0.1", *JOIN], None,
     r"coordinator='127.0.0.1' has no port; give HOST:PORT"),
    ("port-0", ["ping", "--coordinator", "127.0.0.1:0", *JOIN], None,
     r"port '0' is not a port number from 1 to 65535 \(port 0 would let the system pick"),
    ("port-70000", ["ping", "--coordinator", "127.0.0.1:70000", *JOIN], None,
     r"'127.0.0.1:70000': port '70000' is not a port number from 1 to 65535"),
    ("port-word", ["ping", "--coordinator", "127.0.0.1:http", *JOIN], None,
     r"port 'http' is not a port number"),
    ("empty-port", ["ping", "--coordinator", "host:", *JOIN], None,
     r"coordinator='host:': port '' is not a port number"),
    ("no-host", ["ping", "--coordinator", ":1234", *JOIN], None,
     r"coordinator=':1234' has no host"),
    ("ipv6-no-port", ["ping", "--coordinator", "[::1]", *JOIN], None,
     r"coordinator='\[::1\]' has no port"),
    ("ipv6-bare", ["ping", "--coordinator", "::1:1234", *JOIN], None,
     r"write an IPv6 address in brackets, \[::1\]:1234"),
    ("ipv6-unclosed", ["ping", "--coordinator", "[::1:1234", *JOIN], None,
     r"needs its closing '\]'"),
    ("train-no-port", ["train", "CONFIG", "--coordinator", "10.0.0.1", *JOIN], {"data": -1},
     r"coordinator='10.0.0.1' has no port"),
    ("hold-nan", ["ping", "--hold", "nan"], None, r"--hold: 'nan' must be finite seconds >= 0"),
    ("hold-inf", ["ping", "--hold", "inf"], None, r"--hold: 'inf' must be finite seconds >= 0"),
    ("hold-negative", ["ping", "--hold", "-1"], None, r"--hold: '-1' must be finite seconds"),
    ("timeout-0", ["ping", "--coordinator", "127.0.0.1:1234", *JOIN,
                   "--initialization-timeout", "0"], None,
     r"--initialization-timeout: 0 must be a positive integer"),
    ("mesh-smaller", ["launch", "CONFIG", "--run-dir", "RUN", "--processes", "2",
                      "--devices-per-process", "4", "--platform", "cpu"], {"data": 4},
     r"config.mesh \{'data': 4\} needs 4 devices, but the launch gives processes=2 x "
     r"devices_per_process=4 = 8"),
    ("mesh-larger", ["launch", "CONFIG", "--run-dir", "RUN", "--processes", "2",
                     "--devices-per-process", "1", "--platform", "cpu"], {"data": 4},
     r"needs 4 devices, but the launch gives processes=2 x devices_per_process=1 = 2"),
    ("mesh-minus-one", ["launch", "CONFIG", "--run-dir", "RUN", "--processes", "2",
                        "--devices-per-process", "4", "--platform", "cpu"],
     {"data": -1, "model": 3},
     r"needs a multiple of 3 devices .*processes=2 x devices_per_process=4 = 8"),
]


@pytest.mark.parametrize("argv,mesh,message", [r[1:] for r in REFUSED],
                         ids=[r[0] for r in REFUSED])
def test_bad_start_up_arguments_are_refused_before_anything_starts(tmp_path, argv, mesh,
                                                                   message):
    import re

    config = _config(tmp_path, mesh) if mesh is not None else ""
    run = tmp_path / "run"
    argv = [config if a == "CONFIG" else str(run) if a == "RUN" else a for a in argv]
    out = _cli(*argv, timeout=60)
    assert out.returncode == 2, out.stderr + out.stdout
    assert re.search(message, out.stderr), out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert not run.exists()  # nothing written, no worker started


MESHES = [
    # (mesh, processes, devices per process, message); the workers' make_mesh needs them equal
    ({"data": 4}, 2, 4, r"config.mesh \{'data': 4\} needs 4 devices, but the launch gives "
                        r"processes=2 x devices_per_process=4 = 8; launch processes x "
                        r"devices_per_process = 4 devices, or use a mesh of 8 devices"),
    ({"data": 2, "model": 2}, 4, 2, r"needs 4 devices, but .*processes=4 x "
                                    r"devices_per_process=2 = 8"),
    ({"data": -1, "model": 3}, 2, 4, r"needs a multiple of 3 devices \(the other axes' "
                                     r"product, one axis -1\).* = 8"),
]


@pytest.mark.parametrize("mesh,processes,devices,message", MESHES)
def test_every_cluster_kind_refuses_a_mesh_that_is_not_processes_times_devices(
        mesh, processes, devices, message):
    from workbench.jobs._protocol import check_mesh

    with pytest.raises(ValueError, match=message):
        check_mesh(mesh, processes, devices)


def test_meshes_that_fit_or_cannot_be_checked_are_accepted():
    from workbench.jobs._protocol import check_mesh

    check_mesh({"data": 8}, 2, 4)
    check_mesh({"data": -1, "model": 2}, 2, 4)
    check_mesh({}, 2, 4)              # a ping: no mesh
    check_mesh({"data": 4}, 2, None)  # devices unknown (a GPU cluster's own share)


# ---------------------------------------------------------------- a coordinator that never answers
def _silent_listener() -> tuple[socket.socket, int]:
    """A loopback socket that accepts TCP connections (the kernel's backlog) and never
    answers a byte."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s, s.getsockname()[1]


def _timed_stderr(argv: list[str], limit: float) -> tuple[int, list[tuple[float, str]]]:
    """Runs the CLI; returns its exit status and each stderr line with the seconds since
    the start at which it arrived (killed after ``limit`` seconds)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "workbench", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    killer = threading.Timer(limit, proc.kill)
    killer.start()
    try:
        assert proc.stderr is not None
        lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stderr]
        return proc.wait(), lines
    finally:
        killer.cancel()


WAITS = [
    # (id, address kind, process id, bound, what the messages name)
    ("closed-port", "closed", "1", 7,
     [r"process 1 of 2 waits for the coordinator \(process 0\) at 127.0.0.1:{port}",
      r"nothing answers at 127.0.0.1:{port}", r"Check that process 0 is running",
      r"firewall blocks port {port}"]),
    ("silent-listener", "silent", "1", 3,
     [r"waits for the coordinator \(process 0\) at 127.0.0.1:{port}",
      r"127.0.0.1:{port} accepts TCP connections", r"Check that process 0 is running"]),
    ("peers-never-come", "closed", "0", 3,
     [r"process 0 of 2 \(the coordinator, at 127.0.0.1:{port}\) waits for the other 1",
      r"every other process was started with the same --coordinator"]),
    ("ipv6-closed-port", "ipv6", "1", 3,
     [r"waits for the coordinator \(process 0\) at \[::1\]:{port}",
      r"Check that process 0 is running"]),
]


@pytest.mark.parametrize("kind,process_id,bound,names", [w[1:] for w in WAITS],
                         ids=[w[0] for w in WAITS])
def test_a_worker_says_what_it_waits_for_and_gives_up_at_its_bound(kind, process_id, bound,
                                                                   names):
    import re

    listener, port = _silent_listener() if kind == "silent" else (None, free_port())
    host = "[::1]" if kind == "ipv6" else "127.0.0.1"
    argv = ["ping", "--coordinator", f"{host}:{port}", "--num-processes", "2",
            "--process-id", process_id, "--platform", "cpu", "--devices-per-process", "1",
            "--initialization-timeout", str(bound)]
    try:
        code, lines = _timed_stderr(argv, limit=bound + 90)
    finally:
        if listener is not None:
            listener.close()
    text = "\n".join(line for _, line in lines)
    assert code == EXIT_JOIN_TIMEOUT, text
    assert "Check failure" not in text and "*** " not in text, text  # not JAX's C++ abort
    first = next(t for t, line in lines if "waits for" in line)
    assert f"giving up after {bound} s (initialization_timeout)" in text
    assert first < 30, lines  # said at once (the import of JAX is most of it)
    end = next(t for t, line in lines if "gave up joining the job" in line)
    assert bound - 0.5 <= end - first <= bound + 10, lines
    assert f"gave up joining the job after {bound} s (initialization_timeout={bound})" in text
    if bound > 5:  # repeated while it waits
        assert re.search(rf"still waiting \(\d+ s of {bound} s\)", text), text
    for name in names:
        assert re.search(name.format(port=port), text), (name, text)
