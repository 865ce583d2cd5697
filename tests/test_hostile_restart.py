"""A run whose checkpoints are gone never starts over in silence (issue 56, item 4).

Reference: one uninterrupted run of N steps. Each case copies one run directory trained to
step 4 (real Orbax checkpoints 2 and 4, its ``run.json`` and ``metrics.jsonl``), takes
away what the case says, and starts a new Trainer on it. While the directory records
trained steps that no checkpoint restores, the Trainer refuses (``CheckpointError`` naming
the run directory, the last recorded step, what is missing and the three ways on) and
nothing in the directory changes; ``restart="ok"`` starts it again as attempt 2, whose
losses are the reference's, whose ``metrics.jsonl`` lines carry ``"attempt": 2`` and hold
no step twice, and which ``run.json``'s ``history`` records. Where an earlier checkpoint
still restores the run, it resumes from there to the reference's losses. A run directory
written before attempts existed resumes as it did.
"""
import json
import os
import shutil

import pytest

import workbench as wb
from workbench import _runs as runs
from workbench._tail import attempt_of
from workbench.train._checkpoint import CORRUPT_DIR, CheckpointError

pytestmark = pytest.mark.usefixtures("wb_cache")

N = 6
CFG = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                     rules="fsdp", batch=8, seq=32, steps=N, checkpoint_every=2, keep=3,
                     data="synthetic", optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=2))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the reference losses of N uninterrupted steps, a run directory at step 4)."""
    root = tmp_path_factory.mktemp("restart")
    ref = wb.Trainer(CFG, run_dir=root / "reference", progress=None)
    ref.run()
    base = wb.Trainer(CFG, run_dir=root / "base", progress=None)
    base.run(steps=4)
    base.close()
    assert sorted(os.listdir(root / "base" / "checkpoints")) == ["2", "4"]
    return ref.losses, root / "base"


def _lines(run_dir):
    """metrics.jsonl's step lines, raw (every copy of a re-logged step)."""
    text = (run_dir / runs.METRICS).read_text().splitlines()
    return [r for r in map(json.loads, text) if "event" not in r]


def _snapshot(run_dir):
    """Every file under run_dir (path -> bytes), to see that a refusal changed nothing
    (but for an unfinished Orbax save, which Orbax itself clears when it opens the folder)."""
    out = {}
    for folder, _, files in os.walk(run_dir):
        if ".orbax-checkpoint-tmp" in folder:
            continue
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, run_dir)] = f.read()
    return out


def _no_step_twice(run_dir):
    """No attempt's lines in metrics.jsonl hold a step twice (the raw file)."""
    seen = {}
    for rec in _lines(run_dir):
        key = (rec.get("attempt", 1), rec["step"])
        assert key not in seen, f"step {key[1]} of attempt {key[0]} is in metrics.jsonl twice"
        seen[key] = rec


def _rm_checkpoints(d):
    shutil.rmtree(d / "checkpoints")


def _rm_every_step(d):
    for step in ("2", "4"):
        shutil.rmtree(d / "checkpoints" / step)


def _rm_run_json(d):
    _rm_checkpoints(d)
    (d / runs.RUN_JSON).unlink()


def _rm_metrics(d):
    _rm_checkpoints(d)
    (d / runs.METRICS).unlink()


def _checkpoints_file(d):
    _rm_checkpoints(d)
    (d / "checkpoints").write_text("not a folder\n")


def _first_save_killed(d):
    """What a SIGKILL during the first save leaves: steps 1-2 in metrics.jsonl, no
    committed checkpoint (Orbax's unfinished step folder, which it cleans up)."""
    lines = (d / runs.METRICS).read_text().splitlines(keepends=True)
    keep = [x for x in lines if json.loads(x).get("step", 0) <= 2]
    (d / runs.METRICS).write_text("".join(keep))
    meta = json.loads((d / runs.RUN_JSON).read_text())
    (d / runs.RUN_JSON).write_text(json.dumps({**meta, "step": 2, "status": "running"}))
    shutil.rmtree(d / "checkpoints" / "4")
    os.rename(d / "checkpoints" / "2", d / "checkpoints" / "2.orbax-checkpoint-tmp-1765083000")


def _all_moved_aside(d):
    (d / "checkpoints" / CORRUPT_DIR).mkdir()
    for step in ("2", "4"):
        os.rename(d / "checkpoints" / step, d / "checkpoints" / CORRUPT_DIR / step)


# case -> (what is taken away, the last recorded step, words naming what is missing)
REFUSED = {
    "checkpoint_folder_deleted": (_rm_checkpoints, 4, "does not exist"),
    "every_step_deleted": (_rm_every_step, 4, "is empty"),
    "run_json_missing": (_rm_run_json, 4, "does not exist"),
    "metrics_missing": (_rm_metrics, 4, "does not exist"),
    "checkpoints_is_a_file": (_checkpoints_file, 4, "is a file, not a folder"),
    "sigkill_during_first_save": (_first_save_killed, 2, "unfinished save 2.orbax"),
    "all_steps_moved_aside": (_all_moved_aside, 4, "moved aside"),
}


