"""Nothing deletes what it did not make (issue 44, item 1): a table of every write path that
replaces or removes something, tried on the source run, on a parent, on another run and
on folders and files it did not make.

The reference is the tree itself: every file's bytes, every folder and every link under
the test's folder are listed before the call and compared after it (a refused call must
leave them exactly as they were). A legitimate overwrite of a previous ``to_hf`` output
still works and gives the same bytes as a fresh export.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import workbench as wb
from workbench.data._tokens import build_token_cache
from workbench.hardware import _calibration as calibrate
from workbench.hf import _export_folder as export_folder
from workbench.hf._export import restore_params
from workbench.train._checkpoint import CheckpointError, Checkpoints

ROOT = Path(__file__).resolve().parents[1]
CFG = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8}, batch=8,
                     seq=16, steps=2, checkpoint_every=1, data="synthetic")


# ----------------------------------------------------------------------------- the reference
def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root`` (links not followed): files by their bytes' SHA-256,
    links by their target, folders and other entries by their kind."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = os.lstat(p).st_mode
            rel = p.relative_to(root).as_posix()
            if stat.S_ISLNK(mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(mode):
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[rel] = ("dir",) if stat.S_ISDIR(mode) else ("other", stat.S_IFMT(mode))
    return out


# ----------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def trained(tmp_path_factory: Any) -> Path:
    """``runs/a``: a tiny run with checkpoints at steps 1 and 2, and ``exported``: its
    to_hf folder (the legitimate thing to overwrite)."""
    root = tmp_path_factory.mktemp("trained")
    trainer = wb.Trainer(CFG, root / "runs" / "a", progress=None)
    try:
        trainer.run()
    finally:
        trainer.close()
    wb.hf.export_run(root / "runs" / "a", root / "exported")
    return root


@dataclasses.dataclass
class Tree:
    """A fresh copy of the trained tree for one case: ``root/runs/{a,b}``, ``exported``."""

    root: Path

    @property
    def run(self) -> Path:
        return self.root / "runs" / "a"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def exported(self) -> Path:
        return self.root / "exported"


@pytest.fixture
def tree(trained: Path, tmp_path: Path) -> Tree:
    root = tmp_path / "t"
    shutil.copytree(trained, root, symlinks=True)
    shutil.copytree(root / "runs" / "a", root / "runs" / "b", symlinks=True)
    return Tree(root)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True,
                          text=True, timeout=300, check=False, cwd=ROOT)


def _cli_refuses(t: Tree, dst: Path) -> None:
    out = _cli("export", str(t.run), str(dst), "--overwrite")
    assert out.returncode != 0
    raise ValueError(out.stderr[-3000:])   # the table matches the words in it


def _to_hf(t: Tree, dst: Path) -> None:
    params, cfg, _ = restore_params(t.run)
    wb.hf.to_hf((params, cfg), dst, overwrite=True)


def _export(t: Tree, dst: Path, **kw: Any) -> None:
    wb.hf.export_run(t.run, dst, **{"overwrite": True, **kw})


def _other_tool_folder(t: Tree) -> Path:
    """config.json + model.safetensors as another tool writes them (no to_hf mark)."""
    from safetensors.numpy import save_file

    d = t.root / "downloaded"
    d.mkdir()
    shutil.copy(t.exported / "config.json", d / "config.json")
    save_file({"w": np.zeros(3, np.float32)}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return d


def _with_readme(t: Tree) -> Path:
    (t.exported / "README.md").write_text("my model card")
    return t.exported


def _holder(t: Tree) -> Path:
    d = t.root / "holder"
    shutil.copytree(t.run, d / "c", symlinks=True)
    return d


def _notes(t: Tree) -> Path:
    d = t.root / "notes"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    (d / "config.json").write_text("{}")
    return d


def _link(t: Tree, to: Path) -> Path:
    (t.root / "link").symlink_to(to, target_is_directory=True)
    return t.root / "link"


def _file(t: Tree) -> Path:
    (t.root / "file.txt").write_text("mine")
    return t.root / "file.txt"


# (case, the destination (made by the case), the call, the error expected, words the
#  message must hold)
Case = tuple[str, Callable[[Tree], Path], Callable[[Tree, Path], Any], type, str]
EXPORT_CASES: list[Case] = [
    ('export_run("run", "run", overwrite=True)', lambda t: t.run, _export, ValueError,
     "is the run directory being exported"),
    ('export_run("runs/a", "runs", overwrite=True)', lambda t: t.runs, _export, ValueError,
     "holds the run directory being exported"),
    ("export_run into the folder above the runs", lambda t: t.root, _export, ValueError,
     "holds the run directory being exported"),
    ("export_run into the run's checkpoints", lambda t: t.run / "checkpoints", _export,
     ValueError, "lies in the checkpoints"),
    ("export_run into a new folder in the checkpoints", lambda t: t.run / "checkpoints" / "hf",
     _export, ValueError, "lies in the checkpoints"),
    ("export_run onto another run", lambda t: t.runs / "b", _export, FileExistsError,
     "is a run directory (it holds run.json)"),
    ("export_run onto a folder holding a run", _holder, _export, FileExistsError,
     "holds folders (c)"),
    ("export_run onto a folder of other files", _notes, _export, FileExistsError,
     "holds files to_hf does not write (notes.txt)"),
    ("export_run onto a model folder another tool wrote", _other_tool_folder, _export,
     FileExistsError, "model.safetensors was not written by wb.hf.to_hf"),
    ("export_run onto a to_hf folder with a README added", _with_readme, _export,
     FileExistsError, "holds files to_hf does not write (README.md)"),
    ("export_run onto a symlink to the run", lambda t: _link(t, t.run), _export, ValueError,
     "is the run directory being exported"),
    ("export_run onto a symlink to a to_hf folder", lambda t: _link(t, t.exported), _export,
     FileExistsError, "is a symlink"),
    ("export_run onto a file", _file, _export, FileExistsError, "exists and is not a folder"),
    ("export_run over a to_hf folder without overwrite", lambda t: t.exported,
     lambda t, d: _export(t, d, overwrite=False), FileExistsError, "pass overwrite=True"),
    ("export_run(step=999)", lambda t: t.root / "new", lambda t, d: _export(t, d, step=999),
     CheckpointError, "no checkpoint at step 999; its checkpoints are at steps 1, 2"),
    ("to_hf onto the run", lambda t: t.run, _to_hf, FileExistsError, "is a run directory"),
    ("to_hf onto the runs folder", lambda t: t.runs, _to_hf, FileExistsError,
     "holds folders (a, b)"),
    ("to_hf onto a folder of other files", _notes, _to_hf, FileExistsError,
     "holds files to_hf does not write (notes.txt)"),
    ("python -m workbench export run run --overwrite", lambda t: t.run, _cli_refuses,
     ValueError, "is the run directory being exported"),
    ("python -m workbench export runs/a runs --overwrite", lambda t: t.runs, _cli_refuses,
     ValueError, "holds the run directory being exported"),
    ("python -m workbench export run notes --overwrite", _notes, _cli_refuses, ValueError,
     "holds files to_hf does not write (notes.txt)"),
]


@pytest.mark.parametrize(("setup", "call", "error", "words"), [c[1:] for c in EXPORT_CASES],
                         ids=[c[0] for c in EXPORT_CASES])
def test_export_deletes_nothing_it_did_not_make(tree: Tree, setup: Callable[[Tree], Path],
                                                call: Callable[[Tree, Path], Any], error: type,
                                                words: str) -> None:
    """Each destructive call is refused with the path named, and nothing under the test's
    folder changes (before = after, file by file; no temporary folder left)."""
    dst = setup(tree)
    before = snapshot(tree.root)
    with pytest.raises(error) as e:
        call(tree, dst)
    assert words in str(e.value), str(e.value)
    assert str(dst) in str(e.value) or "step 999" in words
    assert snapshot(tree.root) == before


def test_step_999_lists_the_steps_there_are(tree: Tree) -> None:
    """The reference for the steps: Orbax's own listing of the run's checkpoints."""
    ckpts = Checkpoints(tree.run / "checkpoints", read_only=True)
    try:
        have = ckpts.all_steps()
    finally:
        ckpts.close()
    assert have == [1, 2]
    with pytest.raises(CheckpointError, match=r"at steps 1, 2 \(in .*checkpoints\): give one"):
        wb.hf.export_run(tree.run, tree.root / "new", step=999)
    assert not (tree.root / "new").exists()


def test_a_previous_to_hf_folder_is_still_overwritten(tree: Tree) -> None:
    """The legitimate overwrite: a folder an earlier export wrote is replaced, holding the
    same bytes as a fresh export of the same step, with nothing left beside it; the CLI's
    --overwrite does the same."""
    fresh = wb.hf.export_run(tree.run, tree.root / "fresh", step=1)
    (tree.exported / "tokenizer.json").write_text("{}")   # a file to_hf may write: replaced
    out = wb.hf.export_run(tree.run, tree.exported, step=1, overwrite=True)
    assert out == tree.exported
    want = {p.name: p.read_bytes() for p in fresh.iterdir()}
    assert {p.name: p.read_bytes() for p in out.iterdir()} == want
    assert sorted(p.name for p in tree.root.iterdir()) == ["exported", "fresh", "runs"]
    assert export_folder.check_replaceable(out) is None
    res = _cli("export", str(tree.run), str(tree.exported), "--step", "2", "--overwrite")
    assert res.returncode == 0, res.stderr[-2000:]
    again = wb.hf.export_run(tree.run, tree.root / "fresh2", step=2)
    assert {p.name: p.read_bytes() for p in tree.exported.iterdir()} == {
        p.name: p.read_bytes() for p in again.iterdir()}
    assert sorted(p.name for p in tree.root.iterdir()) == ["exported", "fresh", "fresh2",
                                                          "runs"]


def test_every_shard_carries_the_mark_in_one_order(tree: Tree) -> None:
    """What overwrite checks is in every safetensors header, readers see plain metadata
    (format "pt"), and the bytes do not depend on the order safetensors' hash map gives the
    mark's keys: five exports of the same parameters are the same bytes."""
    from safetensors import safe_open

    params, cfg, _ = restore_params(tree.run)
    outs = [wb.hf.to_hf((params, cfg), tree.root / f"x{i}", max_shard_bytes=20_000)
            for i in range(5)]
    files = sorted(p.name for p in outs[0].glob("*.safetensors"))
    assert len(files) > 1
    for f in files:
        with safe_open(str(outs[0] / f), "np") as st:
            assert st.metadata() == export_folder.MARK
        assert len({(o / f).read_bytes() for o in outs}) == 1, f


