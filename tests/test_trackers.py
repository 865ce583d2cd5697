"""Metrics to the trackers (issue 61 item 2): W&B offline and MLflow's local database store,
each read back with the library's own reader (``wandb leet inspect --json`` on the offline
run file; ``MlflowClient``) and equal to ``metrics.jsonl``; a missing library, a hand-edited
tracker id, a failing and a slow tracker (a resume after SIGKILL, and when the steps are
sent: tests/test_tracker_flush.py). No network: W&B runs offline, MLflow on a SQLite file,
the slow and failing MLflow servers are sockets of the test's own.
"""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

import workbench as wb
from workbench import _runs as runs
from workbench.train import _tracker_clients, _trackers

pytestmark = pytest.mark.usefixtures("wb_cache")
WANDB = Path(sys.executable).with_name("wandb")


def _docs():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = (x.strip() for x in (stdlib / "textwrap.py").read_text().splitlines())
    return list(dict.fromkeys(x for x in lines if len(x) > 20))[:60]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    """A tiny run with held-out data (eval loss every 2 steps) and both trackers."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("docs")
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(_docs(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(root / "tokenizer.json"))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()))
    data = wb.data.Dataset(files=str(root / "docs.jsonl"), tokenizer=root / "tokenizer.json",
                           eval_fraction=0.25)
    return wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1, "vocab_size": 384},
                          mesh={"data": 8}, batch=8, seq=32, steps=4, checkpoint_every=2,
                          data=data, eval_every=2, trackers=["wandb", "mlflow"])


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory):
    """An MLflow SQLite store with its tables made once (Alembic's migrations take seconds)."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def _offline(tmp_path, monkeypatch, mlflow_db):
    """W&B offline (its files in the run directory), MLflow on a copy of the store."""
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "MLFLOW_EXPERIMENT_NAME",
                 "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_db, db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    return os.environ["MLFLOW_TRACKING_URI"]


@pytest.fixture
def env(tmp_path, monkeypatch, mlflow_db):
    """The trackers offline for one test: the MLflow store's URI."""
    return _offline(tmp_path, monkeypatch, mlflow_db)


def _wandb_files(run_dir, run_id):
    """The offline run files of ``run_id``, oldest first, each read by wandb's own reader:
    ``(run record, {step: history item})`` (the run record None where the file holds none:
    a process killed with SIGKILL takes W&B's service down with what it had not written)."""
    out = []
    for path in sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        text = subprocess.run([str(WANDB), "leet", "inspect", "--json", str(path)], check=True,
                              capture_output=True, text=True, timeout=120).stdout
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        run = next((r["run"] for r in records if r["type"] == "run"), None)
        out.append((run, {r["history"]["step"]["num"]: r["history"]["item"]
                          for r in records if r["type"] == "history"}))
    return out


def _first_per_step(files):
    """Each step's first record over the run's files (what W&B keeps when they are synced)."""
    merged = {}
    for _, history in files:
        for step, item in history.items():
            merged.setdefault(step, item)
    return merged


def _assert_same_numbers(got, recs):
    """``got[tag][step]`` equals every number of the ``metrics.jsonl`` records."""
    for rec in recs:
        for key in _tracker_clients.KEYS:
            if isinstance(rec.get(key), float):
                assert got[_tracker_clients.tag(key)][rec["step"]] == rec[key], (key, rec["step"])


def _mlflow_numbers(uri, run_id):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out = {}
    for key in _tracker_clients.KEYS:
        history = client.get_metric_history(run_id, _tracker_clients.tag(key))
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), (key, steps)   # each step once
        out[_tracker_clients.tag(key)] = {m.step: m.value for m in history}
    return client.get_run(run_id), out


def _wandb_numbers(history):
    tags = {_tracker_clients.tag(k) for k in _tracker_clients.KEYS}
    return {t: {s: item[t] for s, item in history.items() if t in item} for t in tags}


@pytest.fixture(scope="module")
def trained(cfg, tmp_path_factory, mlflow_db):
    """One run of ``cfg`` with both trackers: (run dir, MLflow tracking URI)."""
    mp = pytest.MonkeyPatch()
    try:
        uri = _offline(tmp_path_factory.mktemp("env"), mp, mlflow_db)
        run_dir = tmp_path_factory.mktemp("trained") / "run"
        trainer = wb.Trainer(cfg, run_dir, progress=None)
        trainer.run()
        trainer.close()   # the tracker runs finish
    finally:
        mp.undo()
    return run_dir, uri


