"""Tests for workbench/runs.py: the run directory written, resumed, read, listed and resolved."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench import _tail, _runs as runs


def _write(run_dir: Path, steps: range, **extra: float) -> None:
    with runs.RunWriter(run_dir, config={"model": "tiny", "lr": 3e-4}) as w:
        for s in steps:
            w.log({"step": s, "loss": 10.0 / s, **extra})


def test_roundtrip_and_run_json(tmp_path: Path) -> None:
    d = tmp_path / "r"
    with runs.RunWriter(d, config={"model": "tiny"}, name="demo",
                        meta={"mesh": {"data": 8}, "peak_flops": 1e12}) as w:
        w.event("compile", seconds=1.5)
        w.update(target_steps=3)
        for s in (1, 2, 3):
            w.log({"step": np.int64(s), "loss": np.float32(1.0 / s), "mfu": float("nan")})
    meta = runs.read_run(d)
    assert meta["name"] == "demo" and meta["status"] == "finished" and meta["step"] == 3
    assert meta["mesh"] == {"data": 8} and meta["target_steps"] == 3 and meta["error"] is None
    assert meta["config_hash"] == runs.config_hash({"model": "tiny"})
    assert meta["pid"] == os.getpid() and "jax" in meta["versions"]
    recs = runs.read_metrics(d)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["loss"] for r in recs] == pytest.approx([1.0, 0.5, 1 / 3])
    assert all(r["mfu"] is None for r in recs)  # NaN is not JSON: written as null
    assert runs.read_events(d)[0]["event"] == "compile"
    for line in (d / runs.METRICS).read_text().splitlines():
        json.loads(line)  # strict JSON, no NaN tokens
    assert runs.read_metrics(d, since=2)[0]["step"] == 3


def test_config_hash_ignores_key_order() -> None:
    assert runs.config_hash({"a": 1, "b": [1, 2]}) == runs.config_hash({"b": (1, 2), "a": 1})
    assert runs.config_hash({"a": 1}) != runs.config_hash({"a": 2})


def test_resume_keeps_id_and_drops_relogged_steps(tmp_path: Path) -> None:
    d = tmp_path / "r"
    _write(d, range(1, 11))  # steps 1..10 logged, checkpoint at step 6
    uid, created = runs.read_run(d)["id"], runs.read_run(d)["created"]
    with runs.RunWriter(d, config={"model": "tiny"}) as w:
        assert w.resumed and w.id == uid
        w.event("resume", step=6)
        for s in range(7, 16):
            w.log({"step": s, "loss": -1.0})
    recs = runs.read_metrics(d)
    assert [r["step"] for r in recs] == list(range(1, 16))  # continuous, no duplicates
    # steps 7..10 keep their first values; 11..15 come from the resumed run
    assert [r["loss"] for r in recs[6:10]] == pytest.approx([10 / s for s in range(7, 11)])
    assert all(r["loss"] == -1.0 for r in recs[10:])
    meta = runs.read_run(d)
    assert meta["id"] == uid and meta["created"] == created and meta["step"] == 15


def test_partial_line_waits_and_crash_cut_line_is_skipped(tmp_path: Path) -> None:
    d = tmp_path / "r"
    _write(d, range(1, 3))
    with open(d / runs.METRICS, "a") as f:
        f.write('{"step": 3, "loss": 0.')  # a writer mid-line (or killed mid-line)
    tail = runs.MetricsTail(d)
    assert [r["step"] for r in tail.poll()[0]] == [1, 2]
    assert tail.poll() == ([], [])
    with runs.RunWriter(d, config={}) as w:  # resume after the crash
        w.log({"step": 3, "loss": 0.25})
    new, _ = tail.poll()
    assert [(r["step"], r["loss"]) for r in new] == [(3, 0.25)]


def test_lines_longer_than_a_read_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_tail, "_CHUNK", 64)
    d = tmp_path / "r"
    with runs.RunWriter(d, config={}) as w:
        w.log({"step": 1, "note": "x" * 300})
        w.log({"step": 2, "loss": 1.0})
    with open(d / runs.METRICS, "a") as f:
        f.write('{"step": 3, "note": "' + "y" * 300)  # long and not finished yet
    tail = runs.MetricsTail(d)
    assert [r["step"] for r in tail.poll()[0]] == [1, 2]
    with open(d / runs.METRICS, "a") as f:
        f.write('"}\n{"step": 4}\n')
    assert [r["step"] for r in tail.poll()[0]] == [3, 4]
    assert [r["step"] for r in tail.read(1)] == [2, 3, 4]


def test_log_rejects_records_without_step(tmp_path: Path) -> None:
    w = runs.RunWriter(tmp_path / "r", config={})
    with pytest.raises(ValueError, match="integer 'step'"):
        w.log({"loss": 1.0})
    with pytest.raises(TypeError, match="integer 'step'"):
        w.log({"step": 1.5})
    with pytest.raises(ValueError, match="event"):
        w.log({"step": 1, "event": "x"})
    with pytest.raises(ValueError, match="status"):
        w.close("done")
    w.close("finished")
    with pytest.raises(RuntimeError, match="closed"):
        w.log({"step": 1})


@pytest.mark.parametrize(("exc", "status"), [(KeyboardInterrupt, "interrupted"),
                                             (FloatingPointError, "failed")])
def test_context_manager_records_how_the_run_ended(tmp_path: Path, exc: type, status: str) -> None:
    with pytest.raises(exc), runs.RunWriter(tmp_path / "r", config={}) as w:
        w.log({"step": 1, "loss": 1.0})
        raise exc("NaN loss at step 1")
    meta = runs.read_run(tmp_path / "r")
    assert meta["status"] == status
    assert (meta["error"] is None) == (status == "interrupted")


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.integers(0, 300), min_size=1, max_size=300),
       since=st.integers(-5, 320), limit=st.one_of(st.none(), st.integers(1, 50)))
def test_tail_read_matches_a_full_scan(tmp_path_factory: pytest.TempPathFactory,
                                       steps: list[int], since: int, limit: int | None) -> None:
    d = tmp_path_factory.mktemp("r")
    d.joinpath(runs.METRICS).write_text("".join(
        json.dumps({"step": s, "loss": i}) + "\n" for i, s in enumerate(steps)))
    expected, best = [], -math.inf  # reference: keep a step only above all steps before it
    for i, s in enumerate(steps):
        if s > best:
            best = s
            if s > since:
                expected.append(i)
    expected = expected[:limit] if limit else expected
    runs.MetricsTail.MARK_EVERY, _tail._CHUNK = 7, 100  # many marks and chunk edges
    try:
        tail = runs.MetricsTail(d)
        tail.poll()
        assert [r["loss"] for r in tail.read(since, limit)] == expected
    finally:
        runs.MetricsTail.MARK_EVERY, _tail._CHUNK = 512, 8 << 20
    assert [r["loss"] for r in runs.read_metrics(d, since)][: len(expected)] == expected


def test_columns() -> None:
    cols = runs.columns([{"step": 1, "loss": 2.0}, {"step": 2, "mfu": 0.5}])
    assert cols == {"step": [1, 2], "loss": [2.0, None], "mfu": [None, 0.5]}


def test_list_runs_depth_hidden_symlinks_and_roots(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a / "runs" / "one", range(1, 3))
    _write(a / "x" / "y" / "z" / "w" / "deep", range(1, 2))  # depth 5: beyond max_depth=4
    _write(a / ".hidden" / "r", range(1, 2))
    _write(a / "runs" / "one" / "nested", range(1, 2))  # inside a run: not searched
    _write(b / "two", range(1, 2))
    (a / "link").symlink_to(b, target_is_directory=True)  # symlinked dirs are not entered
    found = runs.list_runs([a, b])
    assert sorted(r["id"] for r in found) == ["1:two", "runs/one"]
    one = next(r for r in found if r["id"] == "runs/one")
    assert one["uid"] == runs.read_run(a / "runs" / "one")["id"] and one["step"] == 2
    assert runs.resolve_run([a, b], "1:two") == (b / "two").resolve()
    assert [p.name for p in runs.find_run_dirs(a, max_depth=5)] == ["one", "deep"]


@pytest.mark.parametrize("rid", ["../b/two", "runs/../../b/two", "/etc", "runs//one", "./runs/one",
                                 "runs\\one", "runs/one\x00", "", "5:two", "out", "inlink",
                                 "runs/metaout", "runs/nothing"])
def test_resolve_run_stays_inside_the_root(tmp_path: Path, rid: str) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a / "runs" / "one", range(1, 2))
    _write(b / "two", range(1, 2))
    (a / "out").symlink_to(b / "two", target_is_directory=True)  # symlink leaving the root
    (a / "runs" / "metaout").mkdir()
    (a / "runs" / "metaout" / "run.json").symlink_to(b / "two" / "run.json")
    (a / "runs" / "nothing").mkdir()
    (a / "inlink").symlink_to(a / "runs" / "one", target_is_directory=True)
    if rid == "inlink":  # a symlink that stays inside the root is allowed
        assert runs.resolve_run([a], rid) == (a / "runs" / "one").resolve()
        return
    with pytest.raises((ValueError, FileNotFoundError)):
        runs.resolve_run([a], rid)


def test_effective_status_of_a_dead_writer(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    w = runs.RunWriter(tmp_path / "r", config={})
    assert runs.effective_status(runs.read_run(tmp_path / "r")) == "running"
    w.update(pid=int(proc.stdout))  # that process has exited: its run was interrupted
    assert runs.effective_status(runs.read_run(tmp_path / "r")) == "interrupted"
    w.close()
    assert runs.effective_status(runs.read_run(tmp_path / "r")) == "finished"


def test_runs_imports_neither_jax_nor_numpy() -> None:
    code = "import sys, workbench._runs; print('jax' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_pid_alive_on_this_host() -> None:
    me = os.getpid()
    assert runs.pid_alive(me) and runs.pid_alive(me, runs.pid_start_time(me))
    assert not runs.pid_alive(me, "1")                  # our pid, another start: reused
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert not runs.pid_alive(done.pid)                 # exited and reaped
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        for _ in range(500):                            # exited, not yet reaped
            with open(f"/proc/{zombie.pid}/stat", encoding="ascii") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert not runs.pid_alive(zombie.pid)
    finally:
        zombie.wait()
    for bad in (0, -1, -me, 2**31, 2**64, True, None, "1"):  # os.kill(-1, 0) would succeed
        assert not runs.pid_alive(bad), bad


def test_one_pid_check_for_runs_and_job_locks(tmp_path: Path) -> None:
    from workbench import _run_lock as lock

    assert lock.pid_alive is runs.pid_alive
    w = runs.RunWriter(tmp_path / "r", config={})
    meta = runs.read_run(tmp_path / "r")
    assert meta["pid_start"] == runs.pid_start_time(os.getpid())
    assert runs.effective_status(meta) == "running"
    w.update(pid_start="1")              # run.json of a dead writer whose pid was reused
    assert runs.effective_status(runs.read_run(tmp_path / "r")) == "interrupted"
    w.close()
