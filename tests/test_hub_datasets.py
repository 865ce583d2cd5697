"""Hub datasets (workbench/data/_hub_dataset.py): ``wb.data.Dataset(hf="org/name",
split=..., field=..., revision=...)`` read from a Hugging Face cache laid out as
``huggingface_hub`` writes it (``datasets--org--name``: blobs, snapshot symlinks, refs),
with ``HF_HUB_OFFLINE=1``: nothing is downloaded.

References: the same Parquet files read as local files, the ``datasets`` library's own
reader (``load_dataset`` of the snapshot: which files, which order, which rows),
``huggingface_hub``'s cache scan, the tokenizer's own chat template render, and an
uninterrupted training run. The Hub's online refusals (gated, no such revision) cannot
happen offline: those go through a stand-in for ``datasets.load_dataset_builder`` that
raises the libraries' own exception classes.
"""
from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import workbench as wb
from tests._chat_models import hub_cache, write_tokenizer
from workbench.data._files import DataError, DataFileNotFound
from workbench.train._setup import DataChanged

REPO, CHAT = "tiny-org/tiny-stories", "tiny-org/tiny-chat"
A, B = "a" * 40, "b" * 40          # commits: main, and the tag v2 (one train file changed)


def _docs(n=60):
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    lines = (x.strip() for x in text.splitlines())
    # printable ASCII (the test tokenizer's characters), one document per source line
    return [x for x in dict.fromkeys(lines) if len(x) > 20 and x.isascii()][:n]


def _parquet(path, column, values, row_group_size=8):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: values, "id": list(range(len(values)))}), path,
                   row_group_size=row_group_size)


def _sources(root):
    """Commit A: two train shards and a validation shard (the datasets library's default
    names ``data/<split>-*``); commit B: the second train shard edited."""
    docs = _docs()
    a = root / "a"
    _parquet(a / "data/train-00000-of-00002.parquet", "text", docs[:25])
    _parquet(a / "data/train-00001-of-00002.parquet", "text", docs[25:50])
    _parquet(a / "data/validation-00000-of-00001.parquet", "text", docs[50:])
    (a / "README.md").write_text("# tiny stories\n")
    b = root / "b"
    shutil.copytree(a, b)
    _parquet(b / "data/train-00001-of-00002.parquet", "text", docs[25:50][::-1])
    return {A: a, B: b}


def _chat_source(root):
    """A chat dataset whose card names its config and split files (``configs:``)."""
    chat = root / "chat"
    docs = _docs(24)
    rows = [[{"role": "user", "content": docs[i]}, {"role": "assistant", "content": docs[i + 1]}]
            for i in range(0, 24, 2)]
    chat.mkdir()
    (chat / "sft.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    (chat / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_sft\n"
        "    path: sft.jsonl\n---\n# tiny chat\n")
    return chat, rows


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-datasets-src")
    tok = write_tokenizer(root / "tok", "qwen3")
    chat, rows = _chat_source(root)
    return {"snapshots": _sources(root), "tokenizer": tok, "chat": chat, "chat_rows": rows}


@pytest.fixture
def cache(sources, tmp_path, monkeypatch):
    """HF_HUB_CACHE with REPO at A (main) and B (v2), CHAT at A; offline."""
    root = tmp_path / "hf-home"
    hub_cache(root / "hub", REPO, sources["snapshots"], {"main": A, "v2": B},
              repo_type="dataset")
    hub_cache(root / "hub", CHAT, {A: sources["chat"]}, {"main": A}, repo_type="dataset")
    for key, value in {"HF_HOME": root, "HF_HUB_CACHE": root / "hub", "HF_HUB_OFFLINE": "1",
                       "WORKBENCH_CACHE": tmp_path / "wb-cache"}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.chdir(tmp_path)
    return root / "hub"


def snapshot(cache, commit, repo=REPO):
    return cache / ("datasets--" + repo.replace("/", "--")) / "snapshots" / commit


def tokens(prepared):
    return np.stack([prepared.train[i]["tokens"] for i in range(len(prepared.train))])


def test_the_cache_layout_is_huggingface_hubs(cache):
    """The fixture is what huggingface_hub itself reads: a dataset repo, both revisions."""
    from huggingface_hub import scan_cache_dir

    repos = {r.repo_id: r for r in scan_cache_dir(cache).repos}
    assert {r.repo_type for r in repos.values()} == {"dataset"}
    revs = {r.commit_hash: set(r.refs) for r in repos[REPO].revisions}
    assert revs == {A: {"main"}, B: {"v2"}}


