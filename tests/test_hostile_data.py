"""A run knows what it was trained on: hostile changes to its data, one row each.

One real run (tiny preset, a BPE tokenizer trained here, a JSONL file, 2 steps, an Orbax
checkpoint) is the reference. Each row puts that world back byte for byte (mtimes too),
changes one thing (the documents, an edit that keeps size and mtime, the tokenizer saved
again at its path) and resumes with the same config: the resume must be refused naming
what changed, with run.json, metrics.jsonl and every checkpoint file unchanged; or, with
``data_changed="ok"`` / ``fork=True``, continue and record the choice in run.json's
history. Then the token cache keyed by content, paths recorded absolute (a run started from
a relative ``init=`` exports and resumes from another directory after the folder moved),
and the smaller data errors.
"""
import hashlib
import json
import os
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import workbench as wb
from workbench import _runs as runs
from workbench.data import DataError, Dataset, Tokenizer, build_token_cache
from workbench.train._setup import DataChanged

pytestmark = pytest.mark.usefixtures("wb_cache")

PARTS = ("data", "tok", "run")


def _docs():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = (x.strip() for x in (stdlib / "textwrap.py").read_text().splitlines())
    return list(dict.fromkeys(x for x in lines if len(x) > 20))[:48]


def _tokenizer(docs, path, vocab):
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path))


def _again(cfg):
    """The same config as a restarted kernel makes it (the tokenizer read from disk)."""
    return wb.TrainConfig.from_json(cfg.to_json())


def _jsonl(docs):
    return "".join(json.dumps({"text": d}) + "\n" for d in docs)


def _sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _listing(folder):
    """Every file under ``folder``: relative path -> SHA-256 of its bytes."""
    return {str(p.relative_to(folder)): _sha(p) for p in sorted(Path(folder).rglob("*"))
            if p.is_file()}


class World:
    """The reference run and its inputs, put back byte for byte before each row."""

    def __init__(self, root, cfg, docs):
        self.root, self.cfg, self.docs = root, cfg, docs
        self.docs_file = root / "data" / "docs.jsonl"
        self.tok_file = root / "tok" / "tokenizer.json"
        self.run = root / "run"
        self.pristine = root / ".pristine"
        for name in PARTS:
            shutil.copytree(root / name, self.pristine / name, copy_function=shutil.copy2)
        self.run_json = (self.run / runs.RUN_JSON).read_bytes()
        self.files = _listing(self.run)

    def reset(self):
        for fork in self.root.glob("run-fork-*"):
            shutil.rmtree(fork)
        for name in PARTS:
            shutil.rmtree(self.root / name)
            shutil.copytree(self.pristine / name, self.root / name, copy_function=shutil.copy2)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-data")
    docs = _docs()
    (root / "data").mkdir()
    (root / "tok").mkdir()
    _tokenizer(docs, root / "tok" / "tokenizer.json", 300)
    (root / "data" / "docs.jsonl").write_text(_jsonl(docs))
    data = Dataset(files=str(root / "data" / "docs.jsonl"),
                   tokenizer=root / "tok" / "tokenizer.json")
    cfg = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1, "vocab_size": 384},
                         mesh={"data": 8}, batch=8, seq=32, steps=2, checkpoint_every=2,
                         data=data, optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=1))
    trainer = wb.Trainer(cfg, root / "run", progress=None)
    trainer.run()
    trainer.close()
    return World(root, cfg, docs)


# -- what each row changes, and the lines the refusal must give ---------------------------

def _replace_documents(w):
    before = _sha(w.docs_file)
    w.docs_file.write_text(_jsonl(list(reversed(w.docs))[:40]))
    return [f"file {w.docs_file}: content changed (sha256 {before[:12]} -> "
            f"{_sha(w.docs_file)[:12]})"]


