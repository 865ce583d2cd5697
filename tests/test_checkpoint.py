"""Orbax checkpoints: composite save, keys, data position, keep-N, another mesh, corrupt
latest, and a real full disk."""
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import workbench as wb
import workbench.train._checkpoint  # noqa: F401 - wb.train._checkpoint below
from workbench.data import ShardedBatches, TextData
from workbench.train._checkpoint import CheckpointError, Checkpoints, abstract
from workbench.train._setup import RunConfigMismatch


pytestmark = pytest.mark.usefixtures("wb_cache")


def _mesh(**axes):
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def _state(mesh, scale=1.0):
    w = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) * scale
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data"))),
            "b": jax.device_put(jnp.full((8,), scale), NamedSharding(mesh, P())),
            "step": jnp.int32(3), "rng": jax.random.split(jax.random.key(7), 3)}


def _data(mesh):
    return ShardedBatches(TextData(max_bytes=20_000), seq=16, batch=8, seed=0,
                          sharding=NamedSharding(mesh, P("data")), vocab_size=256)


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(jax.tree.map(_raw, a)), jax.tree.leaves(jax.tree.map(_raw, b)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _raw(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def test_composite_save_restores_state_keys_and_data_position(tmp_path):
    mesh = _mesh(data=8)
    state, data = _state(mesh), _data(mesh)
    for _ in range(3):
        next(data)
    ck = Checkpoints(tmp_path / "ck", keep=3)
    blocked = ck.save(5, state, data=data, meta={"note": "hi"})
    want_next = np.asarray(next(data)["inputs"])           # consumed after the save
    ck.wait()
    assert {"data", "meta", "state"} <= set(os.listdir(tmp_path / "ck" / "5"))
    assert blocked >= 0
    fresh = _data(mesh)
    r = Checkpoints(tmp_path / "ck").restore(state, data=fresh)
    assert r.step == 5 and r.meta["note"] == "hi" and r.meta["key_impls"] == ["threefry2x32"]
    _equal(r.state, state)
    assert jnp.issubdtype(r.state["rng"].dtype, jax.dtypes.prng_key)    # typed keys again
    np.testing.assert_array_equal(np.asarray(next(fresh)["inputs"]), want_next)


def test_keep_last_n(tmp_path):
    mesh = _mesh(data=8)
    ck = Checkpoints(tmp_path / "ck", keep=2)
    for s in range(1, 6):
        ck.save(s, _state(mesh, s), force=True)
    ck.wait()
    assert ck.all_steps() == [4, 5]
    _equal(ck.restore(_state(mesh)).state, _state(mesh, 5))


def test_snapshot_saves_the_state_and_data_position_it_was_taken_at(tmp_path):
    """The loop snapshots at step k, then runs step k + 1 (donating the state's buffers) and
    reads on, before the snapshot is saved: the checkpoint is still step k's."""
    mesh = _mesh(data=8)
    state, data = _state(mesh), _data(mesh)
    want = jax.device_get(state)
    ck = Checkpoints(tmp_path / "ck")
    snap = ck.snapshot(state, data)
    assert snap is not None
    want_next = np.asarray(next(data)["inputs"])            # the batch after the snapshot
    step = jax.jit(lambda t: jax.tree.map(lambda x: x if x.dtype == jnp.int32 or
                                          jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                                          else x * 10, t), donate_argnums=0)
    state = step(state)                                      # donates the old buffers
    next(data)
    assert ck.save(4, snap) >= snap.seconds > 0              # blocking time counts the copy
    ck.wait()
    fresh = _data(mesh)
    r = Checkpoints(tmp_path / "ck").restore(state, data=fresh)
    _equal(r.state, want)
    np.testing.assert_array_equal(np.asarray(next(fresh)["inputs"]), want_next)


def test_snapshot_only_of_small_states_and_for_asynchronous_saves(tmp_path, monkeypatch):
    mesh = _mesh(data=8)
    assert Checkpoints(tmp_path / "a", async_save=False).snapshot(_state(mesh)) is None
    monkeypatch.setattr(wb.train._checkpoint, "SNAPSHOT_LEAF_BYTES", 256)   # "w" is 512 bytes
    assert Checkpoints(tmp_path / "b").snapshot(_state(mesh)) is None
    monkeypatch.undo()
    monkeypatch.setattr(wb.train._checkpoint, "SNAPSHOT_BYTES", 256)
    assert Checkpoints(tmp_path / "c").snapshot(_state(mesh)) is None
    monkeypatch.undo()
    d = jax.devices()   # leaves on different devices: each copied where it is
    apart = {"a": jax.device_put(jnp.arange(4.0), d[0]), "b": jax.device_put(jnp.ones(4), d[1])}
    ck = Checkpoints(tmp_path / "d")
    snap = ck.snapshot(apart)
    assert [x.devices() for x in jax.tree.leaves(snap.tree)] == [{d[0]}, {d[1]}]
    ck.save(1, snap)
    ck.wait()
    _equal(ck.restore(apart).state, apart)


# 1 << 40: snapshotted, every array saved whole from the host; 0: Orbax's per-shard writes
@pytest.mark.parametrize("gather", [1 << 40, 0], ids=["host-arrays", "per-shard"])
def test_restore_onto_another_mesh_has_the_same_values(tmp_path, monkeypatch, gather):
    monkeypatch.setattr(wb.train._checkpoint, "SNAPSHOT_LEAF_BYTES", gather)
    state = _state(_mesh(data=8))
    ck = Checkpoints(tmp_path / "ck")
    ck.save(1, state)
    ck.wait()
    other = _mesh(data=4, model=2)
    target = jax.tree.map(lambda a: a, abstract(_state(other)))
    target["w"] = jax.ShapeDtypeStruct((16, 8), jnp.float32,
                                       sharding=NamedSharding(other, P("data", "model")))
    r = ck.restore(target)
    assert r.state["w"].sharding == NamedSharding(other, P("data", "model"))
    assert {s.data.shape for s in r.state["w"].addressable_shards} == {(4, 4)}
    _equal(r.state, state)


# a failed read may report once more from orbax's reader after its event loop closed
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "remove_item"])
def test_corrupt_latest_falls_back_to_the_previous_with_a_warning(tmp_path, damage):
    mesh = _mesh(data=8)
    ck = Checkpoints(tmp_path / "ck", keep=3)
    for s in (10, 20):
        ck.save(s, _state(mesh, s), force=True)
    ck.wait()
    if damage == "truncate":  # a torn write: every array data file cut to half its size
        for f in (tmp_path / "ck" / "20" / "state").glob("**/d/*"):
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)
    else:
        shutil.rmtree(tmp_path / "ck" / "20" / "state")
    with pytest.warns(UserWarning, match=r"checkpoint step 20 .* unreadable .* restored step 10"):
        r = Checkpoints(tmp_path / "ck").restore(_state(mesh))
    assert r.step == 10 and r.skipped[0][0] == 20
    _equal(r.state, _state(mesh, 10))