@pytest.mark.slow
def test_wandb_and_mlflow_read_back_equal_metrics_jsonl(trained, cfg):
    run_dir, uri = trained
    recs = runs.read_metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(isinstance(recs[i]["eval_loss"], float) for i in (1, 3))
    ids = runs.read_run(run_dir)["trackers"]
    # W&B: the offline run file, read by wandb itself
    [(run, history)] = _wandb_files(run_dir, ids["wandb"]["id"])
    assert run["run_id"] == ids["wandb"]["id"] and run["display_name"] == "run"
    assert sorted(history) == [1, 2, 3, 4]
    _assert_same_numbers(_wandb_numbers(history), recs)
    config = run["config"]["update"]
    assert {k: config[k] for k in cfg.to_dict()} == json.loads(cfg.to_json())
    meta = runs.read_run(run_dir)
    assert config["plan"]["mesh"] == {"data": 8} == meta["mesh"]
    assert config["plan"]["model_flops_per_step"] == meta["model_flops_per_step"]
    assert config["plan"]["peak_source"] == meta["peak_source"]
    # MLflow: the SQLite store, read by MlflowClient
    assert ids["mlflow"]["tracking_uri"] == uri
    mlrun, numbers = _mlflow_numbers(uri, ids["mlflow"]["run_id"])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    assert sorted(numbers["train/loss"]) == [1, 2, 3, 4] and sorted(numbers["eval/loss"]) == [2, 4]
    _assert_same_numbers(numbers, recs)
    params = mlrun.data.params
    assert params["batch"] == "8" and params["optimizer.lr"] == json.dumps(cfg.optimizer.lr)
    assert params["plan.mesh.data"] == "8" and params["trackers"] == '["wandb", "mlflow"]'


def _wait(proc, found, what, timeout=240):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            pytest.fail(f"child exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if found():
            return
        time.sleep(0.02)
    pytest.fail(f"no {what} within {timeout} s")


# ----------------------------------------------------------------------------- hostile
@pytest.mark.parametrize("value, error, match", [
    ("wandb", TypeError, "is a str; give a list"),
    (None, TypeError, "is a NoneType"),
    ({"wandb": 1}, TypeError, "is a dict"),
    ([1], TypeError, "holds 1, a int"),
    ([["wandb"]], TypeError, "holds \\['wandb'\\], a list"),
    (["neptune"], ValueError, "unknown tracker 'neptune'; choose from 'tensorboard'"),
    (["WandB"], ValueError, "unknown tracker 'WandB'"),
    (["wandb", "mlflow", "wandb"], ValueError, "names 'wandb' more than once"),
])
def test_bad_tracker_lists_are_refused_by_name(value, error, match):
    with pytest.raises(error, match=match) as info:
        wb.TrainConfig(trackers=value)
    assert "TrainConfig.trackers" in str(info.value)


def test_trackers_round_trip_and_leave_other_configs_hash_alone():
    cfg = wb.TrainConfig(trackers=("mlflow", "tensorboard"))
    assert cfg.trackers == ("mlflow", "tensorboard")
    assert wb.TrainConfig.from_json(cfg.to_json()) == cfg
    assert "trackers" not in wb.TrainConfig().to_dict()            # stored configs keep hashes
    assert cfg.hash(exclude=wb.train.RUN_CONTROL_FIELDS) == \
        wb.TrainConfig().hash(exclude=wb.train.RUN_CONTROL_FIELDS)  # may change on resume


@pytest.mark.parametrize("module, name, pip", [("wandb", "wandb", "pip install wandb"),
                                               ("mlflow", "mlflow", "pip install mlflow-skinny")])
def test_a_missing_library_is_refused_before_anything_is_written(monkeypatch, tmp_path,
                                                                 module, name, pip):
    monkeypatch.setitem(sys.modules, module, None)   # what `import` sees for an absent package
    cfg = wb.TrainConfig(model="tiny", data="synthetic", trackers=[name])
    with pytest.raises(ImportError, match=f"names '{name}', which needs the {module} package: "
                                          f"{pip}"):
        wb.Trainer(cfg, tmp_path / "run", progress=None)
    assert not (tmp_path / "run").exists()


def _tree(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _tracked_run(run_dir, cfg):
    """A run directory as a Trainer leaves it for ``cfg`` (run.json with tracker runs,
    metrics.jsonl, a checkpoint file), written directly: what the Trainer must not lose."""
    with runs.RunWriter(run_dir, config=cfg.to_dict()) as writer:
        writer.log({"step": 1, "loss": 5.0})
        writer.update(trackers={"wandb": {"id": "abc123xy", "project": "p", "entity": None},
                                "mlflow": {"run_id": "8fc1b5bdb2e4441a81628840b22027a5",
                                           "tracking_uri": "sqlite:///x.db",
                                           "experiment_id": "0"}})
    (run_dir / "checkpoints" / "1").mkdir(parents=True)
    (run_dir / "checkpoints" / "1" / "state").write_bytes(b"saved")
    return runs.read_run(run_dir)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t["wandb"].update(id="a/b"), "trackers.wandb.id='a/b' is not a wandb run id"),
    (lambda t: t["wandb"].update(id=""), "trackers.wandb.id='' is not a wandb run id"),
    (lambda t: t["mlflow"].update(run_id="../x"), "trackers.mlflow.run_id='../x' is not a"),
    (lambda t: t["mlflow"].update(run_id=12), "trackers.mlflow.run_id=12 must be a string"),
    (lambda t: t["mlflow"].update(tracking_uri=["x"]), "tracking_uri=\\['x'\\] must be a"),
    (lambda t: t.update(wandb="abc"), "trackers.wandb is 'abc', not an object"),
])
def test_a_hand_edited_tracker_id_is_refused_and_nothing_is_lost(cfg, tmp_path, edit, match):
    run_dir = tmp_path / "run"
    meta = _tracked_run(run_dir, cfg)
    edit(meta["trackers"])
    (run_dir / runs.RUN_JSON).write_text(json.dumps(meta))
    before = _tree(run_dir)
    with pytest.raises(runs.RunFileError, match=match) as info:
        wb.Trainer(cfg, run_dir, progress=None)
    assert "delete run.json's 'trackers' entry" in str(info.value)
    assert _tree(run_dir) == before                                # nothing written or lost


