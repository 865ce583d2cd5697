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
from workbench._step import jit_train_step, make_train_step
from workbench._train_state import abstract_batch, abstract_train_state, model_factory
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


# --- token caches and text corpora -----------------------------------------------------------

def _write(name, data):
    def edit(target, tmp_path):
        p = target / name if name else target
        p.write_bytes(data(p.read_bytes()) if callable(data) else data)
    return edit


def _info(change, name="info.json"):
    """An edit of the JSON in ``name`` (a token cache's info; "" for the target itself)."""
    def edit(target, tmp_path):
        p = target / name if name else target
        info = json.loads(p.read_text())
        change(info)
        p.write_text(json.dumps(info))
    return edit


def _replace(name, how):
    """``name`` in the folder (or the folder itself, name None) replaced by a FIFO, a
    symlink to a copy elsewhere, or a directory."""
    def edit(folder, tmp_path):
        import shutil
        p = folder / name if name else folder
        if how == "symlink":
            elsewhere = tmp_path / "elsewhere"
            (shutil.copytree if p.is_dir() else shutil.copyfile)(p, elsewhere)
        (shutil.rmtree if p.is_dir() else os.unlink)(p)
        if how == "fifo":
            os.mkfifo(p)
        elif how == "symlink":
            p.symlink_to(elsewhere)
        else:
            p.mkdir()
    return edit


def _tokens_of_other_files(folder, tmp_path):
    """The cache folder of other files copied onto this one's name."""
    import shutil

    from workbench.data import Tokenizer, build_token_cache

    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "something else entirely"}) + "\n")
    theirs = build_token_cache([str(other)], tokenizer=Tokenizer(), cache_dir=tmp_path / "o")
    shutil.rmtree(folder)
    shutil.copytree(theirs.folder, folder)


TOKEN_EDITS = {
    "copied from another key": _tokens_of_other_files,
    "negative tokens": _info(lambda i: i.update(tokens=-5)),
    "documents a string": _info(lambda i: i.update(documents="3")),
    "another tokenizer's": _info(lambda i: i.update(tokenizer_fingerprint="0" * 16)),
    "info a JSON list": _write("info.json", b"[1]"),
    "info not JSON": _write("info.json", b"{"),
    "info a FIFO": _replace("info.json", "fifo"),
    "info a directory": _replace("info.json", "dir"),
    "lengths edited": _write("lengths.npy", lambda raw: raw[:-8] + bytes(8)),
    "lengths truncated": _write("lengths.npy", lambda raw: raw[: len(raw) // 2]),
    "lengths a FIFO": _replace("lengths.npy", "fifo"),
    "tokens truncated": _write("tokens.array_record", lambda raw: raw[: len(raw) // 2]),
    "tokens a FIFO": _replace("tokens.array_record", "fifo"),
    "tokens a symlink to elsewhere": _replace("tokens.array_record", "symlink"),
    "the folder a symlink to elsewhere": _replace(None, "symlink"),
    "the folder a file": lambda folder, tmp_path: (_replace(None, "dir")(folder, tmp_path),
                                                   folder.rmdir(), folder.write_bytes(b"x")),
}


def _token_answer(cache):
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(cache.path))
    tokens = b"".join(reader.read_all())
    reader.close()
    keep = ("sha256", "documents", "tokens", "format", "field", "tokenizer_fingerprint")
    return cache.lengths.tolist(), tokens, {k: cache.info[k] for k in keep}


@pytest.fixture
def corpus_files(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * (i + 1)})
                                           + "\n" for i in range(6)))
    (texts / "b.py").write_text("x = 1\n" * 200)
    return texts


@pytest.mark.parametrize("edit", list(TOKEN_EDITS.values()), ids=list(TOKEN_EDITS))
def test_a_hostile_token_cache_is_tokenized_again_and_replaced(edit, corpus_files, tmp_path):
    from workbench.data import Tokenizer, build_token_cache

    build = lambda where: build_token_cache(  # noqa: E731
        [str(corpus_files / "a.jsonl")], tokenizer=Tokenizer(), cache_dir=where)
    reference = _token_answer(build(tmp_path / "fresh"))
    cache = build(tmp_path / "cache")
    edit(cache.folder, tmp_path)
    with pytest.warns(CacheWarning, match=str(cache.folder)):
        again = build(tmp_path / "cache")
    assert _token_answer(again) == reference and again.folder == cache.folder
    assert again.folder.is_dir() and not again.folder.is_symlink()
    if (tmp_path / "elsewhere").exists():                   # the link's target is untouched
        assert (tmp_path / "elsewhere").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert _token_answer(build(tmp_path / "cache")) == reference