def test_no_readable_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        Checkpoints(tmp_path / "ck").restore({"x": jnp.zeros(2)})


def test_interrupted_save_leaves_no_step_behind(tmp_path):
    """A temporary directory from a save that never committed is neither listed nor restored."""
    mesh = _mesh(data=8)
    ck = Checkpoints(tmp_path / "ck")
    ck.save(1, _state(mesh), force=True)
    ck.wait()
    shutil.copytree(tmp_path / "ck" / "1", tmp_path / "ck" / "2.orbax-checkpoint-tmp-123")
    again = Checkpoints(tmp_path / "ck")
    assert again.all_steps() == [1] and again.restore(_state(mesh)).step == 1
    assert not (tmp_path / "ck" / "2.orbax-checkpoint-tmp-123").exists()   # cleaned up


@contextlib.contextmanager
def _small_disk(path, size_mb):
    """A real size-limited filesystem (tmpfs, as root); else a per-process file-size limit."""
    path.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
        capture_output=True, check=False).returncode == 0
    try:
        yield "tmpfs" if mounted else "rlimit"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


def _fill(path):
    """Writes until the filesystem is full (ENOSPC)."""
    with contextlib.suppress(OSError), open(path / "filler", "wb") as f:
        while True:
            f.write(b"\0" * (1 << 16))
            f.flush()
    assert shutil.disk_usage(path).free < (1 << 16)


