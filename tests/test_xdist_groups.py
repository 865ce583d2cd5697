"""The suite's pytest-xdist groups reach the scheduler (``--dist loadgroup``): a test's id on
a worker carries its group (conftest.py: its module file, "browser", or a notebook alone).
Without it every test is scheduled alone, and each worker makes every module fixture and
starts its own JupyterLab (pytest 9.2 with pytest-xdist 3.8 did: pyproject.toml)."""
import os

import pytest


def test_this_test_is_scheduled_with_its_module(request):
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("runs under pytest-xdist --dist loadgroup (make test, make test-fast)")
    assert request.node.nodeid.endswith("@test_xdist_groups.py"), request.node.nodeid