def _same_size_and_mtime(w):
    """One character of one document, the size and the mtime as they were."""
    st = w.docs_file.stat()
    before = _sha(w.docs_file)
    raw = w.docs_file.read_bytes()
    i = raw.index(b"e", raw.index(b'"text": "') + 9)   # a letter inside the first document
    w.docs_file.write_bytes(raw[:i] + b"a" + raw[i + 1:])
    os.utime(w.docs_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.docs_file.stat().st_size == st.st_size
    assert w.docs_file.stat().st_mtime_ns == st.st_mtime_ns
    return [f"file {w.docs_file}: content changed (sha256 {before[:12]} -> "
            f"{_sha(w.docs_file)[:12]})"]


def _tokenizer_saved_again(w):
    before = _sha(w.tok_file)
    _tokenizer(w.docs, w.tok_file, 280)
    return [f"tokenizer {w.tok_file}: the file changed (sha256 {before[:12]} -> "
            f"{_sha(w.tok_file)[:12]})", "vocab_size: 300 -> 280"]


CHANGES = {"replaced documents": _replace_documents,
           "an edit that keeps size and mtime": _same_size_and_mtime,
           "another tokenizer at the same path": _tokenizer_saved_again}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_resume_on_changed_data_is_refused_and_nothing_changes(world, case):
    world.reset()
    lines = CHANGES[case](world)
    cfg = _again(world.cfg)
    with pytest.raises(DataChanged) as err:
        wb.Trainer(cfg, world.run, progress=None)
    msg = str(err.value)
    assert msg.splitlines()[1:1 + len(lines)] == [f"  {line}" for line in lines]
    assert msg.startswith(f"run_dir {str(world.run)!r} was trained on other data")
    assert "Trainer(..., fork=True)" in msg and "data_changed='ok'" in msg
    assert (world.run / runs.RUN_JSON).read_bytes() == world.run_json
    assert _listing(world.run) == world.files        # checkpoints, metrics: as they were


def test_data_changed_ok_continues_and_is_recorded_in_the_history(world):
    world.reset()
    lines = _replace_documents(world)
    cfg = _again(world.cfg)
    trainer = wb.Trainer(cfg, world.run, progress=None, data_changed="ok")
    assert trainer.step == 2                          # restored, not restarted
    trainer.run(steps=3)
    trainer.close()
    run = json.loads((world.run / runs.RUN_JSON).read_text())
    (event,) = run["history"]
    assert (event["event"], event["step"], event["changes"], event["accepted"]) == (
        "data_changed", 2, lines, "data_changed='ok'")
    assert event["before"]["sha256"] == json.loads(world.run_json)["data"]["sha256"]
    assert event["after"]["sha256"] == run["data"]["sha256"] != event["before"]["sha256"]
    assert [r["step"] for r in runs.read_metrics(world.run)] == [1, 2, 3]
    # the next resume on the same (new) data is not asked again; the history stays
    again = wb.Trainer(cfg, world.run, progress=None)
    again.run(steps=4)
    again.close()
    assert json.loads((world.run / runs.RUN_JSON).read_text())["history"] == [event]


def test_fork_starts_a_new_run_on_the_new_data_and_leaves_the_old_one(world):
    world.reset()
    lines = _replace_documents(world)
    trainer = wb.Trainer(_again(world.cfg), world.run, progress=None, fork=True)
    assert trainer.run_dir.name.startswith("run-fork-") and trainer.step == 2
    trainer.run(steps=3)
    trainer.close()
    assert (world.run / runs.RUN_JSON).read_bytes() == world.run_json
    assert _listing(world.run) == world.files
    run = json.loads((trainer.run_dir / runs.RUN_JSON).read_text())
    (event,) = run["history"]
    assert (event["event"], event["source"], event["data"]["changes"]) == (
        "fork", str(world.run), lines)


def test_unchanged_data_resumes_without_a_history(world):
    world.reset()
    trainer = wb.Trainer(_again(world.cfg), world.run, progress=None)
    assert trainer.step == 2
    trainer.run(steps=3)
    trainer.close()
    assert "history" not in json.loads((world.run / runs.RUN_JSON).read_text())


@pytest.mark.parametrize("value", ["yes", True, 1, "OK"])
def test_data_changed_takes_only_ok(world, value, tmp_path):
    with pytest.raises(ValueError, match=rf"data_changed={value!r}; pass data_changed='ok'"):
        wb.Trainer(world.cfg, tmp_path / "run", progress=None, data_changed=value)
    assert not (tmp_path / "run").exists()


# -- the token cache is keyed by content ------------------------------------------------

def test_the_token_cache_sees_an_edit_that_keeps_size_and_mtime(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(_jsonl(["abcdef", "ghijkl"]))
    tok = Tokenizer()
    a = build_token_cache([str(f)], tokenizer=tok, cache_dir=tmp_path / "cache")
    st = f.stat()
    f.write_text(_jsonl(["abcdef", "ghijkX"]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    b = build_token_cache([str(f)], tokenizer=tok, cache_dir=tmp_path / "cache")
    assert b.folder != a.folder and b.info["file_sha256"] == {str(f): _sha(f)}
    from array_record.python.array_record_module import ArrayRecordReader

    r = ArrayRecordReader(str(b.path))
    records = r.read(list(range(r.num_records())))
    stream = np.concatenate([np.frombuffer(x, np.int32) for x in records])
    r.close()
    assert bytes(stream.astype(np.uint8)).decode() == "abcdefghijkX"


def test_the_text_corpus_sees_an_edit_that_keeps_size_and_mtime(tmp_path, monkeypatch):
    from workbench.data._corpus import build_text_corpus, corpus_bytes

    (tmp_path / "texts").mkdir()
    f = tmp_path / "texts" / "a.py"
    f.write_text("x = 1\n" * 40)
    monkeypatch.chdir(tmp_path)
    spec = wb.data.TextData(root="texts")
    assert spec.root == str(tmp_path / "texts")                  # recorded absolute
    a, _ = build_text_corpus(spec, seq=16, cache_dir=tmp_path / "cache")
    st = f.stat()
    f.write_text("y = 2\n" * 40)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    b, info = build_text_corpus(spec, seq=16, cache_dir=tmp_path / "cache")
    assert b != a and info["sha256"] == hashlib.sha256(corpus_bytes(spec)).hexdigest()


# -- every recorded path is absolute; export and resume need only the checkpoint ---------

def test_a_run_from_a_relative_init_exports_and_resumes_after_the_folder_moves(
        tmp_path, monkeypatch):
    from flax import nnx
    from safetensors.numpy import load_file

    from workbench.models._gpt import GPT

    cfg = wb.models.GPTConfig.preset("tiny").replace(n_layers=1, vocab_size=128)
    (tmp_path / "models").mkdir()
    wb.hf.to_hf(GPT(cfg, rngs=nnx.Rngs(0)), tmp_path / "models" / "base")
    monkeypatch.chdir(tmp_path / "models")
    tc = wb.TrainConfig(model=wb.hf.hf_config("base"), init="base", mesh={"data": 8},
                        batch=8, seq=16, steps=2, checkpoint_every=2, data="synthetic")
    assert tc.init == str(tmp_path / "models" / "base")          # stored absolute
    trainer = wb.Trainer(tc, tmp_path / "run", progress=None)
    trainer.run()
    want = wb.hf.to_hf(trainer.model, tmp_path / "want")
    trainer.close()
    run = json.loads((tmp_path / "run" / runs.RUN_JSON).read_text())
    assert run["config"]["init"] == run["init"]["path"] == str(tmp_path / "models" / "base")
    shutil.move(tmp_path / "models", tmp_path / "moved")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    out = wb.hf.export_run(tmp_path / "run", tmp_path / "out")
    got, ref = load_file(out / "model.safetensors"), load_file(want / "model.safetensors")
    assert sorted(got) == sorted(ref)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name])
    same = wb.TrainConfig.from_dict(run["config"])               # the folder is gone
    resumed = wb.Trainer(same, tmp_path / "run", progress=None)
    assert resumed.step == 2
    resumed.run(steps=3)
    resumed.close()
    # a new run without a checkpoint needs the weights: the missing folder is named
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "models" / "base"))):
        wb.Trainer(same, tmp_path / "fresh", progress=None)
    assert not (tmp_path / "fresh").exists()