# orbax's writer thread reports the failed write once more after its event loop closed
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path):
    mesh = _mesh(data=8)
    state1, state2 = _state(mesh, 1.0), _state(mesh, 2.0)
    with _small_disk(tmp_path / "disk", 8) as kind:
        ck = Checkpoints(tmp_path / "disk" / "ck", keep=3)
        ck.save(1, state1, force=True)
        ck.wait()
        if kind == "tmpfs":
            _fill(tmp_path / "disk")
            limit = None
        else:  # no root: writes past 1 kB fail with EFBIG, a real OS write error
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
        try:
            with warnings.catch_warnings(), pytest.raises(
                    CheckpointError, match=r"step 2 .* failed.*previous checkpoint \(step 1\) "
                                           r"is intact"):
                warnings.simplefilter("ignore")
                ck.save(2, state2, force=True)
                ck.wait()
        finally:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, limit)
                signal.signal(signal.SIGXFSZ, old_handler)
        (tmp_path / "disk" / "filler").unlink(missing_ok=True)
        again = Checkpoints(tmp_path / "disk" / "ck")
        assert again.all_steps() == [1]
        _equal(again.restore(_state(mesh)).state, state1)


@pytest.mark.slow
def test_trainer_checkpoint_restores_onto_data4_model2(tmp_path):
    """A Trainer's checkpoint saved on data=8 (fsdp) restores into data=4, model=2 (fsdp_tp)."""
    cfg = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                         rules="fsdp", batch=8, seq=32, steps=2, checkpoint_every=2,
                         data="synthetic")
    a = wb.Trainer(cfg, run_dir=tmp_path / "run", progress=None)
    a.run()
    saved = jax.device_get(a.state)
    b = wb.Trainer(cfg.replace(mesh={"data": 4, "model": 2}, rules="fsdp_tp"),
                   run_dir=tmp_path / "run", progress=None)
    assert b.step == 2 and dict(b.mesh.shape) == {"data": 4, "model": 2}
    q = b.state.params["blocks"][0]["attn"]["q"]
    assert q.sharding.spec == P("data", "model", None)
    _equal(b.state, saved)
    assert b.losses == a.losses                 # the history comes from the run directory


# ----------------------------------------------------------------------------- verification
TINY = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                      rules="fsdp", batch=8, seq=32, steps=9, checkpoint_every=3, keep=3,
                      data="synthetic")


@pytest.fixture(scope="module")
def nine_steps(tmp_path_factory):
    """A run directory trained to step 9 with checkpoints 3, 6 and 9 (keep=3)."""
    run_dir = tmp_path_factory.mktemp("nine") / "run"
    tr = wb.Trainer(TINY, run_dir=run_dir, progress=None)
    tr.run()
    tr.close()
    return run_dir


def test_checksums_do_not_depend_on_the_mesh_and_see_one_flipped_bit():
    from workbench.train._checksum import leaf_checksums

    x = jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16)
    a = leaf_checksums({"x": jax.device_put(x, NamedSharding(_mesh(data=8), P("data")))})
    b = leaf_checksums({"x": jax.device_put(x, NamedSharding(_mesh(data=4, model=2),
                                                             P("model", "data")))})
    assert a == b == leaf_checksums({"x": np.asarray(x)})
    bits = np.asarray(x).view(np.uint32).copy()
    bits[37, 5] ^= 1 << 13                                   # one bit of one element
    assert leaf_checksums({"x": bits.view(np.float32)})["x"][0] != a["x"][0]
    assert leaf_checksums({"x": bits.view(np.float32)})["x"][1] != a["x"][1]