def test_rows_equal_the_same_parquet_files_read_locally(cache, sources):
    tok = wb.data.Tokenizer(sources["tokenizer"])
    hub = wb.data.prepare(wb.data.Dataset(hf=REPO, tokenizer=tok), seq=32, vocab_size=128)
    local = wb.data.prepare(wb.data.Dataset(files=[
        str(sources["snapshots"][A] / f"data/train-0000{i}-of-00002.parquet") for i in (0, 1)],
        tokenizer=tok), seq=32, vocab_size=128)
    np.testing.assert_array_equal(tokens(hub), tokens(local))
    assert hub.info["hf"] == {"id": REPO, "split": "train", "config": None, "revision": None,
                              "commit": A}
    assert sorted(hub.info["file_sha256"]) == [
        f"hf://datasets/{REPO}/data/train-0000{i}-of-00002.parquet" for i in (0, 1)]
    assert sorted(hub.info["file_sha256"].values()) == sorted(local.info["file_sha256"].values())


def test_the_split_is_the_files_and_rows_the_datasets_library_reads(cache, sources):
    """The reference: ``datasets.load_dataset`` of the snapshot (its own resolver and
    reader): each split's documents, in its order, are the token cache's."""
    import datasets

    tok = wb.data.Tokenizer(sources["tokenizer"])
    for split in ("train", "validation"):
        ref = datasets.load_dataset(str(snapshot(cache, A)), split=split,
                                    cache_dir=str(cache.parent / "datasets"))
        spec = wb.data.Dataset(hf=REPO, split=split, tokenizer=tok)
        info = wb.data.prepare(spec, seq=32, vocab_size=128).info
        lengths = np.load(Path(info["cache"]) / "lengths.npy")
        np.testing.assert_array_equal(lengths, [len(tok.document(t)) for t in ref["text"]])


def test_revision_a_tag_or_a_commit_is_read_and_recorded(cache, sources):
    tok = wb.data.Tokenizer(sources["tokenizer"])
    infos = {rev: wb.data.prepare(wb.data.Dataset(hf=REPO, revision=rev, tokenizer=tok),
                                  seq=32, vocab_size=128).info for rev in ("v2", B, "main")}
    assert infos["v2"]["hf"]["commit"] == infos[B]["hf"]["commit"] == B
    assert infos["main"]["hf"]["commit"] == A
    assert infos["v2"]["sha256"] == infos[B]["sha256"] != infos["main"]["sha256"]
    name = f"hf://datasets/{REPO}/data/train-00001-of-00002.parquet"
    assert infos["v2"]["file_sha256"][name] != infos["main"]["file_sha256"][name]


def _config(data, steps):
    return wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1, "vocab_size": 128},
                          mesh={"data": 8}, batch=8, seq=32, steps=steps, checkpoint_every=2,
                          data=data, optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=2))


@pytest.mark.slow
def test_a_resumed_run_equals_an_uninterrupted_one_and_a_new_commit_is_refused(
        cache, sources, tmp_path):
    data = wb.data.Dataset(hf=REPO, tokenizer=sources["tokenizer"])
    ref = wb.Trainer(_config(data, 6), run_dir=tmp_path / "ref", progress=None)
    ref.run()
    first = wb.Trainer(_config(data, 6), run_dir=tmp_path / "run", progress=None)
    first.run(steps=4)              # stopped after the step-4 checkpoint ...
    del first
    again = wb.Trainer(_config(data, 6), run_dir=tmp_path / "run", progress=None)
    assert again.step == 4          # ... and continued by a new Trainer
    again.run()
    assert again.losses == ref.losses
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["data"]["hf"]["commit"] == A
    # main moves to B (its second train file changed): the resume names commit and file
    (cache / "datasets--tiny-org--tiny-stories" / "refs" / "main").write_text(B)
    with pytest.raises(DataChanged, match=r"(?s)commit aaaaaaaaaaaa -> bbbbbbbbbbbb.*"
                       r"train-00001-of-00002.parquet: content changed"):
        wb.Trainer(_config(data, 6), run_dir=tmp_path / "run", progress=None)


