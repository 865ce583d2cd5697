"""What the API fuzzer found (tests/test_api_fuzz.py, issue 56 item 10), one row each: a
hostile edit of the files an earlier call wrote, then the next call raises a Workbench
error naming the file, within seconds, and the run's saved files stay as they were; a
hostile argument, then an error naming it."""
import os
import re
import threading

import pytest

import workbench as wb
from workbench import runs
from workbench._hf_format.families import ModelFolderNotFound


def _directory(path):
    path.unlink()
    path.mkdir()


def _fifo(path):
    path.unlink()
    os.mkfifo(path)


def _written(tmp_path):
    run = tmp_path / "run"
    with runs.RunWriter(run, config={"a": 1}) as w:
        for step in (1, 2, 3):
            w.log({"step": step, "loss": 3.0 - step / 2})
    return run


def _resume(run):
    with runs.RunWriter(run, config={"a": 1}) as w:
        w.log({"step": 4, "loss": 1.0})


# (the file edited, the edit, the call after it, what its error says)
CASES = {
    # a raw IsADirectoryError from open(..., "a")
    "RunWriter resumes a run whose metrics.jsonl is a directory": (
        "metrics.jsonl", _directory, _resume, "is a directory, not a file"),
    # open(..., "a") of a FIFO waits for a reader forever
    "RunWriter resumes a run whose metrics.jsonl is a FIFO": (
        "metrics.jsonl", _fifo, _resume, "is a named pipe, not a file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fuzz_find(case, tmp_path):
    name, edit, call, says = CASES[case]
    run = _written(tmp_path)
    edit(run / name)
    kept = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != name}
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(_error(call, run)), daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():   # let the stuck open return, so the thread ends
        with open(run / name, "rb", buffering=0):
            thread.join(5)
        pytest.fail(f"{case}: no answer after 10 s")
    error = outcome[0]
    assert isinstance(error, runs.RunFileError), repr(error)
    assert name in str(error) and says in str(error) and "move it aside" in str(error)
    assert {p: (run / p).read_bytes() for p in kept} == kept


def _error(call, run):
    try:
        call(run)
    except Exception as e:  # noqa: BLE001 - compared above
        return e
    return None


# (the call, what its error must say): an error names the argument the fuzzer gave
CALLS = {
    "wb.show of an empty dict (obj={})": (lambda: wb.show({}), "wb.show(obj)"),
    # a raw TypeError / ValueError of dict(config) that named nothing
    "wb.any_model.from_nnx with config=nan": (
        lambda: wb.any_model.from_nnx(_factory, config=float("nan")), "config=nan"),
    "wb.any_model.from_nnx with config a string": (
        lambda: wb.any_model.from_nnx(_factory, config="a\nb"), "config='a\\nb'"),
}


def _factory(rngs):
    return None


_TINY = wb.models.GPTConfig.preset("tiny")
# (the call, the error class, what its message must say): found by the fuzzer's final run
NAMED = {
    "wb.search(hardware=False)": (
        lambda: wb.search(_TINY, hardware=False, batch=8, progress=False), TypeError,
        "wb.search(hardware=False)"),
    "wb.search(mesh_shapes=-inf)": (
        lambda: wb.search(_TINY, hardware="v5e-8", batch=8, mesh_shapes=float("-inf"),
                          exact=False, progress=False), TypeError, "mesh_shapes=-inf"),
    "wb.search(mesh_shapes=False)": (
        lambda: wb.search(_TINY, hardware="v5e-8", batch=8, mesh_shapes=False, exact=False,
                          progress=False), TypeError, "mesh_shapes=False"),
    "wb.search(remat=[a custom policy])": (
        lambda: wb.search(_TINY, hardware="v5e-8", batch=8, remat=[{"save": ["key_proj"]}],
                          exact=False, progress=False), TypeError, "plan a custom policy"),
    # builtin FileNotFoundErrors that did not name the argument
    "wb.runs.resolve_run(rid='0')": (
        lambda: runs.resolve_run({"k": "/nonexistent-root"}, "0"), runs.RunNotFound, "rid='0'"),
    "wb.runs.read_run(run_dir=missing)": (
        lambda: runs.read_run("/nonexistent/run"), runs.RunNotFound, "run_dir="),
    "wb.hf.from_hf(path='bogus')": (
        lambda: wb.hf.from_hf("/nonexistent/bogus"), ModelFolderNotFound,
        "path='/nonexistent/bogus' does not exist"),
}


@pytest.mark.parametrize("case", list(NAMED))
def test_fuzz_find_raises_a_workbench_error_naming_the_argument(case):
    call, error, says = NAMED[case]
    with pytest.raises(error, match=re.escape(says)):
        call()


@pytest.mark.parametrize("case", list(CALLS))
def test_fuzz_find_names_the_argument(case):
    call, says = CALLS[case]
    with pytest.raises((ValueError, TypeError), match=re.escape(says)):
        call()
