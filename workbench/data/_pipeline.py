"""Grain input pipelines: sources, seeded global shuffle, per-process batches, global arrays.

One pipeline serves every process count. Records are shuffled globally with a seed (and
reshuffled each epoch), then grouped into blocks of ``batch / processes`` records; global
batch ``j`` is blocks ``j*P .. j*P+P-1`` and process ``p`` reads block ``j*P + p``. So the
global batch holds the same records in the same row order whether one process or many read
it, and no process reads rows it does not own. Each process's rows become one global
``jax.Array`` through ``jax.make_array_from_process_local_data``. The iterator's position
is Grain's own checkpointable state.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import grain
import numpy as np

from workbench._validate import check_int, check_path
from workbench.data._corpus import TextData, build_text_corpus
from workbench.data._dataset import Dataset, prepare
from workbench.data._packing import row_batch


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticData:
    """Synthetic token rows for benchmarks and quick tests (nothing read from disk).

    Row ``i`` is the progression ``(a + b * t) mod vocab`` for ``t = 0..seq`` with ``a, b``
    drawn from a generator seeded by ``(seed, i)``: cheap to make, identical on every
    machine, and learnable (the loss falls), unlike uniform noise.

    Attributes:
      vocab_size: token ids are below this; ``None`` uses the model's vocabulary.
      size: number of distinct rows (an epoch).
      seed: seed of the rows themselves (the shuffle uses the run's seed).
    """

    vocab_size: int | None = None
    size: int = 1 << 20
    seed: int = 0

    def __post_init__(self) -> None:
        check_int(self.size, "SyntheticData.size", fix="give the number of distinct rows")
        if self.vocab_size is not None:
            check_int(self.vocab_size, "SyntheticData.vocab_size", minimum=2,
                      fix="give at least 2 tokens, or None for the model's vocabulary")
        check_int(self.seed, "SyntheticData.seed", minimum=0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form with ``"kind": "synthetic"``."""
        return {"kind": "synthetic", **dataclasses.asdict(self)}


DataSpec = TextData | SyntheticData | Dataset
_KINDS: dict[str, type[TextData | SyntheticData | Dataset]] = {
    "text": TextData, "synthetic": SyntheticData, "dataset": Dataset}


def as_spec(value: str | Mapping[str, Any] | DataSpec) -> DataSpec:
    """Normalises ``"text"``, ``"synthetic"``, a ``to_dict()`` mapping or a spec object."""
    return _data_spec(value, "value")


def _data_spec(value: Any, name: str) -> DataSpec:
    """:func:`as_spec`, its errors naming the argument ``name`` ("value", "spec")."""
    if isinstance(value, (TextData, SyntheticData, Dataset)):
        return value
    if isinstance(value, str):
        if value not in _KINDS:
            raise ValueError(f"unknown data {value!r}; the {name} must be 'text', 'synthetic', "
                             "wb.data.TextData(...) or wb.data.SyntheticData(...)")
        return _KINDS[value]()
    if isinstance(value, Mapping):
        fields = dict(value)
        kind = fields.pop("kind", None)
        if not isinstance(kind, str) or kind not in _KINDS:
            raise ValueError(f"data spec {dict(value)} needs 'kind': 'text', 'synthetic' or "
                             f"'dataset' (the {name} given has kind={kind!r})")
        cls = _KINDS[kind]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(fields) - known))
        if unknown:
            raise ValueError(f"data spec {dict(value)} has fields {unknown} that "
                             f"{cls.__name__} lacks (the {name} given); its fields are "
                             f"{sorted(known)}")
        for key, val in fields.items():
            if isinstance(val, list):
                fields[key] = tuple(val)
        return cls(**fields)
    raise TypeError(f"{name}={value!r} is a {type(value).__name__}; data must be 'text', "
                    "'synthetic', a dict or a spec (wb.data.TextData, wb.data.Dataset, ...)")


def _check_shape(seq: Any, vocab_size: Any, cache_dir: Any) -> Any:
    """Checks ``seq`` and ``vocab_size``; returns ``cache_dir`` as a Path (or None)."""
    check_int(seq, "seq", fix="give the tokens per training sequence")
    check_int(vocab_size, "vocab_size", minimum=2, fix="give the model's vocabulary size")
    return None if cache_dir is None else check_path(cache_dir, "cache_dir")