def _stream(folder):
    """A token cache folder's token ids, read back with ArrayRecord's own reader."""
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(Path(folder) / "tokens.array_record"))
    records = reader.read(list(range(reader.num_records())))
    reader.close()
    return np.concatenate([np.frombuffer(r, np.int32) for r in records])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_mid_run_then_resume_equals_the_uninterrupted_run(cache, sources, tmp_path):
    """A process training on the Hub dataset (offline, from the cache) killed after a
    checkpoint; a new Trainer on its run directory gives the uninterrupted losses."""
    import signal
    import subprocess
    import sys

    from tests.test_resume import _wait_for_checkpoint, _wait_for_step
    from tests.test_text_train import CHILD
    from workbench import _runs as runs

    cfg = _config(wb.data.Dataset(hf=REPO, tokenizer=sources["tokenizer"]), 12)
    ref = wb.Trainer(cfg, run_dir=tmp_path / "ref", progress=None)
    ref.run()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, cfg.to_json(), str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    _wait_for_checkpoint(proc, run_dir)
    _wait_for_step(proc, run_dir, 5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert runs.read_metrics(run_dir)[-1]["step"] < 12
    with pytest.warns(UserWarning, match="taking over the stale lock"):
        trainer = wb.Trainer(cfg, run_dir=run_dir, progress=None)
    assert trainer.step >= 2
    trainer.run()
    assert trainer.losses == ref.losses


def test_chat_rows_are_rendered_with_the_models_chat_template(cache, sources):
    tok = wb.data.Tokenizer(sources["tokenizer"])
    spec = wb.data.Dataset(hf=CHAT, split="train_sft", field="messages", tokenizer=tok)
    info = wb.data.prepare(spec, seq=64, vocab_size=128).info
    texts = [tok.apply_chat_template(r, add_generation_prompt=False)
             for r in sources["chat_rows"]]
    assert texts[0].startswith("<|im_start|>user\n") and "<|im_end|>" in texts[0]
    want = [tok.encode(t) for t in texts]
    lengths = np.load(Path(info["cache"]) / "lengths.npy")
    np.testing.assert_array_equal(lengths, [len(w) for w in want])
    np.testing.assert_array_equal(_stream(info["cache"]), np.concatenate(want))
    with pytest.raises(DataError, match=r"holds chat messages.*no chat template"):
        wb.data.prepare(wb.data.Dataset(hf=CHAT, split="train_sft", field="messages"),
                        seq=64, vocab_size=256)


def test_streamed_row_groups_give_the_cache_of_the_downloaded_files(cache, sources, tmp_path):
    """Streaming reads each Parquet row group through fsspec (a URL; here file://, on the
    Hub hf://) with the SHA-256 the Hub records: the same key, the same token ids as the
    downloaded snapshot's files; offline, streaming=True reads the cached files."""
    from workbench.data._tokens import hub_token_cache

    tok = wb.data.Tokenizer(sources["tokenizer"])
    info = wb.data.prepare(wb.data.Dataset(hf=REPO, tokenizer=tok), seq=32,
                           vocab_size=128).info
    files = sorted(snapshot(cache, A).glob("data/train-*"))
    names = list(info["file_sha256"])
    streamed = hub_token_cache([f.resolve().as_uri() for f in files], names, tokenizer=tok,
                               field="text", fmt="parquet",
                               digests=[info["file_sha256"][n] for n in names],
                               cache_dir=tmp_path / "elsewhere")
    assert streamed.info["sha256"] == info["sha256"]
    assert streamed.folder.name == Path(info["cache"]).name
    np.testing.assert_array_equal(_stream(streamed.folder), _stream(info["cache"]))
    offline = wb.data.prepare(wb.data.Dataset(hf=REPO, tokenizer=tok, streaming=True),
                              seq=32, vocab_size=128).info
    assert offline["sha256"] == info["sha256"] and offline["hf"] == info["hf"]


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"split": "test"}, DataError,
     r"hf='tiny-org/tiny-stories', split='test'\): the dataset has no split 'test' \(splits: "
     r"\['train', 'validation'\]\) in the Hugging Face cache, and HF_HUB_OFFLINE=1"),
    ({"field": "story"}, DataError,
     r"split='train'\): hf://datasets/tiny-org/tiny-stories/data/train-00000-of-00002.parquet"
     r": no column 'story' \(columns: \['text', 'id'\]\); pass Dataset\(field=...\)"),
    ({"revision": "v9"}, DataFileNotFound,
     r"split='train'\): revision 'v9' of the dataset is not in the Hugging Face cache.*"
     r"HF_HUB_OFFLINE=1 forbids downloading it"),
    ({"revision": "c" * 40}, DataFileNotFound, r"revision 'c{40}' of the dataset is not in"),
    ({"hf": "tiny-org/elsewhere"}, DataFileNotFound,
     r"hf='tiny-org/elsewhere', split='train'\): revision 'main' of the dataset is not in"),
    ({"config": "sample"}, DataError, r"config='sample' is not a config of the dataset"),
])
def test_refusals_name_the_id_the_split_and_the_fix(cache, kwargs, exc, match):
    spec = wb.data.Dataset(**{"hf": REPO, **kwargs})
    with pytest.raises(exc, match=match):
        wb.data.prepare(spec, seq=32, vocab_size=256)


