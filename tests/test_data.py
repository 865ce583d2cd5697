"""Grain pipelines: the stdlib byte corpus in ArrayRecord, shuffling, process shards, state."""
import json
import sysconfig
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.data import (
    ShardedBatches,
    SyntheticData,
    TextData,
    build_text_corpus,
    corpus_bytes,
    as_spec,
    grain_dataset,
    source,
)

SMALL = TextData(max_bytes=60_000)   # the first 60 kB of the stdlib stream


pytestmark = pytest.mark.usefixtures("wb_cache")


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def test_default_corpus_is_the_python_stdlib_sources():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    stream = corpus_bytes(TextData())
    header = b"# ==== os.py ====\n"
    start = stream.index(header) + len(header)
    os_py = (stdlib / "os.py").read_bytes()
    assert stream[start:start + len(os_py)] == os_py                 # the file itself, verbatim
    assert b"# ==== json/decoder.py ====\n" in stream
    for skipped in (b"site-packages/", b"test/", b"idlelib/", b"lib2to3/"):
        assert b"# ==== " + skipped not in stream
    path, info = build_text_corpus(TextData(), seq=128)
    assert path.suffix == ".array_record" and info["bytes"] == len(stream)
    assert info["windows"] == (len(stream) - 1) // 128 and info["files"] > 300


def test_every_window_is_the_next_slice_of_the_stream():
    stream = corpus_bytes(SMALL)
    seq = 48
    records, info = source(SMALL, seq=seq, vocab_size=256)
    assert len(records) == (len(stream) - 1) // seq == info["windows"]
    for i in range(len(records)):                                      # all of them
        want = np.frombuffer(stream[i * seq:i * seq + seq + 1], np.uint8)
        np.testing.assert_array_equal(records[i], want)
    assert records[0].dtype == np.int32


def test_corpus_is_written_once_and_read_through_grain(tmp_path):
    path, info = build_text_corpus(SMALL, seq=32, cache_dir=tmp_path)
    mtime = path.stat().st_mtime_ns
    again, info2 = build_text_corpus(SMALL, seq=32, cache_dir=tmp_path)
    assert again == path and again.stat().st_mtime_ns == mtime and info2 == info
    src = grain.sources.ArrayRecordDataSource(str(path))               # Grain's own reader
    assert len(src) == -(-info["windows"] // info["per_record"])
    assert src[0][:33] == corpus_bytes(SMALL)[:33]
    assert json.loads((tmp_path / next(p.name for p in tmp_path.glob("listing-*.json")))
                      .read_text())["sha256"] == info["sha256"]


def test_shuffle_is_a_seeded_permutation_reshuffled_each_epoch():
    ds, info = grain_dataset(SMALL, seq=64, batch=1, seed=3, vocab_size=256)
    n = info["epoch_records"]
    rows = lambda d, lo, hi: [bytes(d[i][0].astype(np.uint8)) for i in range(lo, hi)]
    windows = [bytes(w.astype(np.uint8)) for w in source(SMALL, seq=64, vocab_size=256)[0]]
    epoch0, epoch1 = rows(ds, 0, n), rows(ds, n, 2 * n)
    assert sorted(epoch0) == sorted(windows) == sorted(epoch1)         # each window once
    assert epoch0 != windows and epoch0 != epoch1
    same, _ = grain_dataset(SMALL, seq=64, batch=1, seed=3, vocab_size=256)
    other, _ = grain_dataset(SMALL, seq=64, batch=1, seed=4, vocab_size=256)
    assert rows(same, 0, 50) == epoch0[:50] and rows(other, 0, 50) != epoch0[:50]


def test_process_shards_reassemble_the_single_process_batch():
    one, _ = grain_dataset(SMALL, seq=32, batch=8, seed=0, vocab_size=256)
    parts = [grain_dataset(SMALL, seq=32, batch=8, seed=0, vocab_size=256, process_index=p,
                     process_count=4)[0] for p in range(4)]
    for j in range(5):
        local = [parts[p][j] for p in range(4)]
        assert all(x.shape == (2, 33) for x in local)
        np.testing.assert_array_equal(np.concatenate(local), one[j])  # same rows, same order
    with pytest.raises(ValueError, match="batch=6 is not divisible by the 4 processes"):
        grain_dataset(SMALL, seq=32, batch=6, seed=0, vocab_size=256, process_count=4)


def test_global_batch_is_sharded_over_the_data_axis(mesh):
    sh = NamedSharding(mesh, P("data", None))
    it = ShardedBatches(SMALL, seq=32, batch=16, seed=0, sharding=sh, vocab_size=256)
    ref, _ = grain_dataset(SMALL, seq=32, batch=16, seed=0, vocab_size=256)
    batch = next(it)
    assert batch["inputs"].shape == batch["targets"].shape == (16, 32)
    assert batch["inputs"].sharding == sh and batch["inputs"].dtype == np.int32
    for shard in batch["inputs"].addressable_shards:                   # 2 rows per device
        rows = shard.index[0]
        np.testing.assert_array_equal(shard.data, ref[0][rows, :-1])
    np.testing.assert_array_equal(np.asarray(batch["targets"]), ref[0][:, 1:])


def test_iterator_state_resumes_exactly(mesh):
    sh = NamedSharding(mesh, P("data"))
    a = ShardedBatches(SMALL, seq=16, batch=8, seed=1, sharding=sh, vocab_size=256)
    for _ in range(7):
        next(a)
    state = a.get_state()
    want = [np.asarray(next(a)["inputs"]) for _ in range(5)]
    b = ShardedBatches(SMALL, seq=16, batch=8, seed=1, sharding=sh, vocab_size=256, prefetch=0)
    b.set_state(state)
    got = [np.asarray(next(b)["inputs"]) for _ in range(5)]
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(w, g)
    assert json.loads(state) == {"next_index": 7}


def test_batch_not_divisible_by_the_data_axis_is_a_clear_error(mesh):
    sh = NamedSharding(mesh, P("data"))
    with pytest.raises(ValueError, match=r"batch=12 is not divisible by the 8 shards.*'data'"):
        ShardedBatches(SMALL, seq=16, batch=12, seed=0, sharding=sh, vocab_size=256)


def test_synthetic_rows_are_the_seeded_progressions(mesh):
    spec = SyntheticData(size=100, seed=5)
    records, info = source(spec, seq=10, vocab_size=50)
    for i in (0, 7, 99):
        rng = np.random.default_rng((5, i))
        a, b = rng.integers(0, 50), rng.integers(1, 50)
        np.testing.assert_array_equal(records[i], (a + b * np.arange(11)) % 50)
    assert info["vocab_size"] == 50
    it = ShardedBatches("synthetic", seq=8, batch=8, seed=0, vocab_size=256,
                        sharding=NamedSharding(mesh, P("data")))
    x = np.asarray(next(it)["inputs"])
    assert x.min() >= 0 and x.max() < 256


def test_vocab_too_small_for_bytes_is_a_clear_error():
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the 256 byte tokens"):
        source(SMALL, seq=8, vocab_size=100)


def test_data_spec_normalises_names_dicts_and_specs():
    assert as_spec("text") == TextData()
    assert as_spec("synthetic") == SyntheticData()
    spec = TextData(root="/tmp", patterns=("*.txt",), max_bytes=10)
    assert as_spec(spec.to_dict()) == spec
    assert as_spec(json.loads(json.dumps(SyntheticData(size=7).to_dict()))) == \
        SyntheticData(size=7)
    with pytest.raises(ValueError, match="unknown data 'imagenet'"):
        as_spec("imagenet")
