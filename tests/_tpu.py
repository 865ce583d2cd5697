"""The mark of a test that compiles for an abstract TPU slice with libtpu."""
from __future__ import annotations

import pytest

from workbench._sharding.topology import tpu_compiler_available


def tpu(test):
    """A test that compiles for an abstract TPU slice (its plans are in tests/tpu_plans):
    the session's plan cache, the ``tpu`` marker, and a skip where libtpu is not installed."""
    for mark in (pytest.mark.usefixtures("wb_cache"), pytest.mark.tpu,
                 pytest.mark.skipif(not tpu_compiler_available(),
                                    reason="the TPU compiler (libtpu) is not installed")):
        test = mark(test)
    return test