CORPUS_EDITS = {
    "copied from another key (seq)": _info(lambda i: i.update(seq=32), ""),
    "another stream's sha256": _info(lambda i: i.update(sha256="0" * 64), ""),
    "windows -1": _info(lambda i: i.update(windows=-1), ""),
    "a path elsewhere": _info(lambda i: i.update(path="/etc/hostname"), ""),
    "listing a JSON list": _write("", b"[]"),
    "listing not JSON": _write("", b"{"),
    "listing a FIFO": _replace("", "fifo"),
    "listing a directory": _replace("", "dir"),
}
CORPUS_FILE_EDITS = {
    "corpus truncated": _write("", lambda raw: raw[: len(raw) // 2]),
    "corpus edited": _write("", lambda raw: raw[:-1] + bytes([raw[-1] ^ 1])),
    "corpus a FIFO": _replace("", "fifo"),
    "corpus a symlink to elsewhere": _replace("", "symlink"),
    "corpus a directory": _replace("", "dir"),
}


def _corpus_answer(path, info):
    import grain

    src = grain.sources.ArrayRecordDataSource(str(path))
    return [src[i] for i in range(len(src))], {k: v for k, v in info.items() if k != "path"}


@pytest.mark.parametrize("which,edit", [("listing", e) for e in CORPUS_EDITS.values()]
                         + [("corpus", e) for e in CORPUS_FILE_EDITS.values()],
                         ids=list(CORPUS_EDITS) + list(CORPUS_FILE_EDITS))
def test_a_hostile_text_corpus_is_written_again_and_replaced(which, edit, corpus_files,
                                                             tmp_path):
    from workbench.data import TextData, build_text_corpus

    spec = TextData(root=str(corpus_files))
    reference = _corpus_answer(*build_text_corpus(spec, 16, cache_dir=tmp_path / "fresh"))
    path, _ = build_text_corpus(spec, 16, cache_dir=tmp_path / "cache")
    (listing,) = (tmp_path / "cache").glob("listing-*.json")
    target = listing if which == "listing" else path
    edit(target, tmp_path)
    with pytest.warns(CacheWarning, match=str(target)):
        again = build_text_corpus(spec, 16, cache_dir=tmp_path / "cache")
    assert _corpus_answer(*again) == reference
    if target.is_dir() and not target.is_symlink():   # not Workbench's: left as it is
        assert again[0] != target and list(target.iterdir()) == []
        if target == listing:    # no listing can be written: the corpus is checked anew
            return
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert _corpus_answer(*build_text_corpus(spec, 16, cache_dir=tmp_path / "cache")) \
            == reference


# --- microbenchmarks and calibrations ---------------------------------------------------------

def _measured(change):
    """An edit of the stored measurement(s) in the microbenchmark file."""
    def edit(path, tmp_path):
        data = json.loads(path.read_text())
        for k in data:
            data[k] = change
        path.write_text(json.dumps(data))
    return edit


MEASURE_EDITS = {
    "negative": _measured(-1.0),
    "huge (1e300)": _measured(1e300),
    "a string": _measured("fast"),
    "a bool": _measured(True),
    "NaN": _measured(float("nan")),
    "a JSON list": _write("", b"[1]"),
    "not JSON": _write("", b"{"),
    "a FIFO at the path": _replace("", "fifo"),
    "a symlink to elsewhere": _replace("", "symlink"),
    "a directory at the path": _replace("", "dir"),
}


@pytest.mark.parametrize("edit", list(MEASURE_EDITS.values()), ids=list(MEASURE_EDITS))
def test_a_hostile_measurement_is_measured_again_and_replaced(edit, tmp_path, monkeypatch):
    """Measurements differ run to run: the reference is what the file holds afterwards."""
    from workbench.hardware._measure import _plausible, measured_cpu_memory_bandwidth

    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    measured_cpu_memory_bandwidth(mib=1)
    (path,) = (tmp_path / "cache").glob("*.json")
    edit(path, tmp_path)
    with pytest.warns(CacheWarning, match=str(path)):
        again = measured_cpu_memory_bandwidth(mib=1)
    assert _plausible("mem|", again)          # measured again (the edits are implausible)
    if path.is_dir():                                      # not Workbench's: left as it is
        assert not path.is_symlink() and list(path.iterdir()) == []
        return
    assert path.is_file() and not path.is_symlink()
    assert list(json.loads(path.read_text()).values()) == [again]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert measured_cpu_memory_bandwidth(mib=1) == again


def _other_kinds(path, tmp_path):
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "device_kind": "H100"}))


