"""The suite's pytest-xdist groups reach the scheduler (``--dist loadgroup``): a test's id on
a worker carries its group (conftest.py: its module file, "browser", or a notebook alone).
Without it every test is scheduled alone, and each worker makes every module fixture and
starts its own JupyterLab (pytest 9.2 with pytest-xdist 3.8 did: pyproject.toml)."""
import os
import subprocess
import sys

import pytest


def test_this_test_is_scheduled_with_its_module(request):
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("runs under pytest-xdist --dist loadgroup (make test, make test-fast)")
    assert request.node.nodeid.endswith("@test_xdist_groups.py"), request.node.nodeid


def test_each_worker_and_what_it_starts_runs_on_its_own_cores():
    """conftest's ``_pin_worker``: worker i of n runs on the i-th of every n cores of the
    session (its controller's), and so does every process it starts."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        pytest.skip("runs under pytest-xdist (make test, make test-fast)")
    n, i = int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), int(worker.lstrip("gw"))
    session = sorted(os.sched_getaffinity(os.getppid()))   # the controller, never pinned
    if len(session) < n:
        pytest.skip(f"{len(session)} cores for {n} workers: nothing to pin")
    mine = sorted(os.sched_getaffinity(0))
    assert mine == session[i::n], (worker, mine, session)
    probe = "import os; print(sorted(os.sched_getaffinity(0)))"
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           check=True).stdout
    assert child.strip() == str(mine)


def test_host_speed_samples_every_core_in_cpu_time_and_leaves_the_process_as_it_was():
    """tests/_host_speed.py (the session summary's "host speed" lines): a sample on each
    core of this process (a thread of ours spinning beside it), each the CPU time of the
    same loop, the sampler's affinity changes its own thread's and not the process's, and
    stop() ends the thread."""
    import threading
    import time

    from _host_speed import HostSpeed

    cores = sorted(os.sched_getaffinity(0))
    stop = threading.Event()

    def spin():   # beside the sampler, on whichever core the scheduler gives it
        while not stop.is_set():
            sum(range(10_000))

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    speed = HostSpeed(every=0.05).start()
    deadline = time.monotonic() + 60
    while len({c for _, c, _ in speed.samples}) < len(cores) or len(speed.samples) < 2 * len(cores):
        assert time.monotonic() < deadline, speed.samples
        time.sleep(0.05)
    speed.stop()
    stop.set()
    speed._thread.join(10)
    assert not speed._thread.is_alive()
    assert {c for _, c, _ in speed.samples} == set(cores)
    ms = [s * 1e3 for _, _, s in speed.samples]
    assert all(0 < x < 5000 for x in ms), ms
    assert sorted(os.sched_getaffinity(0)) == cores   # the process's affinity is untouched
    text = speed.summary()
    assert all(f"core {c}: median" in text for c in cores) and "its fastest tenth" in text, text