def _copy(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained[1], run_dir, symlinks=True)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_with_the_fixes_then_restart_ok_is_a_new_attempt(trained, tmp_path, case):
    reference = trained[0]
    damage, last, missing = REFUSED[case]
    run_dir = _copy(trained, tmp_path)
    damage(run_dir)
    before = _snapshot(run_dir)
    with pytest.raises(CheckpointError) as err:
        wb.Trainer(CFG, run_dir=run_dir, progress=None)
    msg = str(err.value)
    for words in (str(run_dir), f"last step {last}", missing, "fork=True", "new run_dir",
                  "restart='ok'", "Nothing was changed"):
        assert words in msg, (words, msg)
    assert _snapshot(run_dir) == before   # nothing changed, nothing deleted
    if case == "checkpoints_is_a_file":   # nothing can be saved there: refused even so
        with pytest.raises(CheckpointError, match="move it aside first"):
            wb.Trainer(CFG, run_dir=run_dir, progress=None, restart="ok")
        assert _snapshot(run_dir) == before
        os.rename(run_dir / "checkpoints", run_dir / "checkpoints.bad")
    tr = wb.Trainer(CFG, run_dir=run_dir, progress=None, restart="ok")
    assert tr.attempt == 2 and tr.step == 0
    tr.run()
    assert tr.losses == reference
    attempts = runs.read_attempts(run_dir)
    assert sorted(attempts) == ([2] if case == "metrics_missing" else [1, 2])
    assert [r["loss"] for r in attempts[2]] == reference
    assert all(r["attempt"] == 2 for r in attempts[2])
    assert [r["step"] for r in runs.read_metrics(run_dir)] == list(range(1, N + 1))
    _no_step_twice(run_dir)
    meta = runs.read_run(run_dir)
    assert meta["attempt"] == 2 and meta["step"] == N
    restart = [h for h in meta["history"] if h["event"] == "restart"]
    assert len(restart) == 1 and restart[0]["attempt"] == 2
    assert restart[0]["recorded_step"] == last
    ended = restart[0]["ended"]   # the lab panel draws attempt 1 from it
    assert ended["attempt"] == 1 and ended["step"] == [r["step"] for r in attempts.get(1, [])]
    assert ended["loss"] == [r["loss"] for r in attempts.get(1, [])]


@pytest.mark.slow
def test_fork_leaves_the_run_and_starts_a_new_directory(trained, tmp_path):
    reference = trained[0]
    run_dir = _copy(trained, tmp_path)
    _rm_checkpoints(run_dir)
    before = _snapshot(run_dir)
    tr = wb.Trainer(CFG, run_dir=run_dir, progress=None, fork=True)
    assert tr.run_dir == run_dir.with_name(f"run-fork-{CFG.hash()[:6]}")
    tr.run()
    assert tr.losses == reference
    assert _snapshot(run_dir) == before
    forks = [h for h in runs.read_run(tr.run_dir)["history"] if h["event"] == "fork"]
    assert forks and forks[0]["source"] == str(run_dir.absolute())


