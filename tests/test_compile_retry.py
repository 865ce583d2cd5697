"""A TPU compiler failure that a known option avoids is compiled again with it
(``flags.RETRY_FLAGS``, ``measure.compile_step``), and the plan says so: its source, a
lint, its compiler options; the cache key holds the option.

The real TPU compiler, a real failure and a real option that avoids it: a step compiled
with ``xla_tpu_enable_slack_in_trough="bad"`` fails in libtpu ("flag must either be ''
or 'premsa'") and compiles with ``""``. That error is the user's, so ``RETRY_FLAGS``
does not know it: the test teaches it, as the table teaches the alternate-memory
failure of large dropless MoE steps.
"""
import pytest

import workbench as wb
from workbench.models import GPTConfig
from workbench.planning import _flags as flags
from workbench.planning._flags import compile_options, retry_options
from workbench._sharding.topology import tpu_compiler_available

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(not tpu_compiler_available(),
                       reason="the TPU compiler (libtpu) is not installed"),
]

TINY = GPTConfig.preset("tiny")
FLAG = "xla_tpu_enable_slack_in_trough"
BAD = {**compile_options("tpu", device="v5p-8"), FLAG: "bad"}
FIXED = {**compile_options("tpu", device="v5p-8"), FLAG: ""}


def _plan(overlap):
    return wb.plan(TINY, mesh=wb.abstract_mesh("v5p-8", data=4), rules="fsdp", batch=8,
                   seq=32, overlap=overlap, progress=False)


def test_the_alternate_memory_failure_is_known():
    msg = ("FAILED_PRECONDITION: The value defined at %fusion.12 requires allocation in "
           "the alternate memory, which could not be satisfied. This typically happens "
           "because more pinned buffers are live than the alternate memory capacity.")
    frag, opts = retry_options(msg)
    assert frag in msg and opts and all(k.startswith("xla_") for k in opts)
    assert retry_options("RESOURCE_EXHAUSTED: Ran out of memory") is None


def test_a_failure_an_option_avoids_is_retried_with_it_and_said(monkeypatch):
    # unknown to the table: the user's error is raised, nothing is guessed
    with pytest.raises(Exception, match="must either be"):
        _plan(BAD)
    monkeypatch.setitem(flags.RETRY_FLAGS, "flag must either be '' or 'premsa'", {FLAG: ""})
    p = _plan(BAD)
    assert p.source == "tpu-compiler" and p.compiled is not None
    said = f"compiled with {FLAG}= after the tpu compiler failed without: INVALID_ARGUMENT"
    assert said in p.report.source_reason
    lint = [w for w in p.warnings if w.kind == "compile_retry"]
    assert len(lint) == 1 and lint[0].severity == "info" and said in lint[0].message
    assert p.report.compiler_options == FIXED     # what the executable was compiled with
    # the cache key holds the option: a plan asking for the fixed options directly finds
    # the retried executable (same program, same options), and the numbers are its own
    direct = _plan(FIXED)
    assert direct.report.compile_cached and direct.compiled is p.compiled
    assert direct.memory == p.memory
    assert not [w for w in direct.warnings if w.kind == "compile_retry"]
    # the failing options stay a failure in the cache: the same plan again retries again
    again = _plan(BAD)
    assert again.compiled is p.compiled and said in again.report.source_reason


def test_a_retry_that_fails_too_says_both(monkeypatch):
    monkeypatch.setitem(flags.RETRY_FLAGS, "flag must either be '' or 'premsa'",
                        {FLAG: "still-bad"})
    # an INVALID_ARGUMENT is the user's: raised, after the retry failed as well
    with pytest.raises(Exception, match="must either be"):
        _plan(BAD)