# ----------------------------------------------------------------------------- calibration
def _cal(kind: str) -> calibrate.Calibration:
    return calibrate.Calibration(device_kind=kind, compute_factor=0.5, memory_factor=0.5,
                                 matmul_flops=1e12, hbm_bandwidth=1e11, collectives={},
                                 overlap=None, provenance=[{"directory": "x"}])


def _cal_in(t: Tree, monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(folder))


def _cal_link(t: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    d = t.root / "cal"
    d.mkdir()
    (d / "cpu.json").symlink_to(t.run / "run.json")
    _cal_in(t, monkeypatch, d)


def _cal_dir(t: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    (t.root / "cal" / "cpu.json" / "inside").mkdir(parents=True)
    _cal_in(t, monkeypatch, t.root / "cal")


CAL_CASES: list[tuple[str, Callable[[Tree, Any], Any], Callable[[], Any], str]] = [
    ("remove_calibration('run') with the run as the calibration folder",
     lambda t, m: _cal_in(t, m, t.run), lambda: calibrate.remove_calibration("run"),
     "is a run directory (it holds run.json)"),
    ("Calibration('run').save() into the run", lambda t, m: _cal_in(t, m, t.run),
     lambda: _cal("run").save(), "is a run directory"),
    ("remove_calibration of a link to the run's run.json", _cal_link,
     lambda: calibrate.remove_calibration("cpu"), "is a symlink"),
    ("save over a link to the run's run.json", _cal_link, lambda: _cal("cpu").save(),
     "is a symlink"),
    ("remove_calibration of a directory", _cal_dir, lambda: calibrate.remove_calibration("cpu"),
     "is a directory"),
    ("save over a directory", _cal_dir, lambda: _cal("cpu").save(), "is a directory"),
]


@pytest.mark.parametrize(("setup", "call", "words"), [c[1:] for c in CAL_CASES],
                         ids=[c[0] for c in CAL_CASES])
def test_calibration_files_delete_nothing_they_did_not_make(
        tree: Tree, monkeypatch: pytest.MonkeyPatch, setup: Any, call: Any, words: str) -> None:
    setup(tree, monkeypatch)
    before = snapshot(tree.root)
    with pytest.raises(ValueError, match="nothing was") as e:
        call()
    assert words in str(e.value)
    assert snapshot(tree.root) == before


def test_calibration_save_and_remove_still_work(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The legitimate paths: save replaces an older file (a user's ``cpu.tmp`` beside it,
    the old fixed temporary name, is left alone); remove deletes a damaged file too."""
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path))
    (tmp_path / "cpu.tmp").write_text("mine")
    path = _cal("cpu").save()
    assert json.loads(path.read_text()) == _cal("cpu").to_dict()
    _cal("cpu").save()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.json", "cpu.tmp"]
    assert (tmp_path / "cpu.tmp").read_text() == "mine"
    path.write_text("{damaged")
    assert calibrate.remove_calibration("cpu") is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.tmp"]
    assert calibrate.remove_calibration("cpu") is False


# ----------------------------------------------------------------------------- token cache
def test_token_cache_leaves_a_folder_named_like_its_temporary(tmp_path: Path) -> None:
    """The cache removed ``.<cache folder>.<pid>.tmp`` before writing, whoever made it:
    now it writes into a folder of its own, and a folder of that name is left as it is."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(5)))
    tok = wb.data.Tokenizer()
    first = build_token_cache([str(docs)], tokenizer=tok, cache_dir=tmp_path / "c1")
    theirs = tmp_path / "c2" / f".{first.folder.name}.{os.getpid()}.tmp"
    theirs.mkdir(parents=True)
    (theirs / "keep.txt").write_text("mine")
    before = snapshot(tmp_path / "c2")
    second = build_token_cache([str(docs)], tokenizer=tok, cache_dir=tmp_path / "c2")
    after = snapshot(tmp_path / "c2")
    assert {k: v for k, v in after.items() if k in before} == before
    assert second.folder.name == first.folder.name
    assert sorted(p.name for p in (tmp_path / "c2").iterdir() if p.name.startswith(".")) == [
        theirs.name]


# ----------------------------------------------------------------------------- notebooks
def _build_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    spec = importlib.util.spec_from_file_location("nb_build", ROOT / "notebooks" / "build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "nb" / "source").mkdir(parents=True)
    shutil.copy(ROOT / "notebooks" / "source" / "00_tour.py", tmp_path / "nb" / "source")
    monkeypatch.setattr(mod, "HERE", tmp_path / "nb")
    monkeypatch.setattr(mod, "SOURCES", tmp_path / "nb" / "source")
    return mod


@pytest.mark.parametrize("kind", ["a symlink to a file elsewhere", "a directory"])
def test_notebook_build_replaces_only_notebook_files(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: Any, kind: str) -> None:
    """A notebook path that is a symlink was written through (its target overwritten), a
    directory gave a raw error: both are refused by name; nothing changes."""
    mod = _build_module(tmp_path, monkeypatch)
    target = tmp_path / "nb" / "00_tour.ipynb"
    if kind == "a directory":
        (target / "x").mkdir(parents=True)
    else:
        (tmp_path / "elsewhere.txt").write_text("mine")
        target.symlink_to(tmp_path / "elsewhere.txt")
    before = snapshot(tmp_path)
    assert mod.main([]) == 1
    assert "is never replaced" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_notebook_build_still_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The legitimate path: a stale notebook is rewritten with the built text, and the
    committed notebook is that text (the reference: the repository's own file)."""
    mod = _build_module(tmp_path, monkeypatch)
    target = tmp_path / "nb" / "00_tour.ipynb"
    target.write_text("stale")
    assert mod.main([]) == 0
    assert target.read_text() == (ROOT / "notebooks" / "00_tour.ipynb").read_text()
    assert sorted(p.name for p in (tmp_path / "nb").iterdir()) == ["00_tour.ipynb", "source"]


# ----------------------------------------------------------------------------- profiles
@pytest.mark.parametrize("kind", ["a link to the run's run.json", "a named pipe"])
def test_a_profile_report_is_never_written_through(tree: Tree, kind: str) -> None:
    """``report.json`` of a profile folder that is a link (to the run's run.json) or a pipe
    was written through (run.json overwritten) or blocked the trainer: the folder is
    skipped for a free one, and write_report itself refuses such a path."""
    from workbench.train import _profile as profile

    base = tree.run / "profiles" / "3"
    base.mkdir(parents=True)
    if kind == "a named pipe":
        os.mkfifo(base / "report.json")
    else:
        (base / "report.json").symlink_to(tree.run / "run.json")
    (tree.run / "profiles" / "4").symlink_to(tree.run, target_is_directory=True)
    before = snapshot(tree.root)
    assert profile.free_directory(base) == base.with_name("3-2")
    assert profile.free_directory(tree.run / "profiles" / "4") == tree.run / "profiles" / "4-2"

    @dataclasses.dataclass
    class Report:
        directory: Path

        def to_dict(self) -> dict[str, Any]:
            return {"rows": []}

    with pytest.raises(profile.ProfileError, match="is never written through"):
        profile.write_report(Report(base))
    assert snapshot(tree.root) == before
    (base.with_name("3-2")).mkdir()
    path = profile.write_report(Report(base.with_name("3-2")))
    assert json.loads(path.read_text()) == {"rows": []}
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]