def _synthetic_row(index: int, *, seq: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng((seed, index))
    a, b = rng.integers(0, vocab), rng.integers(1, vocab)
    return ((a + b * np.arange(seq + 1, dtype=np.int64)) % vocab).astype(np.int32)  # (seq+1,)


class _Windows:
    """Window ``i`` of a text corpus: record ``i // per_record``, bytes at ``(i % k) * seq``."""

    def __init__(self, src: grain.sources.ArrayRecordDataSource, *, seq: int,
                 per_record: int) -> None:
        self.src, self.seq, self.per_record = src, seq, per_record

    def __call__(self, i: int) -> np.ndarray:
        record, k = divmod(int(i), self.per_record)
        start = k * self.seq
        raw = np.frombuffer(self.src[record], dtype=np.uint8)  # (k * seq + 1,)
        return raw[start: start + self.seq + 1].astype(np.int32)  # (seq + 1,)


def source(spec: DataSpec, *, seq: int, vocab_size: int,
           cache_dir: str | os.PathLike[str] | None = None
           ) -> tuple[grain.MapDataset, dict[str, Any]]:
    """Records of ``seq + 1`` int32 tokens, in corpus order, and a description; for a
    ``Dataset``, packed rows (dicts of ``tokens``, ``segments``, ``positions``).

    Args:
      spec: the data spec.
      seq: tokens per training sequence.
      vocab_size: the model's vocabulary; every token id must be below it.
      cache_dir: where the text corpus' ArrayRecord file lives (default: the user cache).
    """
    spec = _data_spec(spec, "spec")
    cache_dir = _check_shape(seq, vocab_size, cache_dir)
    if isinstance(spec, Dataset):
        prepared = prepare(spec, seq=seq, vocab_size=vocab_size, cache_dir=cache_dir)
        return prepared.train, prepared.info
    if isinstance(spec, TextData):
        if vocab_size < spec.vocab_size:
            raise ValueError(
                f"the model's vocab_size={vocab_size} is smaller than the {spec.vocab_size} "
                "byte tokens of text data; use a model with vocab_size >= 256 "
                "(e.g. model='tiny' or GPTConfig(..., vocab_size=256))")
        path, info = build_text_corpus(spec, seq, cache_dir)
        src = grain.sources.ArrayRecordDataSource(str(path))
        windows = _Windows(src, seq=seq, per_record=int(info["per_record"]))
        return grain.MapDataset.range(int(info["windows"])).map(windows), {"kind": "text", **info}
    vocab = spec.vocab_size or vocab_size
    if vocab > vocab_size:
        raise ValueError(f"SyntheticData.vocab_size={vocab} exceeds the model's "
                         f"vocab_size={vocab_size}; lower it or leave it None")

    def row(i: int) -> np.ndarray:
        return _synthetic_row(i, seq=seq, vocab=vocab, seed=spec.seed)

    info = {"kind": "synthetic", "records": spec.size, "vocab_size": vocab, "seq": seq}
    return grain.MapDataset.range(spec.size).map(row), info


def grain_dataset(spec: DataSpec, *, seq: int, batch: int, seed: int, vocab_size: int,
            process_index: int = 0, process_count: int = 1,
            cache_dir: str | os.PathLike[str] | None = None
            ) -> tuple[grain.MapDataset, dict[str, Any]]:
    """This process's batches: shuffled, repeated forever, ``(batch/P, seq+1)`` int32.

    Args:
      spec: the data spec.
      seq: tokens per sequence.
      batch: the *global* batch size (all processes together).
      seed: shuffle seed (each epoch is reshuffled from it).
      vocab_size: the model's vocabulary.
      process_index, process_count: this process and how many read.
      cache_dir: where the text corpus lives.
    """
    _check_batches(batch, seed, process_index, process_count)
    records, info = source(spec, seq=seq, vocab_size=vocab_size, cache_dir=cache_dir)
    return batched(records, batch=batch, seed=seed, process_index=process_index,
                   process_count=process_count), {**info, "epoch_records": len(records)}


def batched(records: grain.MapDataset, *, batch: int, seed: int | None, process_index: int = 0,
            process_count: int = 1) -> grain.MapDataset:
    """This process's batches of ``records``: shuffled by ``seed`` (None: in order) and
    repeated forever, ``batch / process_count`` records each.

    Global batch ``j`` is blocks ``j*P .. j*P+P-1`` of ``batch/P`` consecutive (shuffled)
    records; process ``p`` takes block ``j*P + p``.
    """
    if not isinstance(records, grain.MapDataset):
        raise TypeError(f"records={records!r} is a {type(records).__name__}; give a "
                        "grain.MapDataset (e.g. the first result of wb.data.source)")
    _check_batches(batch, seed, process_index, process_count)
    if batch % process_count:
        raise ValueError(f"batch={batch} is not divisible by the {process_count} processes "
                         f"that load it (process_count={process_count}); use a multiple of "
                         f"{process_count}")
    local = batch // process_count
    ds = records.shuffle(seed=seed) if seed is not None else records
    ds = ds.repeat(None).batch(local, drop_remainder=True)
    return ds[process_index::process_count]


#: Grain's shuffle seeds are below this.
MAX_SEED = 2**32 - 1


def _check_batches(batch: Any, seed: Any, process_index: Any, process_count: Any) -> None:
    check_int(batch, "batch", fix="give the global batch size")
    if seed is not None:
        check_int(seed, "seed", minimum=0, maximum=MAX_SEED,
                  fix="Grain's shuffle takes seeds below 2**32 (None: no shuffle)")
    check_int(process_count, "process_count", fix="give how many processes read")
    check_int(process_index, "process_index", minimum=0, maximum=process_count - 1,
              fix=f"give this process's index among the {process_count} that read")


#: The entries of a batch of packed rows (``workbench.data._packing.row_batch``).
PACKED_KEYS: tuple[str, ...] = ("inputs", "targets", "mask", "segment_ids", "positions")


def batch_keys(spec: str | Mapping[str, Any] | DataSpec) -> tuple[str, ...]:
    """The entries of the batches a data spec gives (each int32 ``(batch, seq)``)."""
    return PACKED_KEYS if isinstance(_data_spec(spec, "spec"), Dataset) else ("inputs", "targets")


def batch_shards(sharding: Any) -> int:
    """How many ways a ``NamedSharding`` splits dim 0 (the batch) across devices."""
    import jax

    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise TypeError(f"sharding={sharding!r} is a {type(sharding).__name__}; give a "
                        "jax.sharding.NamedSharding of the (batch, seq) batches, e.g. "
                        "NamedSharding(mesh, PartitionSpec('data'))")
    spec = sharding.spec
    first = spec[0] if len(spec) else None
    axes = (first,) if isinstance(first, str) else tuple(first or ())
    return math.prod(sharding.mesh.shape[a] for a in axes)


class ShardedBatches:
    """An endless, checkpointable iterator of global batches ``{"inputs", "targets"}``.

    Each is an int32 ``jax.Array`` of shape ``(batch, seq)`` laid out by ``sharding``;
    ``targets`` is ``inputs`` shifted by one token.

    Args:
      spec: ``"text"``, ``"synthetic"`` or a spec object.
      seq: tokens per sequence (records hold ``seq + 1``: inputs plus next-token targets).
      batch: the global batch size.
      seed: shuffle seed.
      sharding: the ``NamedSharding`` of a ``(batch, seq)`` array (dim 0 over the data axes).
      vocab_size: the model's vocabulary.
      prefetch: batches read ahead by Grain's background threads (0 to read inline).
      cache_dir: where the text corpus lives.

    ``get_state()`` / ``set_state()`` exchange Grain's iterator state (JSON bytes); the
    object can be passed to ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore``.
    """

    def __init__(self, spec: str | Mapping[str, Any] | DataSpec, *, seq: int, batch: int,
                 seed: int, sharding: Any, vocab_size: int, prefetch: int = 2,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        import jax

        self.spec = _data_spec(spec, "spec")
        check_int(seq, "seq", fix="give the tokens per training sequence")
        check_int(batch, "batch", fix="give the global batch size")
        check_int(prefetch, "prefetch", minimum=0, fix="0 reads inline")
        shards = batch_shards(sharding)
        if batch % shards:
            axes = sharding.spec[0]
            raise ValueError(
                f"batch={batch} is not divisible by the {shards} shards of its batch dim "
                f"(mesh axes {axes!r} of mesh {dict(sharding.mesh.shape)}); use a batch that "
                f"is a multiple of {shards}, e.g. batch={max(shards, batch - batch % shards)}")
        self.sharding = sharding
        self.global_shape = (batch, seq + 1)
        self._eval_rows: grain.MapDataset | None = None
        where = {"process_index": jax.process_index(), "process_count": jax.process_count()}
        if isinstance(self.spec, Dataset):
            _check_batches(batch, seed, where["process_index"], where["process_count"])
            prepared = prepare(self.spec, seq=seq, vocab_size=vocab_size, cache_dir=cache_dir)
            self._eval_rows = prepared.eval
            self._ds = batched(prepared.train, batch=batch, seed=seed, **where)
            self.info = {**prepared.info, "epoch_records": len(prepared.train)}
        else:
            self._ds, self.info = grain_dataset(self.spec, seq=seq, batch=batch, seed=seed,
                                          vocab_size=vocab_size, cache_dir=cache_dir, **where)
        self.packed = isinstance(self.spec, Dataset)
        #: The entries of each batch (int32 ``(batch, seq)`` each).
        self.keys: tuple[str, ...] = batch_keys(self.spec)
        options = grain.ReadOptions(num_threads=max(1, min(prefetch, 4)),
                                    prefetch_buffer_size=prefetch) if prefetch else \
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._iter = iter(self._ds.to_iter_dataset(options))

    def __iter__(self) -> ShardedBatches:
        return self

    def next_local(self) -> Any:
        """This process's rows of the next batch, ``(batch/P, seq+1)`` int32, on the host
        (packed data: a dict of ``tokens``, ``segments``, ``positions``, each that shape)."""
        return next(self._iter)

    def _global(self, local: Any) -> dict[str, Any]:
        import jax

        shape = (self.global_shape[0], self.global_shape[1] - 1)   # (batch, seq)
        parts = row_batch(local) if self.packed else \
            {"inputs": local[:, :-1], "targets": local[:, 1:]}     # (batch/P, seq) each
        return {k: jax.make_array_from_process_local_data(self.sharding, v, shape)
                for k, v in parts.items()}

    def __next__(self) -> dict[str, Any]:
        return self._global(self.next_local())

    @property
    def eval_rows(self) -> int:
        """Rows of the held-out split (0 without one)."""
        return 0 if self._eval_rows is None else len(self._eval_rows)

    def eval_batches(self, count: int) -> list[dict[str, Any]]:
        """The first ``count`` global batches of the held-out rows, in order: the same
        batches every time (each process reads its own block of each).

        Raises:
          ValueError: no eval split, or fewer than ``count`` batches of held-out rows.
        """
        import jax

        batch = self.global_shape[0]
        if self._eval_rows is None:
            raise ValueError("eval needs a held-out split: wb.data.Dataset(..., "
                             "eval_fraction=0.05) or Dataset(..., eval_files=...)")
        have = len(self._eval_rows) // batch
        if have < count:
            raise ValueError(
                f"the eval split has {len(self._eval_rows)} packed rows of seq+1="
                f"{self.global_shape[1]} tokens: {have} batch(es) of batch={batch}, fewer "
                f"than eval_batches={count}. Use eval_batches<={have} (at least 1), a "
                "larger eval_fraction, or more eval files")
        ds = batched(self._eval_rows, batch=batch, seed=None,
                     process_index=jax.process_index(), process_count=jax.process_count())
        return [self._global(ds[j]) for j in range(count)]

    def get_state(self) -> bytes:
        """The position in the stream (Grain's state, JSON)."""
        return json.dumps(self._iter.get_state(), sort_keys=True).encode()

    def set_state(self, state: bytes | str | Mapping[str, Any]) -> None:
        """Moves to a position returned by :meth:`get_state`."""
        if isinstance(state, (bytes, str)):
            state = json.loads(state)
        self._iter.set_state(dict(state))

    def start_prefetch(self) -> None:
        """Called by Grain's checkpoint handler after a restore; Grain prefetches lazily."""
