"""Checkpoint corruption matrix: each file of a step, damaged each way, on real Orbax files.

Reference: one uninterrupted run of N steps. Each case copies one run directory trained to
step 6 (checkpoints 3 and 6), damages a file of step 6 in one way, and resumes with a new
Trainer to N. Files the restore reads (array data, the OCDBT b-tree and manifest, the
array metadata, the JSON metadata, the data position) must make the run continue from
step 3, with step 6 moved aside to ``checkpoints/corrupt/6`` (never deleted) and a warning
naming it. Files the restore does not read (Orbax's ``_CHECKPOINT_METADATA``,
``commit_success.txt``, the per-process OCDBT manifest) leave step 6 usable: it is
restored, checksums verified. Either way the losses are bitwise those of the reference
run (CPU, same binary) and the next saves never trip over the damaged step.
"""
import glob
import os
import shutil
import warnings

import pytest

import workbench as wb
from workbench.train._checkpoint import CORRUPT_DIR

pytestmark = [pytest.mark.usefixtures("wb_cache"),
              # a failed read may report once more from orbax's reader after its loop closed
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

N = 8
CFG = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                     rules="fsdp", batch=8, seq=32, steps=N, checkpoint_every=3, keep=3,
                     data="synthetic", optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=2))

# the files of a step (glob under checkpoints/6; the largest match is damaged)
NEEDED = {
    "array_data": "state/ocdbt.process_0/d/*",
    "btree": "state/d/*",
    "array_metadata": "state/_METADATA",
    "manifest": "state/manifest.ocdbt",
    "json_metadata": "meta/metadata",
    "data_position": "data/process_0-of-1.json",
}
NOT_READ = {
    "process_manifest": "state/ocdbt.process_0/manifest.ocdbt",
    "checkpoint_metadata": "_CHECKPOINT_METADATA",
    "commit_marker": "commit_success.txt",
}
WAYS = ["truncate", "random", "zero", "delete", "flip3"]
CASES = ([(kind, way) for kind in NEEDED for way in WAYS]
         + [("data_position", "digit"), ("step", "emptied"), ("manifests", "delete")]
         # issue 29: a newest step that is a dangling symlink, a symlink loop, or holds
         # another step's data (cp -r checkpoints/3 checkpoints/6)
         + [("step", "dangling_symlink"), ("step", "symlink_loop"), ("step", "other_step")]
         + [(kind, way) for kind in NOT_READ for way in ("random", "delete")])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the reference losses of N uninterrupted steps, a run directory at step 6)."""
    root = tmp_path_factory.mktemp("corruption")
    ref = wb.Trainer(CFG, run_dir=root / "reference", progress=None)
    ref.run()
    base = wb.Trainer(CFG, run_dir=root / "base", progress=None)
    base.run(steps=6)
    base.close()
    assert sorted(os.listdir(root / "base" / "checkpoints")) == ["3", "6"]
    return ref.losses, root / "base"


def _damage(step_dir, kind, way):
    """Damages step_dir's file of ``kind`` in ``way``."""
    if way == "emptied":
        shutil.rmtree(step_dir)
        step_dir.mkdir()
        return
    if way in ("dangling_symlink", "symlink_loop", "other_step"):
        shutil.rmtree(step_dir)
        if way == "other_step":
            shutil.copytree(step_dir.parent / "3", step_dir)
        else:
            os.symlink(step_dir.parent / ("gone" if way == "dangling_symlink" else "6"),
                       step_dir)
        return
    if kind == "manifests":
        for f in glob.glob(f"{step_dir}/state/**/manifest.ocdbt", recursive=True):
            os.remove(f)
        return
    pattern = {**NEEDED, **NOT_READ}[kind]
    path = max(glob.glob(f"{step_dir}/{pattern}"), key=os.path.getsize)
    size = os.path.getsize(path)
    if way == "delete":
        os.remove(path)
        return
    data = bytearray(open(path, "rb").read())
    if way == "truncate":
        data = data[:size // 2]
    elif way == "random":
        data = bytearray(os.urandom(size))
    elif way == "zero":
        data = bytearray(size)
    elif way == "flip3":  # three bytes flipped inside the file, its size unchanged
        for at in (size // 3, size // 2, 2 * size // 3):
            data[at] ^= 0xFF
    elif way == "digit":  # still valid JSON, another position: only the recorded one tells
        text = data.decode()
        data = bytearray(text.replace("6", "2").encode())
        assert text != data.decode()
    with open(path, "wb") as f:
        f.write(bytes(data))


@pytest.mark.parametrize("kind,way", CASES, ids=[f"{k}-{w}" for k, w in CASES])
@pytest.mark.slow
def test_resume_from_the_newest_good_step_with_bitwise_losses(trained, tmp_path, kind, way):
    reference, base = trained
    run_dir = tmp_path / "run"
    shutil.copytree(base, run_dir)
    ckpts = run_dir / "checkpoints"
    _damage(ckpts / "6", kind, way)
    harmless = kind in NOT_READ
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = wb.Trainer(CFG, run_dir=run_dir, progress=None)
    said = [str(w.message) for w in caught if "checkpoint step 6" in str(w.message)]
    if harmless:
        assert trainer.step == 6 and not said
        assert not (ckpts / CORRUPT_DIR).exists()
    else:
        assert trainer.step == 3
        assert len(said) == 1 and "unreadable" in said[0] and "restored step 3" in said[0]
        assert f"{CORRUPT_DIR}/6" in said[0] and "nothing deleted" in said[0]
        assert os.path.lexists(ckpts / CORRUPT_DIR / "6")    # moved aside, not deleted
        assert "step 6" in (ckpts / CORRUPT_DIR / "6.reason.txt").read_text()
    trainer.run()                                            # saves 6 again: no collision
    assert trainer.losses == reference                       # bitwise, all N steps
    assert trainer.checkpoints.all_steps() == [3, 6, 8]
    assert os.path.lexists(ckpts / CORRUPT_DIR / "6") != harmless  # still there after saves
    assert (ckpts / "6").is_dir() and not (ckpts / "6").is_symlink()
    trainer.close()
