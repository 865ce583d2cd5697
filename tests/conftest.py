"""Test set-up: 8 simulated CPU devices before JAX starts its backends."""
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Calibrations a user stored (wb.calibrate) must not change the tests' predictions.
os.environ["WORKBENCH_CALIBRATION"] = tempfile.mkdtemp(prefix="wb-calibration-")

import pytest  # noqa: E402 - after the environment above, before any test imports JAX


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """The session's one data and compile cache (``WORKBENCH_CACHE``)."""
    return tmp_path_factory.getbasetemp() / "wb-cache"


@pytest.fixture
def wb_cache(cache_dir, monkeypatch):
    """Points ``WORKBENCH_CACHE`` at the session's cache for one test (use it with
    ``pytestmark = pytest.mark.usefixtures("wb_cache")``)."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(cache_dir))
    return cache_dir