CALIBRATION_EDITS = {
    "copied from another device kind": (_other_kinds, "it is the calibration of 'H100'"),
    "a FIFO at the path": (_replace("", "fifo"), r"not a regular file \(a named pipe\)"),
    "a symlink to elsewhere": (_replace("", "symlink"), "outside the cache folder"),
    "over the size cap": (_write("", lambda raw: raw + b" " * (5 << 20)), "over the 4 MiB"),
}


@pytest.mark.parametrize("edit,why", list(CALIBRATION_EDITS.values()),
                         ids=list(CALIBRATION_EDITS))
def test_a_hostile_calibration_is_ignored_and_the_table_predicts(edit, why, tmp_path,
                                                                 monkeypatch):
    """A calibration cannot be rebuilt (it needs profiles): the table's prediction."""
    import workbench as wb
    from workbench.hardware import Calibration, CalibrationWarning, cpu_spec
    from workbench.hardware._calibration import _file

    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path / "cal"))
    plan = wb.plan(GPTConfig.preset("tiny"), mesh=wb.make_mesh(data=8), rules="fsdp",
                   batch=8, seq=32, compile=False)
    kind = cpu_spec(8).name
    Calibration(device_kind=kind, compute_factor=0.5, memory_factor=0.25, matmul_flops=1e12,
                hbm_bandwidth=1e10, collectives={}, overlap=None,
                provenance=[{"directory": "/profiles/3"}]).save()
    path = _file(kind)
    edit(path, tmp_path)
    with pytest.warns(CalibrationWarning, match=why) as caught:
        pred = plan.predict()
    assert str(path) in str(caught[0].message)
    assert pred.step_seconds == plan.predict(calibration=False).step_seconds


# --- compiled steps: JAX's persistent compilation cache as the Trainer turns it on ----------

_COMPILE = """
import json, sys, warnings
import jax, jax.numpy as jnp
from workbench.train._setup import enable_compile_cache
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    enable_compile_cache(sys.argv[1])
    out = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0))(jnp.arange(12.0).reshape(3, 4))
print(json.dumps({"out": out.tolist(), "warnings": [str(w.message) for w in caught]}))
"""


def _empty_file(path, tmp_path):
    path.write_bytes(b"")


COMPILE_EDITS = {
    "a FIFO at the entry": _replace("", "fifo"),
    "a directory at the entry": _replace("", "dir"),
    "a symlink to elsewhere": _replace("", "symlink"),
    "an empty entry": _empty_file,
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("edit", list(COMPILE_EDITS.values()), ids=list(COMPILE_EDITS))
def test_a_hostile_compile_cache_entry_is_compiled_again_and_replaced(edit, tmp_path):
    import subprocess
    import sys

    cache = tmp_path / "jax-compile"
    run = lambda: json.loads(subprocess.run(  # noqa: E731
        [sys.executable, "-c", _COMPILE, str(cache)], capture_output=True, text=True,
        timeout=120, check=True).stdout.splitlines()[-1])
    reference = run()
    (entry,) = cache.glob("jit__lambda-*-cache")
    edit(entry, tmp_path)
    again = run()          # a pipe there would hang JAX's read (the timeout says so)
    assert again["out"] == reference["out"]
    assert any(str(entry) in w and "not an entry JAX wrote" in w for w in again["warnings"])
    assert entry.is_file() and not entry.is_symlink() and entry.stat().st_size > 0
    if (tmp_path / "elsewhere").exists():
        assert (tmp_path / "elsewhere").stat().st_size > 0       # what it pointed to: kept
    assert run() == {**reference, "warnings": []}