@pytest.mark.slow
def test_same_trainer_after_its_checkpoints_were_deleted(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    tr = wb.Trainer(CFG, run_dir=run_dir, progress=None)
    assert tr.step == 4
    _rm_checkpoints(run_dir)
    with pytest.raises(CheckpointError, match="last step 4"):
        tr.run()
    _no_step_twice(run_dir)


def _killed_before_first_save(d):
    """A run killed (SIGKILL, or Ctrl-C twice) at step 1, before its first save: step 1 in
    metrics.jsonl without a save, no checkpoint."""
    _first_save_killed(d)
    lines = (d / runs.METRICS).read_text().splitlines(keepends=True)
    (d / runs.METRICS).write_text("".join(x for x in lines if json.loads(x).get("step", 0) < 2))
    meta = json.loads((d / runs.RUN_JSON).read_text())
    (d / runs.RUN_JSON).write_text(json.dumps({**meta, "step": 1}))


# case -> (what is taken away, the step it resumes from, what the Trainer says)
RESUMED = {
    "resume_as_before": (lambda d: None, 4, "restored checkpoint step 4"),
    "latest_step_deleted": (lambda d: shutil.rmtree(d / "checkpoints" / "4"), 2,
                            "steps 3-4 are trained again"),
    "killed_before_first_save": (_killed_before_first_save, 0,
                                 "no checkpoint was saved yet: steps 1-1 are trained again"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(RESUMED))
def test_a_run_that_can_continue_resumes(trained, tmp_path, capsys, case):
    """A run directory of today's format resumes as it did (no attempt written); with its
    newest step deleted it resumes from the one before, and killed before its first save
    from step 0, saying which recorded steps are trained again; either way to the
    reference's losses, and readers hold each step once."""
    reference = trained[0]
    damage, start, said = RESUMED[case]
    run_dir = _copy(trained, tmp_path)
    damage(run_dir)
    tr = wb.Trainer(CFG, run_dir=run_dir, progress=None)
    assert said in capsys.readouterr().err
    assert tr.attempt == 1 and tr.step == start
    tr.run()
    assert tr.losses == reference
    assert [r["loss"] for r in runs.read_metrics(run_dir)] == reference
    assert "attempt" not in runs.read_run(run_dir)
    assert all("attempt" not in r for r in _lines(run_dir))


@pytest.mark.slow
def test_restarted_twice_counts_attempts(trained, tmp_path):
    reference = trained[0]
    run_dir = _copy(trained, tmp_path)
    _rm_checkpoints(run_dir)
    wb.Trainer(CFG, run_dir=run_dir, progress=None, restart="ok").run(steps=3)
    _rm_checkpoints(run_dir)
    with pytest.raises(CheckpointError, match="last step 3 of attempt 2"):
        wb.Trainer(CFG, run_dir=run_dir, progress=None)
    tr = wb.Trainer(CFG, run_dir=run_dir, progress=None, restart="ok")
    assert tr.attempt == 3
    tr.run()
    assert tr.losses == reference
    attempts = runs.read_attempts(run_dir)
    assert {k: len(v) for k, v in attempts.items()} == {1: 4, 2: 3, 3: N}
    _no_step_twice(run_dir)
    # the inline panel draws one curve per attempt: the earlier two beside the current one
    from workbench.widgets._train_panel import train_widget

    history = train_widget(tr).history
    assert history["attempt"] == 3 and history["loss"] == reference
    assert [(a["attempt"], len(a["loss"])) for a in history["attempts"]] == [(1, 4), (2, 3)]
    assert history["attempts"][1]["loss"] == reference[:3]


@pytest.mark.parametrize("value", ["yes", True, 1, "OK"])
def test_restart_takes_only_ok(tmp_path, value):
    with pytest.raises(ValueError, match="restart="):
        wb.Trainer(CFG, run_dir=tmp_path / "run", progress=None, restart=value)
    assert not (tmp_path / "run").exists()


def _write(run_dir, lines):
    run_dir.mkdir(exist_ok=True)
    with open(run_dir / runs.METRICS, "a") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)


def _steps(a, steps, **extra):
    return [{"step": s, "loss": 10 * a + s, **({"attempt": a} if a > 1 else {}), **extra}
            for s in steps]


# metrics.jsonl lines -> (what read_metrics gives: [(attempt, step)], read_attempts' steps)
READERS = {
    "one_attempt": (_steps(1, [1, 2, 3]), [(1, 1), (1, 2), (1, 3)], {1: [1, 2, 3]}),
    "resumed_relogs": (_steps(1, [1, 2, 3, 2, 3, 4]), [(1, 1), (1, 2), (1, 3), (1, 4)],
                       {1: [1, 2, 3, 4]}),
    "restarted": (_steps(1, [1, 2, 3, 4]) + [{"event": "restart", "attempt": 2, "step": 0}]
                  + _steps(2, [1, 2]), [(2, 1), (2, 2)], {1: [1, 2, 3, 4], 2: [1, 2]}),
    "restart_marker_only": (_steps(1, [1, 2]) + [{"event": "restart", "attempt": 2,
                                                   "step": 0}], [], {1: [1, 2], 2: []}),
    "older_attempt_after_newer": (_steps(1, [1]) + _steps(2, [1, 2]) + _steps(1, [3]),
                                  [(2, 1), (2, 2)], {1: [1], 2: [1, 2]}),
    "bad_attempt_reads_as_first": (_steps(1, [1]) + [{"step": 2, "attempt": "x"},
                                                     {"step": 3, "attempt": 0}],
                                   [(1, 1), (1, 2), (1, 3)], {1: [1, 2, 3]}),
}


@pytest.mark.parametrize("case", sorted(READERS))
def test_readers_follow_the_newest_attempt(tmp_path, case):
    lines, latest, every = READERS[case]
    _write(tmp_path / "run", lines)
    got = runs.read_metrics(tmp_path / "run")
    assert [(attempt_of(r), r["step"]) for r in got] == latest
    assert {k: [r["step"] for r in v] for k, v in runs.read_attempts(tmp_path / "run").items()} \
        == every
    # read line by line, as the server's tail does: the same records, a reset per new attempt
    tail = runs.MetricsTail(tmp_path / "run")
    (tmp_path / "inc").mkdir()
    seen = []
    for line in lines:
        _write(tmp_path / "inc", [line])
        tail.path = tmp_path / "inc" / runs.METRICS
        tail.run_dir = tmp_path / "inc"
        resets = tail.resets
        new, _ = tail.poll()
        seen = new if tail.resets != resets else seen + new
    assert [(attempt_of(r), r["step"]) for r in seen] == latest
    assert [(attempt_of(r), r["step"]) for r in tail.read(0)] == latest
    assert [r["step"] for r in tail.read(1)] == [s for _, s in latest if s > 1]