@pytest.mark.parametrize("error, match", [
    ("gated", r"split='train'\): the dataset is gated: .*hf auth login"),
    ("revision", r"split='train'\): the dataset has no revision 'nope'; give a branch"),
    ("missing", r"no dataset 'tiny-org/tiny-stories' on the Hugging Face Hub"),
])
def test_the_hubs_refusals_name_the_id_and_the_fix(cache, monkeypatch, error, match):
    """Online refusals (no offline way to have them): the libraries' own classes."""
    import datasets
    import httpx2
    from huggingface_hub import errors

    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co"))
    raised = {"gated": datasets.exceptions.DatasetNotFoundError(
                  f"Dataset '{REPO}' is a gated dataset on the Hub."),
              "revision": errors.RevisionNotFoundError("404 rev", response=response),
              "missing": datasets.exceptions.DatasetNotFoundError(
                  f"Dataset '{REPO}' doesn't exist on the Hub or cannot be accessed.")}
    seen = {}

    def refuse(path, **kwargs):
        seen.update(kwargs, path=path)
        raise raised[error]

    monkeypatch.setattr(datasets, "load_dataset_builder", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    spec = wb.data.Dataset(hf=REPO, revision="nope" if error == "revision" else None)
    with pytest.raises((DataError, DataFileNotFound), match=match):
        wb.data.prepare(spec, seq=32, vocab_size=256)
    assert seen["path"] == REPO


def _edit(cache, how):
    repo = cache / "datasets--tiny-org--tiny-stories"
    shard = snapshot(cache, A) / "data/train-00000-of-00002.parquet"
    if how == "ref":
        (repo / "refs" / "main").write_text("not-a-commit\n")
    elif how == "blob":      # same size, other bytes: the blob's name no longer its hash
        blob = shard.resolve()
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 1
        os.chmod(blob, 0o644)
        blob.write_bytes(bytes(data))
    elif how == "outside":
        target = cache.parent / "elsewhere.parquet"
        shutil.copy(shard, target)
        shard.unlink()
        shard.symlink_to(target)
    elif how == "broken":
        shard.resolve().unlink()


@pytest.mark.parametrize("how, match", [
    ("ref", r"refs/main holds 'not-a-commit\\n', not a commit hash"),
    ("blob", r"the cached blob .* is not the file the Hub served"),
    ("outside", r"leads outside the Hugging Face cache"),
    ("broken", r"points to a missing blob"),
])
def test_a_cache_edited_by_hand_is_refused(cache, how, match):
    _edit(cache, how)
    with pytest.raises(DataError, match=match):
        wb.data.prepare(wb.data.Dataset(hf=REPO), seq=32, vocab_size=256)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"hf": 3}, TypeError, r"Dataset.hf=3 is a int"),
    ({"hf": ""}, ValueError, r"Dataset.hf='' is empty"),
    ({"hf": "no-slash"}, ValueError, r"Dataset.hf='no-slash' is not a Hub dataset id"),
    ({"hf": "a/b/c"}, ValueError, r"'a/b/c' is not a Hub dataset id"),
    ({"hf": "org/na me"}, ValueError, r"'org/na me' is not a Hub dataset id"),
    ({"hf": REPO, "split": ""}, ValueError, r"Dataset.split='' is empty"),
    ({"hf": REPO, "split": 1}, TypeError, r"Dataset.split=1 is a int"),
    ({"hf": REPO, "revision": " main"}, ValueError, r"Dataset.revision=' main' has surrounding"),
    ({"hf": REPO, "revision": ""}, ValueError, r"Dataset.revision='' is empty"),
    ({"hf": REPO, "config": ["x"]}, TypeError, r"Dataset.config=\['x'\] is a list"),
    ({"hf": REPO, "files": "a.jsonl"}, ValueError, r"not both"),
    ({"hf": REPO, "format": "jsonl"}, ValueError, r"format is its files'"),
    ({"files": "a.jsonl", "split": "train"}, ValueError, r"split='train'\) is for Hub"),
    ({"files": "a.jsonl", "revision": A}, ValueError, r"is for Hub datasets"),
    ({"files": "a.jsonl", "streaming": True}, ValueError, r"streaming=True\) is for Hub"),
    ({"hf": REPO, "streaming": "yes"}, TypeError, r"streaming='yes'"),
])
def test_hostile_arguments_are_refused_by_name(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        wb.data.Dataset(**kwargs)


def test_the_spec_round_trips_and_local_specs_are_unchanged(cache):
    spec = wb.data.Dataset(hf=REPO, split="validation", revision="v2")
    d = spec.to_dict()
    assert wb.data.as_spec(json.loads(json.dumps(d))) == spec
    assert "files" not in d and d["hf"] == REPO and d["revision"] == "v2"
    local = wb.data.Dataset(files="a.jsonl").to_dict()   # a run's recorded config keeps
    assert not {"hf", "split", "config", "revision"} & set(local)   # its hash