def test_force_with_another_model_shape_names_the_first_parameter_and_both_shapes(
        nine_steps, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(nine_steps, run_dir)
    wider = TINY.replace(model_overrides={"n_layers": 1, "d_model": 128})
    with pytest.raises(wb.train._checkpoint.CheckpointMismatch) as err:
        wb.Trainer(wider, run_dir=run_dir, force=True, progress=None)
    msg = str(err.value)
    assert re.search(r"'train\.[\w.]+' is \(\d+(, \d+)*\) in the checkpoint, \(\d+(, \d+)*\) "
                     r"in this config", msg), msg
    assert "new run_dir" in msg and "Nothing was changed" in msg
    assert Checkpoints(run_dir / "checkpoints").all_steps() == [3, 6, 9]   # nothing moved
    assert not (run_dir / "checkpoints" / "corrupt").exists()


def test_lowering_keep_never_deletes_checkpoints_without_force(nine_steps, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(nine_steps, run_dir)
    with pytest.raises(RunConfigMismatch,
                       match=r"keep=1 is lower than the keep=3 .* would delete checkpoint "
                             r"step\(s\) 3, 6 \(keeping 9\)\. Nothing was deleted.*force=True"):
        wb.Trainer(TINY.replace(keep=1), run_dir=run_dir, progress=None)
    assert Checkpoints(run_dir / "checkpoints").all_steps() == [3, 6, 9]
    tr = wb.Trainer(TINY.replace(keep=1), run_dir=run_dir, force=True, progress=None)
    assert "the next save deletes checkpoint step(s) 3, 6" in capsys.readouterr().err
    tr.run(steps=12)
    assert tr.checkpoints.all_steps() == [12]


# a failed read may report once more from orbax's reader after its event loop closed
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_lone_unreadable_step_stays_in_place_and_a_damaged_one_is_moved(tmp_path):
    """Nothing proves an unreadable step is damaged when no step reads (the cause may be
    here): it stays; a step whose checksums differ is damaged for sure: it is moved."""
    mesh = _mesh(data=8)
    ck = Checkpoints(tmp_path / "ck")
    ck.save(1, _state(mesh), force=True)
    ck.wait()
    files = list((tmp_path / "ck" / "1" / "state").glob("**/d/*"))   # every data file
    keep = {f: f.read_bytes() for f in files}
    for f in files:
        f.write_bytes(b"\0" * len(keep[f]))
    with pytest.raises(CheckpointError, match=r"no readable checkpoint .*step 1: .*move the "
                                              r"step directories out"):
        Checkpoints(tmp_path / "ck").restore(_state(mesh))
    assert Checkpoints(tmp_path / "ck").all_steps() == [1]                 # left in place
    for f in files:
        f.write_bytes(keep[f])
    meta = tmp_path / "ck" / "1" / "meta" / "metadata"
    facts = json.loads(meta.read_text())
    facts["checksums"]["leaves"]["w"][0] ^= 1                              # recorded != read
    meta.write_text(json.dumps(facts))
    with pytest.raises(CheckpointError, match=r"checksum mismatch, first 'w'.*moved aside"):
        Checkpoints(tmp_path / "ck").restore(_state(mesh))
    assert (tmp_path / "ck" / "corrupt" / "1").is_dir()
    assert Checkpoints(tmp_path / "ck").all_steps() == []


# a failed read may report once more from orbax's reader after its event loop closed
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_junk_step_directory_is_moved_aside_and_its_step_saved_again(tmp_path):
    mesh = _mesh(data=8)
    ck = Checkpoints(tmp_path / "ck")
    ck.save(1, _state(mesh), force=True)
    ck.wait()
    (tmp_path / "ck" / "2").mkdir()
    (tmp_path / "ck" / "2" / "junk").write_text("half a save")   # orbax lists it as step 2
    with pytest.warns(UserWarning, match=r"step 2 .* unreadable .*moved aside.*restored step 1"):
        assert ck.restore(_state(mesh)).step == 1
    ck.save(2, _state(mesh, 2.0), force=True)                     # no StepAlreadyExistsError
    ck.wait()
    assert ck.all_steps() == [1, 2] and (tmp_path / "ck" / "corrupt" / "2" / "junk").exists()
    _equal(ck.restore(_state(mesh)).state, _state(mesh, 2.0))