# -- smaller ---------------------------------------------------------------------------

def test_a_lone_surrogate_names_the_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "fine"}\n{"text": "pair \\ud83d\\ude00 ok"}\n'
                 '{"text": "a\\ud800b"}\n')
    with pytest.raises(DataError) as err:
        build_token_cache([str(f)], tokenizer=Tokenizer(), cache_dir=tmp_path / "c")
    assert str(err.value).startswith(
        f"{f}:3: field 'text' holds a lone surrogate \\ud800 at character 1 (half of a "
        "UTF-16 pair, not a character)")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").glob("tokens-*"))


@pytest.mark.parametrize("files, says", [
    ([], "Dataset(files=[]) was given no files"),
    ((), "Dataset(files=()) was given no files"),
    ("", "holds an empty path"),
    (["a.jsonl", " "], "holds an empty path"),
])
def test_no_files_is_said_as_such(files, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        Dataset(files=files)



@pytest.mark.multiprocess
def test_a_launched_job_on_changed_data_is_refused_then_continues_with_data_changed_ok(world):
    """wb.launch's workers build the Trainer the same way: a resume on replaced documents
    fails the job naming what changed, run dir untouched; launched again with
    data_changed="ok" (the workers' --data-changed ok) it continues and records it."""
    world.reset()
    lines = _replace_documents(world)
    cfg = _again(world.cfg)
    job = wb.launch(cfg, processes=1, devices_per_process=8, run_dir=world.run, steps=3,
                    platform="cpu")
    assert job.wait(timeout=600) == "failed"
    assert lines[0] in job.tail(200) and "data_changed" in job.tail(200)
    assert (world.run / runs.RUN_JSON).read_bytes() == world.run_json
    job = wb.launch(cfg, processes=1, devices_per_process=8, run_dir=world.run, steps=3,
                    platform="cpu", data_changed="ok")
    assert job.wait(timeout=600) == "finished", job.tail(50)
    (event,) = json.loads((world.run / runs.RUN_JSON).read_text())["history"]
    assert (event["event"], event["step"], event["changes"]) == ("data_changed", 2, lines)
    assert [r["step"] for r in runs.read_metrics(world.run)] == [1, 2, 3]


@pytest.mark.parametrize("value", ["yes", "OK", 1, True])
def test_launch_and_scripts_take_data_changed_ok_only(tmp_path, value):
    with pytest.raises((ValueError, TypeError), match="data_changed="):
        wb.launch(wb.TrainConfig(), run_dir=tmp_path / "r", data_changed=value)
    with pytest.raises((ValueError, TypeError), match="data_changed="):
        wb.Slurm(partition="p").script(tmp_path / "r", data_changed=value)
    assert not (tmp_path / "r").exists()


def test_the_workers_are_told_data_changed_ok():
    script = wb.Slurm(partition="p").script("/shared/r", steps=5, data_changed="ok")
    assert " --steps 5 --data-changed ok" in script
    assert "--data-changed" not in wb.Slurm(partition="p").script("/shared/r")
    cmd = wb.Hosts(["h1"]).remote_command(0, Path("/shared/r"), "T",
                                          extra=["--data-changed", "ok"])
    assert cmd.split(" && exec ")[1].endswith(" --data-changed ok")
