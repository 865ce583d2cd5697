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
