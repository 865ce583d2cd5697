"""Every cache reads its files back as a hostile user may have left them (edited, copied
from another key, truncated, a pipe, a symlink, a directory): the answer is the one a build
with an empty cache gives, a CacheWarning names the file, and the entry is replaced."""
import gzip
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

from workbench._cache import CacheWarning
from workbench._sharding.mesh import mesh_info
from workbench._sharding.rules import Rules
from workbench._step import (abstract_batch, abstract_train_state, jit_train_step,
                             make_train_step, model_factory)
from workbench.models import GPTConfig
from workbench.planning import _compile, _plan_record


# --- hostile edits, each a function of (path, tmp_path) -----------------------------------

def _json_edit(change, *, legacy=False, rechecksum=False):
    """An edit of the record's JSON; ``legacy``: as a record written before records carried
    their key (tests/tpu_plans), so the type and range checks alone must catch it;
    ``rechecksum``: the checksum made to match (a record its writer meant)."""
    def edit(path, tmp_path):
        record = json.loads(gzip.decompress(path.read_bytes()))
        if legacy:
            record.pop("key"), record.pop("checksum")
        change(record)
        if rechecksum:
            record["checksum"] = _plan_record._checksum(record)
        path.write_bytes(gzip.compress(json.dumps(record).encode()))
    return edit


def _set(*keys, value):
    def change(record):
        d = record
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return change


def _fifo(path, tmp_path):
    path.unlink()
    os.mkfifo(path)


def _symlink_out(path, tmp_path):
    elsewhere = tmp_path / "elsewhere.json.gz"     # a believable record, but not in the cache
    elsewhere.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(elsewhere)


def _directory(path, tmp_path):
    path.unlink()
    path.mkdir()
    (path / "keep.txt").write_text("not Workbench's")


def _bytes(data):
    def edit(path, tmp_path):
        path.write_bytes(data(path.read_bytes()) if callable(data) else data)
    return edit


TEMP = "temp_size_in_bytes"
PLAN_EDITS = {
    "negative memory (-2 TB)": _json_edit(_set("memory", TEMP, value=-2 * 10**12), legacy=True),
    "huge memory (500 GiB)": _json_edit(_set("memory", TEMP, value=500 << 30)),
    "copied from another key": _json_edit(_set("key", value="0" * 64), rechecksum=True),
    "empty HLO": _json_edit(_set("hlo", value=""), legacy=True),
    "HLO not text": _json_edit(_set("hlo", value=["HloModule"]), legacy=True),
    "string memory": _json_edit(_set("memory", TEMP, value="12185088"), legacy=True),
    "bool memory": _json_edit(_set("memory", TEMP, value=True), legacy=True),
    "memory field missing": _json_edit(lambda r: r["memory"].pop(TEMP), legacy=True),
    "cost: 5": _json_edit(_set("cost", value=5), legacy=True),
    "NaN flops": _json_edit(_set("cost", "flops", value=float("nan")), legacy=True),
    "negative flops": _json_edit(_set("cost", "flops", value=-1.0), legacy=True),
    "other versions": _json_edit(_set("versions", value="jax=0.0.1"), legacy=True),
    "checksum removed": _json_edit(lambda r: r.pop("checksum")),
    "a JSON list": _bytes(gzip.compress(b"[1, 2]")),
    "not JSON": _bytes(gzip.compress(b"{not json")),
    "truncated gzip": _bytes(lambda raw: raw[: len(raw) // 2]),
    "not gzip": _bytes(b"not gzip"),
    "empty file": _bytes(b""),
    "a FIFO at the path": _fifo,
    "a symlink to elsewhere": _symlink_out,
    "a directory at the path": _directory,
}


# --- the plan cache ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_step():
    """The tiny preset's train step, lowered for the 8 CPU devices (fsdp on 4 x 2)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"),
                axis_types=(AxisType.Auto,) * 2)
    rules = Rules.preset("fsdp", mesh_info(mesh))
    opt = optax.adamw(3e-4)
    cfg = GPTConfig.preset("tiny").resolved("cpu")
    st = abstract_train_state(model_factory(cfg), opt, rules, mesh, strict=False)
    ex = {k: jax.ShapeDtypeStruct((8, 16), jnp.int32) for k in ("inputs", "targets")}
    b = abstract_batch(ex, rules, mesh)
    step = make_train_step(st.graphdef, opt, rules=rules, mesh=mesh)
    jitted = jit_train_step(step, st.shardings, {k: v.sharding for k, v in b.items()})
    return jitted.lower(st.state, b), list(mesh.devices.flat)


def _plan(step):
    """The plan cache's answer for the step: what a plan reads, and whether it was cached."""
    _compile.clear_cache()
    lowered, devices = step
    r = _compile.compile_lowered(lowered, devices, what="tiny", status=None, persist=True)
    ma = r.compiled.memory_analysis()
    return ({k: getattr(ma, k) for k in _plan_record.MEMORY_FIELDS},
            r.compiled.cost_analysis(), r.compiled.as_text()), r.cached


@pytest.fixture
def plan_cache(tiny_step, tmp_path, monkeypatch):
    """An empty cache, then the reference: the answer of a fresh compile, and its record."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    reference, cached = _plan(tiny_step)
    assert not cached
    (path,) = (tmp_path / "cache" / "plans").glob("*.json.gz")
    return reference, path


def _record_loads(path):
    record, why = _plan_record.load_record(path.name[: -len(".json.gz")])
    return record is not None and why == ""


@pytest.mark.parametrize("edit", list(PLAN_EDITS.values()), ids=list(PLAN_EDITS))
def test_a_hostile_plan_record_is_compiled_again_and_replaced(edit, plan_cache, tiny_step,
                                                              tmp_path):
    reference, path = plan_cache
    edit(path, tmp_path)
    with pytest.warns(CacheWarning, match=str(path)) as caught:
        answer, cached = _plan(tiny_step)
    assert answer == reference and not cached
    if path.is_dir() and not path.is_symlink():     # not Workbench's to delete: left, said
        assert (path / "keep.txt").read_text() == "not Workbench's"
        assert "could not be replaced" in str(caught[0].message)
        return
    assert "record replaced" in str(caught[0].message)
    assert path.is_file() and not path.is_symlink() and _record_loads(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert _plan(tiny_step) == (reference, True)     # the new record is believed


def test_a_record_without_its_key_is_believed_by_its_name(plan_cache, tiny_step, tmp_path):
    """Records written before they carried their key (tests/tpu_plans) still serve."""
    reference, path = plan_cache
    _json_edit(lambda r: None, legacy=True)(path, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert _plan(tiny_step) == (reference, True)


def test_the_committed_tpu_plans_are_believed():
    from conftest import TPU_PLANS

    for entry in sorted(TPU_PLANS.glob("*.json.gz")):
        record = json.loads(gzip.decompress(entry.read_bytes()))
        assert _plan_record.record_problem(record, entry.name[: -len(".json.gz")]) == "", entry