def test_a_whole_trackers_field_of_the_wrong_type_is_refused(cfg, tmp_path):
    run_dir = tmp_path / "run"
    meta = _tracked_run(run_dir, cfg)
    meta["trackers"] = ["wandb"]
    (run_dir / runs.RUN_JSON).write_text(json.dumps(meta))
    with pytest.raises(runs.RunFileError, match="'trackers' is \\['wandb'\\], not an object"):
        wb.Trainer(cfg, run_dir, progress=None)


def _tiny(**kw):
    return wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                          batch=8, seq=32, steps=3, checkpoint_every=3, data="synthetic", **kw)


@pytest.mark.slow
def test_a_failing_tracker_is_a_warning_and_training_goes_on(env, monkeypatch, tmp_path):
    with socket.socket() as s:   # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.warns(UserWarning, match="tracker 'mlflow' could not start its run .*training "
                                         "goes on, and every step is in metrics.jsonl"):
        trainer = wb.Trainer(_tiny(trackers=["mlflow", "wandb"]), tmp_path / "run",
                             progress=None)
        result = trainer.run()
        trainer.close()   # the warning comes from the trackers' thread
    assert result.status == "finished"
    assert [r["step"] for r in runs.read_metrics(tmp_path / "run")] == [1, 2, 3]
    ids = runs.read_run(tmp_path / "run")["trackers"]
    assert set(ids) == {"wandb"}                                   # the other one worked
    [(_, history)] = _wandb_files(tmp_path / "run", ids["wandb"]["id"])
    assert sorted(history) == [1, 2, 3]


@pytest.mark.slow
def test_a_slow_tracker_never_holds_the_run(env, monkeypatch, tmp_path):
    server = socket.socket()   # accepts connections (the backlog) and never answers
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "6")
    monkeypatch.setattr(_trackers, "FINISH_SECONDS", 0.5)
    trainer = wb.Trainer(_tiny(trackers=["mlflow"]), tmp_path / "run", progress=None)
    try:
        with pytest.warns(UserWarning, match="tracker 'mlflow' is still starting its run 0.5 s "
                                             "after the run\\(\\) call ended"):
            t0 = time.monotonic()
            result = trainer.run()        # waits for a start, at most FINISH_SECONDS
            took = time.monotonic() - t0
        with pytest.warns(UserWarning, match="tracker 'mlflow' is still sending 0.5 s after the "
                                             "run was closed; every step is in metrics.jsonl"):
            trainer.close()
        stuck = [t for t in threading.enumerate() if t.name == "workbench-trackers"]
        assert stuck and stuck[0].is_alive()        # still waiting for the server's answer
        assert result.status == "finished" and took < 20
        assert [r["step"] for r in runs.read_metrics(tmp_path / "run")] == [1, 2, 3]
        assert runs.read_run(tmp_path / "run")["status"] == "finished"
        with pytest.warns(UserWarning, match="tracker 'mlflow' could not start its run"):
            stuck[0].join(60)                       # the client's timeout ends it
        assert not stuck[0].is_alive()
    finally:
        server.close()


def test_a_recorded_tracker_run_is_read_back_as_written(cfg, tmp_path):
    meta = _tracked_run(tmp_path / "run", cfg)
    assert _trackers.stored_records(tmp_path / "run", ["wandb", "mlflow"]) == meta["trackers"]
    assert _trackers.stored_records(tmp_path / "run", ["tensorboard"]) == {}


def test_launched_workers_do_not_share_the_launchers_wandb_service(monkeypatch):
    """A worker inherits no W&B service of the notebook that launched it (one killed inside
    that service leaves its run "in use", and the resumed worker cannot take it back)."""
    from workbench.jobs._local import _child_env

    monkeypatch.setenv("WANDB_SERVICE", "2-1234-tcp-localhost-5678")
    env = _child_env("cpu", 4, "token")
    assert "WANDB_SERVICE" not in env and env["JAX_PLATFORMS"] == "cpu"
